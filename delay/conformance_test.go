package delay_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
)

// backendCase is one backend under the conformance suite: what it claims.
type backendCase struct {
	name string
	// precision is how late past its due time a message may arrive.
	precision time.Duration
	// durable: messages waiting in delay survive a broker restart.
	durable bool
	// skip, if it returns a reason, skips the backend on this broker.
	skip func(t *testing.T, h *delay.Handoff) string
}

// conformanceTiers serve ttl-tiers; other backends ignore them.
var conformanceTiers = []time.Duration{time.Second, 2 * time.Second, 3 * time.Second, 5 * time.Second, 10 * time.Minute}

var backendCases = []backendCase{
	{name: delay.BackendTTLTiers, precision: time.Second, durable: true},
	{name: delay.BackendBinaryLevels, precision: time.Second, durable: true},
	{name: delay.BackendDelayedExchange, precision: 500 * time.Millisecond, durable: true, skip: skipWithoutPlugin},
	{name: delay.BackendMemory, precision: 500 * time.Millisecond, durable: false},
}

// skipWithoutPlugin skips where the delayed-message plugin is not enabled, and fails
// where the probe cannot tell.
func skipWithoutPlugin(t *testing.T, h *delay.Handoff) string {
	t.Helper()
	c, err := delay.Probe(h)
	if err != nil {
		t.Fatal(err)
	}
	if !c.DelayedMessagePlugin {
		return "RabbitMQ " + c.Version + " has no rabbitmq_delayed_message_exchange plugin enabled (rabbitmq-plugins enable rabbitmq_delayed_message_exchange)"
	}
	return ""
}

// rig is one backend wired to a fresh work queue on the real broker.
type rig struct {
	t       *testing.T
	backend delay.Backend
	handoff *delay.Handoff
	queue   string
	prefix  string
}

