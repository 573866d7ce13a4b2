package delay

import (
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
)

func levels(n int) *binaryLevels { return &binaryLevels{names: names{"p"}, levels: n} }

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
		if got := levels(tt.levels).routingKey(tt.delay, tt.queue); got != tt.want {
			t.Errorf("levels %d, %s to %s: key %q, want %q", tt.levels, tt.delay, tt.queue, got, tt.want)
		}
	}
}

func TestBinaryLevelsEffective(t *testing.T) {
	for _, tt := range []struct {
		levels    int
		requested time.Duration
		want      time.Duration // 0 with tooLong
		tooLong   bool
	}{
		{4, 0, 0, false},
		{4, -time.Second, 0, false},
		{4, time.Nanosecond, time.Second, false},
		{4, time.Second, time.Second, false},
		{4, 1500 * time.Millisecond, 2 * time.Second, false},
		{4, 14*time.Second + time.Nanosecond, 15 * time.Second, false},
		{4, 15 * time.Second, 15 * time.Second, false},
		{4, 15*time.Second + time.Nanosecond, 0, true},
		{4, 16 * time.Second, 0, true},
		{1, time.Second, time.Second, false},
		{1, 2 * time.Second, 0, true},
		{28, (1<<28 - 1) * time.Second, (1<<28 - 1) * time.Second, false},
		{28, (1 << 28) * time.Second, 0, true},
		{29, (1<<29 - 1) * time.Second, (1<<29 - 1) * time.Second, false},
	} {
		got, err := levels(tt.levels).Effective(tt.requested)
		switch {
		case tt.tooLong && !errors.Is(err, ErrDelayTooLong):
			t.Errorf("levels %d, %s: err %v, want ErrDelayTooLong", tt.levels, tt.requested, err)
		case tt.tooLong && !strings.Contains(err.Error(), tt.requested.String()):
			t.Errorf("levels %d, %s: error %q does not name the delay", tt.levels, tt.requested, err)
		case !tt.tooLong && (err != nil || got != tt.want):
			t.Errorf("levels %d, %s: %s, %v; want %s", tt.levels, tt.requested, got, err, tt.want)
		}
	}
	_, err := levels(4).Effective(16 * time.Second)
	if want := "binary-levels: delay too long: 16s is longer than the maximum 15s (2^4 - 1 s)"; err == nil || err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
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
	if len(got) != len(want) {
		t.Fatalf("bindings %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("binding %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	for l, q := range topo.Queues[1:] { // [0] is parking
		if ttl, dlx := q.Args[topology.MessageTTLArg], q.Args[topology.DeadLetterExchangeArg]; ttl != int64(1000<<l) || q.Name != levels(4).names.level(l) {
			t.Errorf("queue %d: %s ttl %v dlx %v", l, q.Name, ttl, dlx)
		}
		if q.Args[topology.DeadLetterStrategyArg] != topology.DeadLetterAtLeastOnce || q.Args[topology.QueueTypeArg] != topology.QueueTypeQuorum {
			t.Errorf("queue %s: args %v, want an at-least-once quorum queue", q.Name, q.Args)
		}
	}
	for _, e := range topo.Exchanges {
		if e.Name == "p.levels.deliver" && (e.Kind != amqp.ExchangeTopic || e.Args[topology.AlternateExchangeArg] != "p.parking") {
			t.Errorf("delivery exchange %+v, want topic with alternate-exchange p.parking", e)
		}
		if e.Name == "p.deliver" {
			t.Error("binary-levels declares p.deliver, ttl-tiers' direct exchange: a shared prefix would fail with 406")
		}
	}
}

func TestBinaryLevelsWorkQueue(t *testing.T) {
	b := levels(4)
	tooLong := strings.Repeat("q", maxRoutingKey-2*4+1)
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
		if want := []string{tt.key}; tt.key == "" && len(keys) != 0 || tt.key != "" && (len(keys) != 1 || keys[0] != want[0]) {
			t.Errorf("WorkQueue(%.20q): delivery bindings %q, want %q", tt.queue, keys, tt.key)
		}
		if tt.key != "" {
			continue
		}
		// No Handoff: Publish must refuse the name before publishing.
		if err := b.Publish(tt.queue, message.NewMessage("m", nil)); err == nil || !strings.Contains(err.Error(), "queue") {
			t.Errorf("Publish(%.20q): %v, want an error about the queue", tt.queue, err)
		}
	}
}

func TestBinaryLevelsPublishRefusesTooLongBeforePublishing(t *testing.T) {
	msg := message.NewMessage("m", nil)
	wdelay.Message(msg, wdelay.For(15500*time.Millisecond))
	before := maps.Clone(msg.Metadata)
	err := levels(4).Publish("orders", msg) // no Handoff: publishing would panic
	if !errors.Is(err, ErrDelayTooLong) || !strings.Contains(err.Error(), `"orders"`) {
		t.Fatalf("err %v, want ErrDelayTooLong naming the queue", err)
	}
	if !maps.Equal(msg.Metadata, before) {
		t.Errorf("a refused message was modified: %v -> %v", before, msg.Metadata)
	}
}

// TestBinaryLevelsRouteEveryDelay follows each delay through the declared topology as
// RabbitMQ would: topic matching, exchange-to-exchange bindings, queue TTL, dead
// lettering and the alternate exchange.
func TestBinaryLevelsRouteEveryDelay(t *testing.T) {
	b := levels(4)
	queues := []string{"orders", "x.orders", "a.b.c"}
	topo := b.Topology()
	for _, q := range queues {
		topo = topo.Merge(b.WorkQueue(q))
	}
	for secs := range 16 {
		for _, q := range queues {
			d := time.Duration(secs) * time.Second
			end, waited, hops := travel(t, topo, b.names.level(3), b.routingKey(d, q))
			if end != q || waited != d {
				t.Errorf("%s to %s: ended in %s after %s, want %s after %s", d, q, end, waited, q, d)
			}
			if want := strings.Count(b.routingKey(d, q)[:8], "1"); hops != want {
				t.Errorf("%s to %s: waited in %d levels, want %d (one per set bit)", d, q, hops, want)
			}
		}
	}
	if end, waited, _ := travel(t, topo, b.names.level(3), b.routingKey(5*time.Second, "gone")); end != "p.parking" || waited != 5*time.Second {
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
		ttl, ok := q.Args[topology.MessageTTLArg].(int64)
		if !ok {
			return dests[0], waited, hops
		}
		waited += time.Duration(ttl) * time.Millisecond
		exchange = q.Args[topology.DeadLetterExchangeArg].(string)
	}
}

// route returns the queues exchange routes key to (the broker merges duplicate
// bindings: so does route).
func route(topo topology.Topology, exchange, key string) []string {
	var kind, alternate string
	for _, e := range topo.Exchanges {
		if e.Name == exchange {
			kind = e.Kind
			alternate, _ = e.Args[topology.AlternateExchangeArg].(string)
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
