package ops

import (
	"context"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
)

func TestFilterMatch(t *testing.T) {
	now := time.Now()
	m := Message{UUID: "u1", MessageID: "id1", Time: now.Add(-time.Hour)}
	m.Queue, m.Reason, m.Error = "orders", amqpretry.ReasonPermanent, "missing customer id"
	for _, tt := range []struct {
		f    Filter
		want bool
	}{
		{Filter{}, true},
		{Filter{Queue: "orders", Reason: amqpretry.ReasonPermanent, Error: "customer"}, true},
		{Filter{Queue: "billing"}, false},
		{Filter{Reason: amqpretry.ReasonMaxAttempts}, false},
		{Filter{Error: "warehouse"}, false},
		{Filter{OlderThan: 30 * time.Minute}, true},
		{Filter{OlderThan: 2 * time.Hour}, false},
		{Filter{NewerThan: 2 * time.Hour}, true},
		{Filter{NewerThan: 30 * time.Minute}, false},
		{Filter{IDs: []string{"x", "id1"}}, true},
		{Filter{IDs: []string{"x"}}, false},
	} {
		if got := tt.f.match(m, now); got != tt.want {
			t.Errorf("%+v: match = %v, want %v", tt.f, got, tt.want)
		}
	}
	if (Filter{OlderThan: time.Minute}).match(Message{}, now) {
		t.Error("a message without a time matched an age filter")
	}
}

func TestPacer(t *testing.T) {
	p := newPacer(100)
	start := time.Now()
	for range 11 {
		if err := p.wait(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if d := time.Since(start); d < 90*time.Millisecond || d > 500*time.Millisecond {
		t.Errorf("11 actions at 100/s took %s, want about 100ms", d)
	}
}

// TestParkedQueueFromRoutingKey: a parked retry without an envelope goes back to the
// queue its routing key names: the whole key (ttl-tiers), or what follows exactly
// Levels words (binary-levels), whatever the queue's name looks like. Nothing parses
// the key back: the level count says where the name starts.
func TestParkedQueueFromRoutingKey(t *testing.T) {
	for _, tt := range []struct {
		backend delay.Backend
		levels  int
		key     string
		want    string
	}{
		{delay.TTLTiers(), 0, "shop.orders", "shop.orders"},
		{delay.BinaryLevels(3), 3, "0.1.1.shop.orders", "shop.orders"},
		{delay.BinaryLevels(3), 3, "1.0.0.1.0.queue", "1.0.queue"}, // a queue named like levels
		{delay.BinaryLevels(3), 3, "0.1.", ""},                     // too short: unknown
	} {
		b, err := backend.Open(tt.backend, backend.Setup{Prefix: "x"})
		if err != nil {
			t.Fatal(err)
		}
		o := &Ops{backend: b}
		m, err := o.message(amqp.Delivery{Exchange: "x.deliver", RoutingKey: tt.key}, false)
		if err != nil {
			t.Fatal(err)
		}
		if m.Queue != tt.want {
			t.Errorf("%s, %d levels, key %q: queue %q, want %q", tt.backend, tt.levels, tt.key, m.Queue, tt.want)
		}
	}
	// The envelope's queue wins.
	b, err := backend.Open(delay.BinaryLevels(3), backend.Setup{Prefix: "x"})
	if err != nil {
		t.Fatal(err)
	}
	m, err := (&Ops{backend: b}).message(amqp.Delivery{Exchange: "x", RoutingKey: "0.1.1.a", Headers: amqp.Table{"amqpretry-queue": "b"}}, false)
	if err != nil || m.Queue != "b" {
		t.Errorf("envelope queue: %q, %v", m.Queue, err)
	}
}

// TestTopologyConfig: only the broker side is validated; the policy is not ops'
// business (binary-levels with 5 levels reaches 31 s, less than the default policy's
// 10 min), but a broken broker side is refused, naming the field.
func TestTopologyConfig(t *testing.T) {
	if _, err := topologyConfig(amqpretry.Config{Backend: delay.BinaryLevels(5)}); err != nil {
		t.Errorf("binary-levels with 5 levels: %v", err)
	}
	if _, err := topologyConfig(amqpretry.Config{Backend: delay.DelayedRetry(0)}); err != nil {
		t.Errorf("delayed-retry: %v", err)
	}
	for cfg, want := range map[*amqpretry.Config]string{
		{Backend: delay.Memory(nil)}:                           "memory backend has nothing on the broker",
		{Backend: delay.BinaryLevels(40)}:                      "Levels: 40",
		{Backend: delay.HeldRetries(1, time.Microsecond, nil)}: "delay.HeldRetries(delay)",
	} {
		_, err := topologyConfig(*cfg)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%+v: %v, want an error naming %q", *cfg, err, want)
		}
	}
}

// TestHasParking: the backends with a delivery exchange have the parking queue, the
// others none, whatever the prefix; a Config naming no valid backend has none.
func TestHasParking(t *testing.T) {
	want := map[string]bool{"ttl-tiers": true, "binary-levels": true}
	for _, b := range backend.All(delay.TTLTiers()) {
		for _, prefix := range []string{"", "orders"} {
			if got := HasParking(amqpretry.Config{Backend: b.(delay.Backend), Prefix: prefix}); got != want[b.Name()] {
				t.Errorf("%s, prefix %q: HasParking = %v, want %v", b, prefix, got, want[b.Name()])
			}
		}
	}
	if !HasParking(amqpretry.Config{}) {
		t.Error("the default backend: HasParking = false, want true")
	}
	if HasParking(amqpretry.Config{Backend: delay.BinaryLevels(40)}) {
		t.Error("an invalid backend: HasParking = true")
	}
}

// TestNewValidatesBeforeDialling: an invalid config never dials (the URI names no
// broker that could answer).
func TestNewValidatesBeforeDialling(t *testing.T) {
	_, err := New(Config{URI: "amqp://u:p@192.0.2.1:1/", Retry: amqpretry.Config{Backend: delay.BinaryLevels(40)}})
	if err == nil || !strings.HasPrefix(err.Error(), "invalid config:") {
		t.Errorf("New: %v", err)
	}
	if _, err := New(Config{}); err == nil || !strings.Contains(err.Error(), "URI: required") {
		t.Errorf("New without URI: %v", err)
	}
}

// TestPluginCountFailsLoudly: where the delayed-message plugin does not run (it is not
// installed here; RabbitMQ 4.3 cannot run it), its count is an error that says so,
// never a number; without rabbitmqctl, an error that says what is needed.
func TestPluginCountFailsLoudly(t *testing.T) {
	o := &Ops{retry: amqpretry.Config{Backend: delay.DelayedExchange(), Prefix: "amqpretry-test-plugin"}.WithDefaults(), vhost: "/"}
	o.names.Prefix = o.retry.Prefix
	b, err := backend.Open(o.retry.Backend, backend.Setup{Prefix: o.retry.Prefix})
	if err != nil {
		t.Fatal(err)
	}
	o.backend = b
	if _, err := o.sealedWaiting(context.Background()); !errors.Is(err, errSealedCount) || !strings.Contains(err.Error(), "needs rabbitmqctl eval") {
		t.Errorf("without rabbitmqctl: %v", err)
	}
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Skip("needs rabbitmqctl")
	}
	o.ctl = func(ctx context.Context, args ...string) ([]byte, error) {
		return exec.CommandContext(ctx, "rabbitmqctl", args...).CombinedOutput()
	}
	if out, err := o.ctl(context.Background(), "-q", "eval", "code:which(rabbit_delayed_message)."); err != nil || !strings.Contains(string(out), "non_existing") {
		t.Skipf("the delayed-message plugin is installed here (%s): this test needs a broker without it", out)
	}
	n, err := o.sealedWaiting(context.Background())
	if !errors.Is(err, errSealedCount) || !strings.Contains(err.Error(), "does not run on this node") || n != 0 {
		t.Errorf("plugin count without the plugin: %d, %v", n, err)
	}
}

