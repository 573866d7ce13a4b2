package delay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/topology"
)

func lookup(t *testing.T, s Spec) backend.Backend {
	t.Helper()
	b, err := Lookup(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func levels(n int) *binaryLevels { return &binaryLevels{names: names.Names{Prefix: "p"}, levels: n} }

// TestEffective: what each backend applies for a requested delay.
func TestEffective(t *testing.T) {
	tiers := lookup(t, Spec{Name: TTLTiers().Name(), Prefix: "p", Tiers: []time.Duration{5 * time.Second, time.Second, 2 * time.Second}})
	dx := lookup(t, Spec{Name: DelayedExchange().Name(), Prefix: "p"})
	dr := lookup(t, Spec{Name: DelayedRetry(0).Name(), RetryDelay: 3 * time.Second})
	mem := lookup(t, Spec{Name: Memory(nil).Name()})
	maxPlugin := (1<<32 - 1) * time.Millisecond
	for _, tt := range []struct {
		backend   backend.Backend
		requested time.Duration
		want      time.Duration // 0 with tooLong
		tooLong   bool
	}{
		// ttl-tiers: up to the next tier; past the longest, the longest.
		{tiers, -time.Second, time.Second, false},
		{tiers, 0, time.Second, false},
		{tiers, time.Nanosecond, time.Second, false},
		{tiers, time.Second, time.Second, false},
		{tiers, 1500 * time.Millisecond, 2 * time.Second, false},
		{tiers, 2*time.Second + time.Nanosecond, 5 * time.Second, false},
		{tiers, 5 * time.Second, 5 * time.Second, false},
		{tiers, time.Hour, 5 * time.Second, false},
		// binary-levels: up to whole seconds, at most 2^levels - 1 s.
		{levels(4), 0, 0, false},
		{levels(4), -time.Second, 0, false},
		{levels(4), time.Nanosecond, time.Second, false},
		{levels(4), time.Second, time.Second, false},
		{levels(4), 1500 * time.Millisecond, 2 * time.Second, false},
		{levels(4), 14*time.Second + time.Nanosecond, 15 * time.Second, false},
		{levels(4), 15 * time.Second, 15 * time.Second, false},
		{levels(4), 15*time.Second + time.Nanosecond, 0, true},
		{levels(4), 16 * time.Second, 0, true},
		{levels(1), time.Second, time.Second, false},
		{levels(1), 2 * time.Second, 0, true},
		{levels(28), (1<<28 - 1) * time.Second, (1<<28 - 1) * time.Second, false},
		{levels(28), (1 << 28) * time.Second, 0, true},
		{levels(29), (1<<29 - 1) * time.Second, (1<<29 - 1) * time.Second, false},
		// delayed-exchange: up to whole milliseconds, at least 1 ms, at most 2^32-1 ms.
		{dx, 0, time.Millisecond, false},
		{dx, -time.Second, time.Millisecond, false},
		{dx, time.Nanosecond, time.Millisecond, false},
		{dx, 1200 * time.Microsecond, 2 * time.Millisecond, false},
		{dx, 5 * time.Second, 5 * time.Second, false},
		{dx, maxPlugin, maxPlugin, false},
		{dx, maxPlugin + time.Nanosecond, 0, true},
		{dx, 50 * 24 * time.Hour, 0, true},
		// delayed-retry: the queue's delay, whatever is asked.
		{dr, 0, 3 * time.Second, false},
		{dr, time.Hour, 3 * time.Second, false},
		// memory: as asked.
		{mem, 1500 * time.Microsecond, 1500 * time.Microsecond, false},
		{mem, time.Hour, time.Hour, false},
	} {
		got, err := tt.backend.Effective(tt.requested)
		name := fmt.Sprintf("%s(%v) %s", tt.backend.Name(), tt.backend, tt.requested)
		switch {
		case tt.tooLong && !errors.Is(err, ErrDelayTooLong):
			t.Errorf("%s: err %v, want ErrDelayTooLong", name, err)
		case tt.tooLong && (!strings.Contains(err.Error(), tt.requested.String()) || !strings.HasPrefix(err.Error(), string(tt.backend.Name())+": ")):
			t.Errorf("%s: error %q does not name the backend and the delay", name, err)
		case !tt.tooLong && (err != nil || got != tt.want):
			t.Errorf("%s: %s, %v; want %s", name, got, err, tt.want)
		}
	}
	_, err := levels(4).Effective(16 * time.Second)
	if want := "binary-levels: delay too long: 16s is longer than the maximum 15s (2^4 - 1 s)"; err == nil || err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}
}

func TestBinaryLevelsRoutingKey(t *testing.T) {
	for _, tt := range []struct {
		levels int
		delay  time.Duration
		queue  string
		want   string
	}{
		{4, 0, "orders", "0.0.0.0.orders"},
		{4, time.Second, "orders", "0.0.0.1.orders"},
		{4, 5 * time.Second, "orders", "0.1.0.1.orders"},
		{4, 8 * time.Second, "orders", "1.0.0.0.orders"},
		{4, 15 * time.Second, "x.orders", "1.1.1.1.x.orders"},
		{1, time.Second, "q", "1.q"},
		{8, 65 * time.Second, "q", "0.1.0.0.0.0.0.1.q"},
		{28, 65 * time.Second, "q", strings.Repeat("0.", 21) + "1.0.0.0.0.0.1.q"},
		{28, (1<<28 - 1) * time.Second, "q", strings.Repeat("1.", 28) + "q"},
	} {
		b := levels(tt.levels)
		if got := b.routingKey(tt.delay, tt.queue); got != tt.want {
			t.Errorf("levels %d, %s to %s: key %q, want %q", tt.levels, tt.delay, tt.queue, got, tt.want)
		} else if b.QueueOf(got) != tt.queue {
			t.Errorf("levels %d: QueueOf finds %q, not queue %q, in key %q", tt.levels, b.QueueOf(got), tt.queue, got)
		}
	}
}

func TestBinaryLevelsBindings(t *testing.T) {
	topo := levels(4).Topology()
	type bind struct {
		exchange, key, dest string
		toExchange          bool
	}
	var got []bind
	for _, b := range topo.Bindings {
		got = append(got, bind{b.Exchange, b.Key, b.Destination, b.ToExchange})
	}
	want := []bind{
		{"p.parking", "", "p.parking", false},
		{"p.level.0", "*.*.*.1.#", "p.level.0", false},
		{"p.level.0", "*.*.*.0.#", "p.levels.deliver", true},
		{"p.level.1", "*.*.1.#", "p.level.1", false},
		{"p.level.1", "*.*.0.#", "p.level.0", true},
		{"p.level.2", "*.1.#", "p.level.2", false},
		{"p.level.2", "*.0.#", "p.level.1", true},
		{"p.level.3", "1.#", "p.level.3", false},
		{"p.level.3", "0.#", "p.level.2", true},
	}
	if !slices.Equal(got, want) {
		t.Errorf("bindings\n%v\nwant\n%v", got, want)
	}
	if topo.Queues[0].Name != "p.parking" || len(topo.Queues) != 5 {
		t.Fatalf("queues %+v, want parking and 4 levels", topo.Queues)
	}
	for l, q := range topo.Queues[1:] {
		next := "p.levels.deliver"
		if l > 0 {
			next = fmt.Sprintf("p.level.%d", l-1)
		}
		if ttl, dlx := q.Args[declare.MessageTTLArg], q.Args[declare.DeadLetterExchangeArg]; ttl != int64(1000<<l) || dlx != next || q.Name != fmt.Sprintf("p.level.%d", l) {
			t.Errorf("queue %d: %s ttl %v dlx %v", l, q.Name, ttl, dlx)
		}
		checkDelayQueue(t, q)
	}
	for _, e := range topo.Exchanges {
		if e.Name == "p.levels.deliver" && (e.Kind != amqp.ExchangeTopic || e.Args[declare.AlternateExchangeArg] != "p.parking") {
			t.Errorf("delivery exchange %+v, want topic with alternate-exchange p.parking", e)
		}
		if e.Name == "p.deliver" {
			t.Error("binary-levels declares p.deliver, ttl-tiers' direct exchange: a shared prefix would fail with 406")
		}
	}
}

// checkDelayQueue: a queue that keeps messages for a TTL is an at-least-once quorum
// queue that refuses publishes when full (a drop-head would lose the oldest retry).
func checkDelayQueue(t *testing.T, q topology.Queue) {
	t.Helper()
	if q.Args[declare.DeadLetterStrategyArg] != declare.DeadLetterAtLeastOnce || q.Args[declare.QueueTypeArg] != declare.QueueTypeQuorum ||
		q.Args[declare.OverflowArg] != declare.OverflowRejectPublish {
		t.Errorf("queue %s: args %v, want an at-least-once quorum queue rejecting publishes when full", q.Name, q.Args)
	}
}

func TestTTLTiersTopology(t *testing.T) {
	b := lookup(t, Spec{Name: TTLTiers().Name(), Prefix: "p", Tiers: []time.Duration{90 * time.Second, time.Second}})
	topo := b.Topology()
	var queues []string
	for _, q := range topo.Queues {
		queues = append(queues, q.Name)
	}
	if want := []string{"p.parking", "p.delay.1s", "p.delay.1m30s"}; !slices.Equal(queues, want) {
		t.Fatalf("queues %v, want %v (tiers ascending)", queues, want)
	}
	for i, q := range topo.Queues[1:] {
		ttl := []int64{1000, 90000}[i]
		if q.Args[declare.MessageTTLArg] != ttl || q.Args[declare.DeadLetterExchangeArg] != "p.deliver" {
			t.Errorf("%s: args %v", q.Name, q.Args)
		}
		checkDelayQueue(t, q)
	}
	tier := topo.Bindings[1]
	if tier.Exchange != "p.delay" || tier.Destination != "p.delay.1s" || tier.Args["x-match"] != "all" || tier.Args["amqpretry-tier"] != "1s" {
		t.Errorf("tier binding %+v", tier)
	}
	kinds := map[string]string{}
	for _, e := range topo.Exchanges {
		kinds[e.Name] = e.Kind
		if e.Name == "p.deliver" && e.Args[declare.AlternateExchangeArg] != "p.parking" {
			t.Errorf("delivery exchange %+v, want alternate-exchange p.parking", e)
		}
	}
	if want := map[string]string{"p.parking": "fanout", "p.deliver": "direct", "p.delay": "headers"}; !maps.Equal(kinds, want) {
		t.Errorf("exchanges %v, want %v", kinds, want)
	}
	wq := b.WorkQueue("orders")
	if last := wq.Bindings[len(wq.Bindings)-1]; !reflect.DeepEqual(last, topology.Binding{Exchange: "p.deliver", Destination: "orders", Key: "orders"}) {
		t.Errorf("work queue binding %+v", last)
	}
	if got := b.DelayQueues(); !slices.Equal(got, []backend.DelayQueue{{Name: "p.delay.1s", TTL: time.Second}, {Name: "p.delay.1m30s", TTL: 90 * time.Second}}) {
		t.Errorf("DelayQueues %v", got)
	}
}

func TestBinaryLevelsWorkQueue(t *testing.T) {
	b := levels(4)
	b.env.Handoff = &nopHandoff{} // never reached: Park refuses the name first
	tooLong := strings.Repeat("q", names.MaxBytes-2*4+1)
	for _, tt := range []struct {
		queue string
		key   string // "" for no binding
	}{
		{"orders", "*.*.*.*.orders"},
		{"x.orders", "*.*.*.*.x.orders"},
		{tooLong[1:], "*.*.*.*." + tooLong[1:]},
		{"", ""},
		{"a*", ""},
		{"#", ""},
		{"a.#.b", ""},
		{tooLong, ""},
	} {
		var keys []string
		for _, bd := range b.WorkQueue(tt.queue).Bindings {
			if bd.Exchange == "p.levels.deliver" {
				keys = append(keys, bd.Key)
			}
		}
		if tt.key == "" && len(keys) != 0 || tt.key != "" && (len(keys) != 1 || keys[0] != tt.key) {
			t.Errorf("WorkQueue(%.20q): delivery bindings %q, want %q", tt.queue, keys, tt.key)
		}
		if tt.key != "" {
			continue
		}
		if err := b.Park(context.Background(), tt.queue, message.NewMessage("m", nil), time.Second); err == nil || !strings.Contains(err.Error(), "queue") || !strings.HasPrefix(err.Error(), "binary-levels: ") {
			t.Errorf("Park(%.20q): %v, want an error about the queue", tt.queue, err)
		}
	}
}

// TestBinaryLevelsRouteEveryDelay follows each delay through the declared topology as
// RabbitMQ would: topic matching, exchange-to-exchange bindings, queue TTL, dead
// lettering and the alternate exchange.
func TestBinaryLevelsRouteEveryDelay(t *testing.T) {
	b := levels(4)
	queues := []string{"orders", "x.orders", "a.b.c"}
	topo := backend.Plan(b, queues...)
	for secs := range 16 {
		for _, q := range queues {
			d := time.Duration(secs) * time.Second
			end, waited, hops := travel(t, topo, b.names.Level(3), b.routingKey(d, q))
			if end != q || waited != d {
				t.Errorf("%s to %s: ended in %s after %s, want %s after %s", d, q, end, waited, q, d)
			}
			if want := strings.Count(b.routingKey(d, q)[:8], "1"); hops != want {
				t.Errorf("%s to %s: waited in %d levels, want %d (one per set bit)", d, q, hops, want)
			}
		}
	}
	if end, waited, _ := travel(t, topo, b.names.Level(3), b.routingKey(5*time.Second, "gone")); end != "p.parking" || waited != 5*time.Second {
		t.Errorf("retry for a queue with no binding ended in %s after %s, want parked after 5s", end, waited)
	}
}

// travel returns the queue without TTL where a message published to exchange with key
// ends up, how long it waited in TTL queues and in how many.
func travel(t *testing.T, topo topology.Topology, exchange, key string) (string, time.Duration, int) {
	t.Helper()
	var waited time.Duration
	for hops := 0; ; hops++ {
		dests := route(topo, exchange, key)
		if len(dests) != 1 {
			t.Fatalf("key %q at exchange %s: routed to %v, want one queue", key, exchange, dests)
		}
		var q topology.Queue
		for _, cand := range topo.Queues {
			if cand.Name == dests[0] {
				q = cand
			}
		}
		ttl, ok := q.Args[declare.MessageTTLArg].(int64)
		if !ok {
			return dests[0], waited, hops
		}
		waited += time.Duration(ttl) * time.Millisecond
		exchange = q.Args[declare.DeadLetterExchangeArg].(string)
	}
}

// route returns the queues exchange routes key to (the broker merges duplicate
// bindings: so does route).
func route(topo topology.Topology, exchange, key string) []string {
	var kind, alternate string
	for _, e := range topo.Exchanges {
		if e.Name == exchange {
			kind = e.Kind
			alternate, _ = e.Args[declare.AlternateExchangeArg].(string)
		}
	}
	var out []string
	for _, b := range topo.Bindings {
		if b.Exchange != exchange || kind == amqp.ExchangeTopic && !topicMatch(strings.Split(b.Key, "."), strings.Split(key, ".")) {
			continue
		}
		if b.ToExchange {
			out = append(out, route(topo, b.Destination, key)...)
		} else {
			out = append(out, b.Destination)
		}
	}
	if len(out) == 0 && alternate != "" {
		return route(topo, alternate, key)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// topicMatch matches words as a topic exchange does: '*' is one word, '#' zero or more.
func topicMatch(pattern, key []string) bool {
	switch {
	case len(pattern) == 0:
		return len(key) == 0
	case pattern[0] == "#":
		return topicMatch(pattern[1:], key) || len(key) > 0 && topicMatch(pattern, key[1:])
	case len(key) == 0:
		return false
	}
	return (pattern[0] == "*" || pattern[0] == key[0]) && topicMatch(pattern[1:], key[1:])
}

func TestDelayedExchangeTopology(t *testing.T) {
	b := lookup(t, Spec{Name: DelayedExchange().Name(), Prefix: "p"})
	wq := b.WorkQueue("orders")
	if len(wq.Exchanges) != 1 || len(wq.Queues) != 0 || len(wq.Bindings) != 1 {
		t.Fatalf("WorkQueue: %+v, want the exchange and one binding", wq)
	}
	e := wq.Exchanges[0]
	if e.Name != "p.delayed" || e.Kind != declare.ExchangeDelayedMessage || e.Args[declare.DelayedTypeArg] != amqp.ExchangeDirect {
		t.Errorf("exchange %+v, want p.delayed of type x-delayed-message, x-delayed-type direct", e)
	}
	if _, ok := e.Args[declare.AlternateExchangeArg]; ok {
		t.Error("an alternate exchange would receive every delayed publish at once")
	}
	if bd := wq.Bindings[0]; !reflect.DeepEqual(bd, topology.Binding{Exchange: "p.delayed", Destination: "orders", Key: "orders"}) {
		t.Errorf("binding %+v, want orders under its own name", bd)
	}
	if b.DelayQueues() != nil {
		t.Errorf("DelayQueues %v: the plugin keeps the messages", b.DelayQueues())
	}
}

func TestPluginMissingOnBothBrokerGenerations(t *testing.T) {
	for _, tt := range []struct {
		name string
		err  error
		want bool
	}{
		{"3.x connection error", &amqp.Error{Code: amqp.CommandInvalid, Reason: "COMMAND_INVALID - unknown exchange type 'x-delayed-message'"}, true},
		{"4.x channel error", &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - unknown exchange type 'x-delayed-message'"}, true},
		{"wrapped", fmt.Errorf("declare: %w", &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - unknown exchange type 'x-delayed-message'"}), true},
		{"type clash with an existing exchange", &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'amq.direct' in vhost '/': received 'x-delayed-message' but current is 'direct'"}, false},
		{"another unknown type", &amqp.Error{Code: amqp.CommandInvalid, Reason: "COMMAND_INVALID - unknown exchange type 'x-other'"}, false},
		{"access refused", &amqp.Error{Code: amqp.AccessRefused, Reason: "ACCESS_REFUSED"}, false},
		{"nil", nil, false},
	} {
		if got := pluginMissing(tt.err); got != tt.want {
			t.Errorf("%s: pluginMissing = %v, want %v", tt.name, got, tt.want)
		}
	}
}

// TestStartupErrors: what Prepare says when a backend cannot run on the broker.
func TestStartupErrors(t *testing.T) {
	de := &delayedExchange{names: names.Names{Prefix: "shop"}}
	err := de.errPluginMissing("3.13.7", errors.New("cause"))
	for _, want := range []string{"delayed-exchange: ", `cannot declare exchange "shop.delayed" of type x-delayed-message`,
		"rabbitmq-plugins enable rabbitmq_delayed_message_exchange", "binary-levels backend, which needs no plugin", ": cause"} {
		if !errors.Is(err, ErrPluginMissing) || !strings.Contains(err.Error(), want) {
			t.Errorf("plugin missing on 3.13: %v, does not say %q", err, want)
		}
	}
	err = de.errPluginMissing("4.3.6", nil)
	for _, want := range []string{"RabbitMQ 4.3.6 cannot run the rabbitmq_delayed_message_exchange plugin", "4.3 and later", "Khepri", "binary-levels", "ttl-tiers", "delayed-retry"} {
		if !errors.Is(err, ErrPluginMissing) || !strings.Contains(err.Error(), want) {
			t.Errorf("plugin on 4.3: %v, does not say %q", err, want)
		}
	}
	// (delayed-retry's refusal before 4.3, UnsupportedError, is checked on the broker:
	// TestPrepare.)
}

func TestValidationNamesTheField(t *testing.T) {
	for _, tt := range []struct {
		spec Spec
		want string
	}{
		{Spec{Name: TTLTiers().Name(), Prefix: "a*b", Tiers: backend.DefaultTiers()}, `Prefix: "a*b" must not contain`},
		{Spec{Name: TTLTiers().Name(), Prefix: "a b", Tiers: backend.DefaultTiers()}, "Prefix:"},
		{Spec{Name: TTLTiers().Name(), Prefix: "p", Tiers: []time.Duration{time.Second, 0}}, "Tiers[1]: 0s is outside 1ms to"},
		{Spec{Name: TTLTiers().Name(), Prefix: "p", Tiers: []time.Duration{11 * 365 * 24 * time.Hour}}, "Tiers[0]:"},
		{Spec{Name: TTLTiers().Name(), Prefix: "p", Tiers: []time.Duration{time.Second, 1500 * time.Microsecond}}, "Tiers[1]: 1.5ms is not a whole number of milliseconds"},
		{Spec{Name: TTLTiers().Name(), Prefix: "p", Tiers: []time.Duration{time.Second, 2 * time.Second, time.Second}}, "Tiers[2]: 1s appears twice"},
		{Spec{Name: BinaryLevels(0).Name(), Prefix: "p", Levels: -1}, "Levels: -1 is outside 1 to 29"},
		{Spec{Name: BinaryLevels(0).Name(), Prefix: "p", Levels: 30}, "Levels: 30"},
		{Spec{Name: DelayedRetry(0).Name(), RetryDelay: -time.Second}, "delay.DelayedRetry(delay): -1s must be a whole number of milliseconds, at least 1ms"},
		{Spec{Name: DelayedRetry(0).Name(), RetryDelay: 1500 * time.Microsecond}, "delay.DelayedRetry(delay):"},
		{Spec{Name: string("rabbit")}, `Backend: unknown backend "rabbit" (known: ttl-tiers, binary-levels, delayed-exchange, delayed-retry, delivery-time, memory)`},
		// Names longer than AMQP carries.
		{Spec{Name: TTLTiers().Name(), Prefix: strings.Repeat("p", 247), Tiers: []time.Duration{time.Second}}, "Prefix: makes the name"},
		{Spec{Name: BinaryLevels(0).Name(), Prefix: strings.Repeat("p", 245), Levels: 10}, "over AMQP's 255"},
		{Spec{Name: DelayedExchange().Name(), Prefix: strings.Repeat("p", 248)}, "Prefix: makes the name"},
	} {
		_, err := Lookup(tt.spec)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Lookup(%s, prefix %.10q): %v, want %q", tt.spec.Name, tt.spec.Prefix, err, tt.want)
		}
	}
	// At the limits: accepted.
	for _, s := range []Spec{
		{Name: TTLTiers().Name(), Prefix: strings.Repeat("p", names.MaxBytes-len(".delay.1s")), Tiers: []time.Duration{time.Second}},
		{Name: BinaryLevels(0).Name(), Prefix: "p", Levels: 29},
		{Name: BinaryLevels(0).Name(), Prefix: "p", Levels: 1},
		{Name: DelayedRetry(0).Name(), RetryDelay: time.Millisecond},
		{Name: TTLTiers().Name(), Prefix: "p", Tiers: []time.Duration{time.Millisecond, 315_360_000_000 * time.Millisecond}},
	} {
		if _, err := Lookup(s); err != nil {
			t.Errorf("Lookup(%s): %v", s.Name, err)
		}
	}
	// The parse table: the default first, each name once (a backend added there needs
	// no edit here).
	if got := knownNames(); len(got) == 0 || got[0] != (TTLTiers()).Name() {
		t.Errorf("knownNames() = %v, want the default, %s, first", got, TTLTiers())
	}
	for i, name := range knownNames() {
		if slices.Index(knownNames(), name) != i {
			t.Errorf("knownNames() = %v: %s twice", knownNames(), name)
		}
	}
	for _, v := range backends {
		for i, b := range v.(backend.Opener).Backends() {
			if b.Name() != knownNames()[i] {
				t.Errorf("%s's Backends()[%d] is %s, knownNames()[%d] %s", v, i, b.Name(), i, knownNames()[i])
			}
		}
	}
}

// TestParse: a name gives its value with default settings, "" the default backend; an
// unknown name is refused, naming the known ones.
func TestParse(t *testing.T) {
	for _, name := range knownNames() {
		b, err := Parse(name)
		if err != nil || b.Name() != name {
			t.Errorf("Parse(%q) = %v, %v", name, b, err)
		}
	}
	if b, err := Parse(""); err != nil || b.Name() != "ttl-tiers" {
		t.Errorf(`Parse("") = %v, %v, want ttl-tiers`, b, err)
	}
	_, err := Parse("ttl-tier")
	if want := `Backend: unknown backend "ttl-tier" (known: ttl-tiers, binary-levels, delayed-exchange, delayed-retry, delivery-time, memory)`; err == nil || err.Error() != want {
		t.Errorf(`Parse("ttl-tier") = %v, want %q`, err, want)
	}
	// A value's own setting is named as its own.
	if _, err := backend.Open(DelayedRetry(1500*time.Microsecond), backend.Setup{}); err == nil || !strings.HasPrefix(err.Error(), "delay.DelayedRetry(delay): 1.5ms must be a whole number of milliseconds") {
		t.Errorf("DelayedRetry(1.5ms): %v, want the error naming delay.DelayedRetry's delay", err)
	}
	// Held retries in front of the backend named, Delay apart.
	if b, err := Parse("binary-levels", Settings{Levels: 4, Delay: 2 * time.Second, HeldRetries: 3}); err != nil || b != HeldRetries(3, 2*time.Second, BinaryLevels(4)) {
		t.Errorf(`Parse("binary-levels", Settings{Levels: 4, Delay: 2s, HeldRetries: 3}) = %v, %v`, b, err)
	}
	if b, err := Parse("delayed-retry", Settings{Delay: 3 * time.Second, Levels: 4}); err != nil || b != (DelayedRetry(3*time.Second)) {
		t.Errorf(`Parse("delayed-retry", Settings{Delay: 3s, Levels: 4}) = %v, %v, want DelayedRetry(3s)`, b, err)
	}
}

func TestPlanWithoutBroker(t *testing.T) {
	b := lookup(t, Spec{Name: TTLTiers().Name(), Prefix: "p", Tiers: []time.Duration{5 * time.Second, time.Second}})
	p := backend.Plan(b, "a", "b", "a")
	if len(p.Exchanges) != 3 || len(p.Queues) != 3 || len(p.Bindings) != 5 {
		t.Errorf("ttl-tiers plan: %d exchanges, %d queues, %d bindings; want 3, 3, 5 (no duplicates)", len(p.Exchanges), len(p.Queues), len(p.Bindings))
	}
	if got := lookup(t, Spec{Name: BinaryLevels(0).Name(), Prefix: "p", Levels: 3}).DelayQueues(); len(got) != 3 || got[2] != (backend.DelayQueue{Name: "p.level.2", TTL: 4 * time.Second}) {
		t.Errorf("binary-levels delay queues: %v", got)
	}
	for _, name := range []Backend{Memory(nil), DelayedRetry(0)} {
		if p := backend.Plan(lookup(t, Spec{Name: name.Name(), RetryDelay: time.Second}), "a"); p.Queues != nil || p.Exchanges != nil || p.Bindings != nil {
			t.Errorf("%s plans %+v, want nothing on the broker", name, p)
		}
	}
	if p := backend.Plan(lookup(t, Spec{Name: DelayedExchange().Name(), Prefix: "p"}), "a", "b"); len(p.Exchanges) != 1 || len(p.Bindings) != 2 {
		t.Errorf("delayed-exchange plan %+v", p)
	}
}

func TestDelayedRetry(t *testing.T) {
	b := lookup(t, Spec{Name: DelayedRetry(0).Name(), RetryDelay: 2 * time.Second})
	if _, ok := b.(backend.Holder); !ok {
		t.Fatal("delayed-retry does not hold retries")
	}
	if err := b.Park(context.Background(), "q", message.NewMessage("m", nil), time.Second); err == nil {
		t.Error("delayed-retry parked a copy")
	}
	msg := message.NewMessage("m", nil)
	if err := b.(backend.Holder).Settle(msg, 2*time.Second, nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-msg.Nacked():
		t.Error("Settle nacked the delivery: the middleware settles it, once")
	case <-msg.Acked():
		t.Error("Settle acked the delivery")
	default:
	}
	want := amqp.Table{"x-queue-type": "quorum", "x-delayed-retry-type": "returned", "x-delayed-retry-min": int64(2000), "x-delayed-retry-max": int64(2000)}
	if got := backend.WorkQueueArgs(2 * time.Second); !maps.Equal(got, want) {
		t.Errorf("WorkQueueArgs = %v, want %v", got, want)
	}
}

func TestMemory(t *testing.T) {
	if err := lookup(t, Spec{Name: Memory(nil).Name()}).Park(context.Background(), "q", message.NewMessage("m", nil), 0); !errors.Is(err, errDetached) {
		t.Errorf("memory backend without a publisher: %v", err)
	}
	rec := brokertest.NewRecorder(2)
	b, err := New(Spec{Name: Memory(nil).Name(), Memory: rec}, backend.Env{})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("m", []byte("p"))
	if err := b.Park(context.Background(), "work", msg, time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := b.Park(context.Background(), "work", message.NewMessage("later", nil), time.Hour); err != nil {
		t.Fatal(err)
	}
	if p := rec.Next(t); p.Topic != "work" || p.Msg.UUID != "m" || string(p.Msg.Payload) != "p" {
		t.Errorf("delivered %q: %+v", p.Topic, p.Msg)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Park(context.Background(), "work", msg, 0); !errors.Is(err, errMemoryClosed) {
		t.Errorf("Park after Close: %v", err)
	}
}

// fake is a Backend that applies delays as effective says and records what it parks.
type fake struct {
	effective func(time.Duration) (time.Duration, error)
	parkErr   error
	asked     []time.Duration
	parked    []brokertest.Published
}

func (f *fake) Name() string       { return "fake" }
func (f *fake) Caps() backend.Caps { return backend.Caps{} }
func (f *fake) Effective(d time.Duration) (time.Duration, error) {
	f.asked = append(f.asked, d)
	if f.effective != nil {
		return f.effective(d)
	}
	return d, nil
}
func (f *fake) Topology() topology.Topology        { return topology.Topology{} }
func (f *fake) WorkQueue(string) topology.Topology { return topology.Topology{} }
func (f *fake) DelayQueues() []backend.DelayQueue  { return nil }
func (f *fake) Close() error                       { return nil }
func (f *fake) Park(_ context.Context, queue string, msg *message.Message, effective time.Duration) error {
	if f.parkErr != nil {
		return f.parkErr
	}
	f.parked = append(f.parked, brokertest.Published{Topic: queue, Msg: msg})
	return nil
}

func TestSchedulerStripsWatermillDelayKeys(t *testing.T) {
	f := &fake{}
	s := backend.Scheduler{Backend: f}
	for _, tt := range []struct {
		name string
		set  func(*message.Message)
		want time.Duration
	}{
		{"delayed for", func(m *message.Message) { wdelay.Message(m, wdelay.For(1500*time.Millisecond)) }, 1500 * time.Millisecond},
		{"negative", func(m *message.Message) { m.Metadata.Set(wdelay.DelayedForKey, "-5s") }, 0},
		{"until, past", func(m *message.Message) { wdelay.Message(m, wdelay.Until(time.Now().Add(-time.Hour))) }, 0},
		{"none", func(*message.Message) {}, 0},
	} {
		f.asked, f.parked = nil, nil
		msg := message.NewMessage("m", []byte("body"))
		msg.Metadata.Set("user", "kept")
		tt.set(msg)
		before := maps.Clone(msg.Metadata)
		if err := s.Publish("orders", msg); err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
		if len(f.asked) != 1 || f.asked[0] != tt.want {
			t.Errorf("%s: asked the backend for %v, want %s", tt.name, f.asked, tt.want)
		}
		if len(f.parked) != 1 || f.parked[0].Topic != "orders" {
			t.Fatalf("%s: parked %+v", tt.name, f.parked)
		}
		cp := f.parked[0].Msg
		for _, k := range []string{wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
			if v, ok := cp.Metadata[k]; ok {
				t.Errorf("%s: parked copy keeps %s = %q; it would be delayed again", tt.name, k, v)
			}
		}
		if cp.UUID != "m" || string(cp.Payload) != "body" || cp.Metadata.Get("user") != "kept" || cp == msg {
			t.Errorf("%s: parked %+v", tt.name, cp)
		}
		if !maps.Equal(msg.Metadata, before) {
			t.Errorf("%s: the message given was modified", tt.name)
		}
	}
	// Until in the future: the time left.
	f.asked = nil
	msg := message.NewMessage("m", nil)
	wdelay.Message(msg, wdelay.Until(time.Now().Add(time.Hour)))
	if err := s.Publish("orders", msg); err != nil || f.asked[0] <= 58*time.Minute || f.asked[0] > time.Hour {
		t.Errorf("until in an hour: asked %v, %v", f.asked, err)
	}
}

func TestSchedulerRefuses(t *testing.T) {
	bad := message.NewMessage("bad", nil)
	bad.Metadata.Set(wdelay.DelayedForKey, "soon")
	if err := (backend.Scheduler{Backend: &fake{}}).Publish("q", bad); err == nil || !strings.Contains(err.Error(), wdelay.DelayedForKey) || !strings.Contains(err.Error(), "bad") {
		t.Errorf("unreadable delay: %v", err)
	}
	badUntil := message.NewMessage("bad", nil)
	badUntil.Metadata.Set(wdelay.DelayedUntilKey, "tomorrow")
	if err := (backend.Scheduler{Backend: &fake{}}).Publish("q", badUntil); err == nil || !strings.Contains(err.Error(), wdelay.DelayedUntilKey) {
		t.Errorf("unreadable time: %v", err)
	}
	if err := (backend.Scheduler{Backend: &fake{}}).Publish("", message.NewMessage("m", nil)); err == nil || !strings.Contains(err.Error(), "empty destination queue") {
		t.Errorf("empty queue: %v", err)
	}
	if err := (backend.Scheduler{Backend: lookup(t, Spec{Name: DelayedRetry(0).Name(), RetryDelay: time.Second})}).Publish("q", message.NewMessage("m", nil)); err == nil || !strings.Contains(err.Error(), "holds failed deliveries") {
		t.Errorf("holding backend: %v", err)
	}
	f := &fake{parkErr: backend.ErrReturned}
	if err := (backend.Scheduler{Backend: f}).Publish("q", message.NewMessage("m", nil)); !errors.Is(err, backend.ErrReturned) || !strings.Contains(err.Error(), `park message m for queue "q" (fake backend)`) {
		t.Errorf("park failure: %v", err)
	}

	// A delay the backend refuses, refused before anything is published.
	b := levels(4)
	b.env.Handoff = &nopHandoff{} // publishing would fail: never reached
	msg := message.NewMessage("m", nil)
	wdelay.Message(msg, wdelay.For(15500*time.Millisecond))
	before := maps.Clone(msg.Metadata)
	err := backend.Scheduler{Backend: b}.Publish("orders", msg)
	if !errors.Is(err, ErrDelayTooLong) || !strings.Contains(err.Error(), `"orders"`) || !strings.Contains(err.Error(), "maximum 15s") {
		t.Fatalf("err %v, want ErrDelayTooLong naming the queue and the maximum", err)
	}
	if !maps.Equal(msg.Metadata, before) {
		t.Errorf("a refused message was modified: %v -> %v", before, msg.Metadata)
	}
}

// TestBackendsBuiltForPlanningDoNotPark: Lookup's backends plan and size only.
func TestBackendsBuiltForPlanningDoNotPark(t *testing.T) {
	for _, s := range []Spec{
		{Name: TTLTiers().Name(), Prefix: "p", Tiers: backend.DefaultTiers()},
		{Name: BinaryLevels(0).Name(), Prefix: "p", Levels: 4},
		{Name: DelayedExchange().Name(), Prefix: "p"},
		{Name: Memory(nil).Name()},
	} {
		if err := lookup(t, s).Park(context.Background(), "q", message.NewMessage("m", nil), time.Second); !errors.Is(err, errDetached) {
			t.Errorf("%s: Park = %v, want errDetached", s.Name, err)
		}
	}
}

// TestVersionRules: how the start-up checks read the broker's version (internal/version,
// which Prepare and the Retry's start-up decide on).
func TestVersionRules(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want version.V
		ok   bool
	}{
		{"3.10.8", version.V{Major: 3, Minor: 10, Patch: 8}, true},
		{"3.13.7", version.V{Major: 3, Minor: 13, Patch: 7}, true},
		{"4.0.0-rc.1", version.V{Major: 4}, true},
		{"4.0.0+2", version.V{Major: 4}, true},
		{"4.1", version.V{Major: 4, Minor: 1}, true},
		{"4.3.6+2", version.V{Major: 4, Minor: 3, Patch: 6}, true},
		{"10.20.30", version.V{Major: 10, Minor: 20, Patch: 30}, true},
		{"", version.V{}, false},
		{"4", version.V{}, false},
		{"unknown", version.V{}, false},
		{"v4.0.1", version.V{}, false},
	} {
		got, ok := version.Parse(tt.in)
		if got != tt.want || ok != tt.ok {
			t.Errorf("Parse(%q) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
	for _, tt := range []struct {
		version string
		warn    bool
	}{
		{"3.10.8", false}, {"3.12.14", false}, {"3.13.0", true}, {"3.13.0-rc.1", true}, {"3.13.1", true},
		{"3.13.2", true}, {"3.13.3", false}, {"4.0.5", false}, {"", false}, {"garbage", false},
	} {
		w := version.Warning(tt.version)
		if (w != "") != tt.warn {
			t.Errorf("Warning(%q) = %q, want a warning: %v", tt.version, w, tt.warn)
		}
		if w != "" && !strings.Contains(w, tt.version) {
			t.Errorf("warning %q does not name the version", w)
		}
	}
	for v, want := range map[string][4]bool{ // DelayedRetry(0), NoPlugins, CountsNacks, DefaultDeliveryLimit
		"3.10.8": {false, false, false, false},
		"3.13.7": {false, false, false, false},
		"4.0.5":  {false, false, true, true},
		"4.2.1":  {false, false, true, true},
		"4.3.0":  {true, true, false, true},
		"4.3.6":  {true, true, false, true},
		"5.0.0":  {true, true, false, true},
		"":       {false, false, true, true},
	} {
		got := [4]bool{version.DelayedRetry(v), version.NoPlugins(v), version.CountsNacks(v), version.DefaultDeliveryLimit(v)}
		if got != want {
			t.Errorf("version %q: DelayedRetry(0), NoPlugins, CountsNacks, DefaultDeliveryLimit = %v, want %v", v, got, want)
		}
	}
}

// TestContractNames: each backend is named as package delay names it.
func TestContractNames(t *testing.T) {
	for _, name := range backends {
		b, err := Lookup(Spec{Name: name.Name(), Prefix: "p", Tiers: backend.DefaultTiers(), Levels: backend.DefaultLevels, RetryDelay: time.Second})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if b.Name() != name.Name() {
			t.Errorf("backend %s is named %q", name, b.Name())
		}
	}
}

// TestDelayedExchangeCountsItsPlugin: the delayed exchange is a backend.Sealed that
// names its plugin as what the broker must run, counts what waits with the plugin's own
// messages_delayed for the exchange and vhost it is given (quoted as Erlang binaries),
// and reads what rabbitmqctl eval printed: a count, or why there is none.
func TestDelayedExchangeCountsItsPlugin(t *testing.T) {
	b, err := Lookup(Spec{Name: DelayedExchange().Name(), Prefix: "p"})
	if err != nil {
		t.Fatal(err)
	}
	sealed, ok := b.(backend.Sealed)
	if !ok {
		t.Fatalf("%T is not a backend.Sealed", b)
	}
	if name, role := sealed.Requirement(); name != "rabbitmq_delayed_message_exchange" || role != "plugin" {
		t.Errorf("Requirement() = %q, %q", name, role)
	}
	if x := sealed.SealedIn(); x.Name != "p.delayed" || x.Kind != "x-delayed-message" {
		t.Errorf("SealedIn() = %+v", x)
	}
	for _, tt := range []struct {
		out     string
		want    int
		wantErr string
	}{
		{out: "Warning: x\namqpretry-result 7\nok\n", want: 7},
		{out: "amqpretry-error plugin_not_running\n", wantErr: "the rabbitmq_delayed_message_exchange plugin does not run on this node"},
		{out: "amqpretry-error plugin_has_no_count\n", wantErr: "has no messages_delayed"},
		{out: "amqpretry-error exchange_not_found\n", wantErr: "the exchange does not exist"},
		{out: "{badrpc,nodedown}\n", wantErr: `rabbitmqctl eval printed "{badrpc,nodedown}"`},
	} {
		var expr string
		eval := func(_ context.Context, e string) ([]byte, error) { expr = e; return []byte(tt.out), nil }
		n, err := sealed.CountSealed(context.Background(), eval, "/", "p.delayed")
		if tt.wantErr == "" && (err != nil || n != tt.want) || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr) || n != 0) {
			t.Errorf("output %q: %d, %v; want %d, %q", tt.out, n, err, tt.want, tt.wantErr)
		}
		for _, want := range []string{"rabbit_delayed_message:messages_delayed(X)", "rabbit_misc:r(<<47>>, exchange, <<112,46,100,101,108,97,121,101,100>>)"} {
			if !strings.Contains(expr, want) {
				t.Errorf("expression %q lacks %q", expr, want)
			}
		}
	}
	boom := errors.New("rabbitmqctl eval (needs admin rights): boom")
	if _, err := sealed.CountSealed(context.Background(), func(context.Context, string) ([]byte, error) { return nil, boom }, "/", "p.delayed"); !errors.Is(err, boom) {
		t.Errorf("a failed eval: %v, want it passed on", err)
	}
}