// newRig builds the backend named bc.name, changing nothing else in the config.
func newRig(t *testing.T, bc backendCase) *rig {
	t.Helper()
	h := dialTestHandoff(t)
	if bc.skip != nil {
		if why := bc.skip(t, h); why != "" {
			t.Skip(why)
		}
	}
	prefix := brokertest.Prefix(t)
	b, err := delay.New(delay.Config{
		Backend: bc.name,
		Prefix:  prefix,
		Tiers:   conformanceTiers,
		Handoff: h,
		Memory:  h.QueuePublisher(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	r := &rig{t: t, backend: b, handoff: h, queue: prefix + ".work", prefix: prefix}
	r.declareWorkQueue(r.queue)
	brokertest.CleanupTopology(t, b.Topology())
	return r
}

func (r *rig) declareWorkQueue(q string) {
	r.t.Helper()
	wq := topology.Topology{Queues: []topology.Queue{{Name: q}}}.Merge(r.backend.WorkQueue(q))
	if err := r.handoff.Declare(wq); err != nil {
		r.t.Fatal(err)
	}
	brokertest.CleanupTopology(r.t, topology.Topology{Queues: []topology.Queue{{Name: q}}})
}

// dialTestHandoff connects a Handoff to the test broker (or skips, see brokertest.Dial)
// and closes it when the test ends.
func dialTestHandoff(t *testing.T) *delay.Handoff {
	t.Helper()
	brokertest.Dial(t)
	h, err := delay.Dial(delay.HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	return h
}

// schedule hands one message for queue with the given delay, through the plain
// message.Publisher interface with Watermill's delay metadata.
func (r *rig) schedule(queue, id string, d time.Duration) *message.Message {
	r.t.Helper()
	msg := message.NewMessage(id, []byte(id))
	msg.Metadata.Set("amqpretry-attempt", "3")
	wdelay.Message(msg, wdelay.For(d))
	effective, err := r.backend.Effective(d)
	if err != nil {
		r.t.Fatal(err)
	}
	msg.Metadata.Set(testDueKey, time.Now().Add(effective).UTC().Format(time.RFC3339Nano))
	if err := r.backend.Publish(queue, msg); err != nil {
		r.t.Fatalf("schedule %s for %s: %v", id, d, err)
	}
	return msg
}

// testDueKey carries, in the tests' own metadata, when a scheduled message is due:
// hand-off time plus the backend's effective delay (backends write no metadata).
const testDueKey = "test-due"

// dueOf returns the due time schedule recorded on msg.
func dueOf(t *testing.T, msg *message.Message) time.Time {
	t.Helper()
	due, err := time.Parse(time.RFC3339Nano, msg.Metadata.Get(testDueKey))
	if err != nil {
		t.Fatalf("message %s: %s: %v", msg.UUID, testDueKey, err)
	}
	return due
}

type arrival struct {
	msg *message.Message
	at  time.Time
}

// collect consumes n messages from queue (on a connection of its own, so it survives a
// broker restart only if started after it) or fails after timeout.
func collect(t *testing.T, queue string, n int, timeout time.Duration) []arrival {
	t.Helper()
	conn := brokertest.Dial(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var out []arrival
	deadline := time.After(timeout)
	for len(out) < n {
		select {
		case d := <-deliveries:
			msg, err := xdeath.Marshaler{}.Unmarshal(d)
			if err != nil {
				t.Fatalf("unmarshal delivery from %s: %v", queue, err)
			}
			_ = d.Ack(false)
			out = append(out, arrival{msg: msg, at: time.Now()})
		case <-deadline:
			t.Fatalf("queue %s: got %d of %d messages within %s", queue, len(out), n, timeout)
		}
	}
	_ = ch.Close()
	return out
}

func forEachBackend(t *testing.T, test func(t *testing.T, bc backendCase)) {
	for _, bc := range backendCases {
		t.Run(bc.name, func(t *testing.T) { test(t, bc) })
	}
}

func checkOnTime(t *testing.T, bc backendCase, a arrival) {
	t.Helper()
	due := dueOf(t, a.msg)
	// Clocks: due is computed before the publish, arrival after the delivery.
	if early := due.Sub(a.at); early > 50*time.Millisecond {
		t.Errorf("message %s arrived %s before it was due", a.msg.UUID, early)
	}
	if late := a.at.Sub(due); late > bc.precision {
		t.Errorf("message %s arrived %s late, %s backend claims %s", a.msg.UUID, late, bc.name, bc.precision)
	}
}

func TestConformanceMixedDelaysComeBackInDueOrder(t *testing.T) {
	forEachBackend(t, func(t *testing.T, bc backendCase) {
		r := newRig(t, bc)
		delays := []time.Duration{3 * time.Second, time.Second, 5 * time.Second, 2 * time.Second, time.Second}
		for i, d := range delays {
			r.schedule(r.queue, fmt.Sprintf("m%d-%s", i, d), d)
		}
		got := collect(t, r.queue, len(delays), 30*time.Second)
		var dues []time.Time
		for _, a := range got {
			checkOnTime(t, bc, a)
			dues = append(dues, dueOf(t, a.msg))
		}
		for i := 1; i < len(dues); i++ {
			if dues[i].Before(dues[i-1].Add(-bc.precision)) {
				t.Errorf("arrival %d (%s) was due %s before arrival %d (%s)", i, got[i].msg.UUID, dues[i-1].Sub(dues[i]), i-1, got[i-1].msg.UUID)
			}
		}
	})
}

func TestConformanceNoHeadOfLineBlocking(t *testing.T) {
	forEachBackend(t, func(t *testing.T, bc backendCase) {
		r := newRig(t, bc)
		const long = 500
		for i := range long {
			r.schedule(r.queue, "long-"+strconv.Itoa(i), 10*time.Minute)
		}
		start := time.Now()
		r.schedule(r.queue, "short", time.Second)
		got := collect(t, r.queue, 1, time.Minute)
		if got[0].msg.UUID != "short" {
			t.Fatalf("first back was %s, want the short one", got[0].msg.UUID)
		}
		t.Logf("1s retry behind %d retries of 10m came back after %s", long, got[0].at.Sub(start).Round(time.Millisecond))
		checkOnTime(t, bc, got[0])
	})
}

func TestConformanceMetadataIntact(t *testing.T) {
	forEachBackend(t, func(t *testing.T, bc backendCase) {
		r := newRig(t, bc)
		sent := r.schedule(r.queue, "meta", 1500*time.Millisecond)
		got := collect(t, r.queue, 1, 30*time.Second)[0].msg
		for k, want := range map[string]string{
			"amqpretry-attempt": "3",
			testDueKey:          sent.Metadata.Get(testDueKey),
		} {
			if got.Metadata.Get(k) != want {
				t.Errorf("%s = %q, want %q", k, got.Metadata.Get(k), want)
			}
		}
		if string(got.Payload) != "meta" || got.UUID != "meta" {
			t.Errorf("payload/uuid = %q/%q", got.Payload, got.UUID)
		}
		for _, k := range []string{wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
			if got.Metadata.Get(k) != "" {
				t.Errorf("Watermill delay key %s came back; it would re-delay the message", k)
			}
		}
	})
}

func TestConformanceOnlyTheFailingQueue(t *testing.T) {
	forEachBackend(t, func(t *testing.T, bc backendCase) {
		r := newRig(t, bc)
		other := r.prefix + ".other"
		r.declareWorkQueue(other)
		r.schedule(r.queue, "mine", time.Second)
		r.schedule(other, "theirs", time.Second)
		for _, q := range []struct{ queue, want string }{{r.queue, "mine"}, {other, "theirs"}} {
			got := collect(t, q.queue, 1, 30*time.Second)
			if got[0].msg.UUID != q.want {
				t.Errorf("queue %s got %s, want %s", q.queue, got[0].msg.UUID, q.want)
			}
		}
		// Each Publish parks one copy: with both collected, a stray one would still be
		// waiting in a delay queue, or be in a work queue already.
		queues := []string{r.queue, other}
		for _, q := range r.backend.Topology().Queues {
			queues = append(queues, q.Name)
		}
		for _, q := range queues {
			if n := brokertest.QueueLength(t, q); n != 0 {
				t.Errorf("queue %s holds %d extra messages", q, n)
			}
		}
	})
}

// TestConformanceSurvivesBrokerRestart restarts the broker under test (stop_app and
// start_app through brokertest.Ctl, so on the RabbitMQ 4.x node of scripts/rabbitmq4.sh
// only that node), so it runs only when AMQPRETRY_BROKER_RESTART=1 (scripts/test.sh sets
// it under CI=true and runs packages one at a time).
func TestConformanceSurvivesBrokerRestart(t *testing.T) {
	brokertest.RequireRestart(t)
	forEachBackend(t, func(t *testing.T, bc backendCase) {
		if !bc.durable {
			t.Skipf("%s does not claim durability", bc.name)
		}
		r := newRig(t, bc)
		for i := range 3 {
			r.schedule(r.queue, "durable-"+strconv.Itoa(i), 5*time.Second) // a tier of conformanceTiers; still waiting when the broker stops
		}
		restartBroker(t)
		got := collect(t, r.queue, 3, time.Minute)
		var ids []string
		for _, a := range got {
			ids = append(ids, a.msg.UUID)
		}
		slices.Sort(ids)
		if want := []string{"durable-0", "durable-1", "durable-2"}; !slices.Equal(ids, want) {
			t.Errorf("after restart got %v, want %v", ids, want)
		}
		// The hand-off reconnects by itself.
		r.schedule(r.queue, "after-restart", time.Second)
		if got := collect(t, r.queue, 1, 30*time.Second); got[0].msg.UUID != "after-restart" {
			t.Errorf("after restart got %s", got[0].msg.UUID)
		}
	})
}

var restartMu sync.Mutex

func restartBroker(t *testing.T) {
	t.Helper()
	restartMu.Lock()
	defer restartMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, step := range [][]string{{"stop_app"}, {"start_app"}, {"await_startup"}} {
		if _, err := brokertest.Ctl(ctx, step...); err != nil {
			t.Fatal(err)
		}
	}
	if err := brokertest.Wait(time.Minute); err != nil {
		t.Fatalf("broker did not come back within a minute: %v", err)
	}
}