// TestTeardownAdviceOnDelayedExchange (issue 33): teardown's refusal advised `waiting
// retry-now`, which cannot act on the plugin; on delayed-exchange it says to wait for
// the plugin's count to reach 0, watched with status (whichever backend is torn down:
// the plugin's exchange is found under the prefix by any teardown).
func TestTeardownAdviceOnDelayedExchange(t *testing.T) {
	if got := waitAdvice(waitKinds{inPlugin: "delayed-exchange"}); strings.Contains(got, "retry-now") || !strings.Contains(got, "plugin's count reaches 0") || !strings.Contains(got, "`amqpretry status --backend delayed-exchange`") {
		t.Errorf("delayed-exchange: %q", got)
	}
	if got := waitAdvice(waitKinds{delay: true}); !strings.Contains(got, "amqpretry waiting retry-now") {
		t.Errorf("ttl-tiers: %q", got)
	}
}

// TestTeardownAdviceByKind (issue 51): a teardown --shared refused for the messages in
// the poison queue advised waiting for them to come due and retry-now, the fixes of a
// delay queue. Each kind of queue gets its own fix, and only the kinds where messages
// wait.
func TestTeardownAdviceByKind(t *testing.T) {
	for _, c := range []struct {
		kinds     waitKinds
		want, not []string
	}{
		{waitKinds{poison: "p.poison"}, []string{"the messages in the poison queue p.poison: redrive them to their work queues (amqpretry poison redrive), or drop them (amqpretry poison purge)"},
			[]string{"retry-now", "come due", "parking"}},
		{waitKinds{parking: "p.parking"}, []string{"the retries in the parking queue p.parking:", "(amqpretry parking redrive)", "(amqpretry parking purge)"},
			[]string{"retry-now", "come due", "poison"}},
		{waitKinds{delay: true, poison: "p.poison"}, []string{"for the retries in the delay queues: wait until they have come due (amqpretry status), or bring them back now (amqpretry waiting retry-now); for the messages in the poison queue p.poison: redrive"},
			[]string{"parking", "plugin"}},
	} {
		got := waitAdvice(c.kinds)
		for _, w := range c.want {
			if !strings.Contains(got, w) {
				t.Errorf("%+v: %q lacks %q", c.kinds, got, w)
			}
		}
		for _, n := range c.not {
			if strings.Contains(got, n) {
				t.Errorf("%+v: %q says %q", c.kinds, got, n)
			}
		}
	}
}

// TestReadEval: what an eval expression prints, as rabbitmqctl passes it on: warnings
// around it, JSON documents, the first result and the first error.
func TestReadEval(t *testing.T) {
	r := readEval([]byte("Warning: something\n{\"pos\":0}\namqpretry-result {ok,2}\n  {\"pos\":1}  \namqpretry-error q: not_found\namqpretry-error later\nok\n"))
	if !r.hasResult || r.result != "{ok,2}" || !r.hasFailed || r.failed != "q: not_found" || len(r.json) != 2 || r.json[1] != `{"pos":1}` {
		t.Errorf("readEval: %+v", r)
	}
	if r := readEval([]byte("ok\n")); r.hasResult || r.hasFailed || len(r.json) != 0 {
		t.Errorf("readEval of nothing: %+v", r)
	}
}
