package delay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/topology"
)

// backendCase is one backend under the conformance suite: what it claims.
type backendCase struct {
	name delay.Backend
	// precision is how late past its due time a message may arrive.
	precision time.Duration
}

// conformanceTiers serve ttl-tiers; other backends ignore them.
var conformanceTiers = []time.Duration{time.Second, 2 * time.Second, 3 * time.Second, 5 * time.Second, 10 * time.Minute}

// conformanceLevels keeps delays up to 2^12 - 1 s (68 min), past the suite's longest (10
// min), with 16 fewer quorum queues than the default 28 on a broker the whole test run
// shares.
const conformanceLevels = 12

// tighterPrecision lists the backends that claim to be on time within less than a
// second; every other is allowed a second.
var tighterPrecision = map[string]time.Duration{
	delay.DelayedExchange().Name(): 500 * time.Millisecond,
	delay.Memory(nil).Name():       500 * time.Millisecond,
}

// caseOf is backend b under the conformance suite.
func caseOf(b delay.Backend) backendCase {
	bc := backendCase{name: b, precision: time.Second}
	if p, ok := tighterPrecision[b.Name()]; ok {
		bc.precision = p
	}
	return bc
}

// backendCases are the backends of the parse table (delay.Backends), each with its
// default settings: a backend added there is under the suite with no edit here.
func backendCases() []backendCase {
	var out []backendCase
	for _, b := range backend.All(delay.TTLTiers()) {
		out = append(out, caseOf(b.(delay.Backend)))
	}
	return out
}

// queuePublisher is where the memory backend delivers: the queue named by the topic,
// through the hand-off.
type queuePublisher struct{ h backend.Handoff }

func (p queuePublisher) Publish(queue string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if err := p.h.Publish(context.Background(), "", queue, m, nil, true, nil); err != nil {
			return err
		}
	}
	return nil
}
func (queuePublisher) Close() error { return nil }

// dialHandoff connects a Handoff to the test broker (or skips, see brokertest.Dial) and
// closes it when the test ends.
func dialHandoff(t *testing.T) backend.Handoff {
	t.Helper()
	brokertest.Dial(t)
	h, err := handoff.Dial(backend.HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	return h
}

// pluginMissing says why a test cannot run when err says the delayed-message plugin is
// missing, or returns "".
func pluginMissing(h backend.Handoff, err error) string {
	if errors.Is(err, delay.ErrPluginMissing) && version.NoPlugins(h.Version()) {
		return fmt.Sprintf("needs the rabbitmq_delayed_message_exchange plugin, which RabbitMQ %s at AMQP_URI cannot run (4.3 and later); point AMQP_URI at an older broker that has it: %v", h.Version(), err)
	}
	if errors.Is(err, delay.ErrPluginMissing) {
		return fmt.Sprintf("needs the rabbitmq_delayed_message_exchange plugin, which RabbitMQ %s at AMQP_URI does not run (enable it with `rabbitmq-plugins enable rabbitmq_delayed_message_exchange`, or point AMQP_URI at a broker that has it): %v",
			h.Version(), err)
	}
	return ""
}

// rig is one backend, prepared as the library prepares it, wired to a fresh work queue
// on the real broker.
type rig struct {
	t       *testing.T
	backend backend.Backend
	handoff backend.Handoff
	queue   string
	prefix  string
}

// newRig builds and prepares the backend named bc.name, or skips t, saying why the suite
// does not apply to it.
func newRig(t *testing.T, bc backendCase) *rig {
	t.Helper()
	r, why := prepareRig(t, bc)
	if why != "" {
		t.Skip(why)
	}
	return r
}

// prepareRig is newRig returning why the suite does not apply to the backend (and no
// rig) instead of skipping t.
func prepareRig(t *testing.T, bc backendCase) (*rig, string) {
	t.Helper()
	h := dialHandoff(t)
	prefix := brokertest.Prefix(t)
	b, err := delay.New(delay.Spec{Name: bc.name.Name(), Prefix: prefix, Tiers: conformanceTiers, Levels: conformanceLevels, Memory: queuePublisher{h}},
		backend.Env{Handoff: h})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	brokertest.CleanupTopology(t, b.Topology())
	if b.Caps().Keeps != backend.KeepsCopy {
		return nil, fmt.Sprintf("the %s backend parks no copy (the broker holds the failed delivery itself): the suite, which parks copies, does not apply", bc.name)
	}
	if err := backend.Prepare(b, h, topology.ModeDeclare); err != nil {
		if why := pluginMissing(h, err); why != "" {
			return nil, why
		}
		if errors.Is(err, delay.ErrUnsupported) {
			return nil, fmt.Sprintf("RabbitMQ %s at AMQP_URI cannot run the %s backend: %v", h.Version(), bc.name, err)
		}
		t.Fatal(err)
	}
	r := &rig{t: t, backend: b, handoff: h, queue: prefix + ".work", prefix: prefix}
	r.declareWorkQueue(r.queue)
	return r, ""
}

func (r *rig) declareWorkQueue(q string) {
	r.t.Helper()
	brokertest.Cleanup(r.t, []string{q}, nil)
	wq := declare.Merge(topology.Topology{Queues: []topology.Queue{{Name: q}}}, r.backend.WorkQueue(q))
	if err := r.handoff.Ensure(topology.ModeDeclare, wq); err != nil {
		r.t.Fatal(err)
	}
}

// schedule hands one message for queue with the given delay, through the Scheduler, the
// plain message.Publisher reading Watermill's delay metadata.
func (r *rig) schedule(queue, id string, d time.Duration) *message.Message {
	r.t.Helper()
	msg := message.NewMessage(id, []byte(id))
	msg.Metadata.Set(keys.Attempt, "3")
	wdelay.Message(msg, wdelay.For(d))
	effective, err := r.backend.Effective(d)
	if err != nil {
		r.t.Fatal(err)
	}
	msg.Metadata.Set(testDueKey, time.Now().Add(effective).UTC().Format(time.RFC3339Nano))
	if err := (backend.Scheduler{Backend: r.backend}).Publish(queue, msg); err != nil {
		r.t.Fatalf("schedule %s for %s: %v", id, d, err)
	}
	return msg
}

// testDueKey carries, in the tests' own metadata, when a scheduled message is due:
// hand-off time plus the backend's effective delay.
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

// collect consumes n messages from queue, as the retry subscriber reads them, on a
// connection of its own, or fails after timeout.
func collect(t *testing.T, queue string, n int, timeout time.Duration) []arrival {
	t.Helper()
	conn := brokertest.Dial(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	m := marshal.Marshaler{Options: marshal.Options{Retry: true}}
	var out []arrival
	deadline := time.After(timeout)
	for len(out) < n {
		select {
		case d, ok := <-deliveries:
			if !ok {
				t.Fatalf("queue %s: consumer closed after %d of %d messages", queue, len(out), n)
			}
			msg, err := m.Unmarshal(d)
			if err != nil {
				t.Fatalf("unmarshal delivery from %s: %v", queue, err)
			}
			_ = d.Ack(false)
			out = append(out, arrival{msg: msg, at: time.Now()})
		case <-deadline:
			t.Fatalf("queue %s: got %d of %d messages within %s", queue, len(out), n, timeout)
		}
	}
	return out
}

func forEachBackend(t *testing.T, test func(t *testing.T, bc backendCase)) {
	for _, bc := range backendCases() {
		t.Run(bc.name.Name(), func(t *testing.T) { test(t, bc) })
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
	skipShort(t)
	t.Parallel()
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
	skipShort(t)
	t.Parallel()
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
	skipShort(t)
	t.Parallel()
	forEachBackend(t, func(t *testing.T, bc backendCase) {
		r := newRig(t, bc)
		sent := r.schedule(r.queue, "meta", 1500*time.Millisecond)
		got := collect(t, r.queue, 1, 30*time.Second)[0].msg
		for k, want := range map[string]string{
			keys.Attempt: "3",
			testDueKey:   sent.Metadata.Get(testDueKey),
		} {
			if got.Metadata.Get(k) != want {
				t.Errorf("%s = %q, want %q", k, got.Metadata.Get(k), want)
			}
		}
		if string(got.Payload) != "meta" || got.UUID != "meta" {
			t.Errorf("payload/uuid = %q/%q", got.Payload, got.UUID)
		}
		for _, k := range []string{wdelay.DelayedForKey, wdelay.DelayedUntilKey, keys.Tier} {
			if got.Metadata.Get(k) != "" {
				t.Errorf("%s came back; it would re-delay or re-route the message", k)
			}
		}
	})
}

func TestConformanceOnlyTheFailingQueue(t *testing.T) {
	skipShort(t)
	t.Parallel()
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
				t.Errorf("queue %s has %d extra messages", q, n)
			}
		}
	})
}

// TestConformanceParksWhenTheWorkQueueIsGone: a retry whose queue is deleted before it
// comes due is kept in the parking queue, and does not block the retries behind it.
func TestConformanceParksWhenTheWorkQueueIsGone(t *testing.T) {
	skipShort(t)
	t.Parallel()
	forEachBackend(t, func(t *testing.T, bc backendCase) {
		r := newRig(t, bc)
		if !slices.ContainsFunc(r.backend.Topology().Queues, func(q topology.Queue) bool { return q.Name == r.prefix+".parking" }) {
			// The memory backend publishes straight to the queue; the delayed-exchange
			// plugin routes a due message fire-and-forget, with no alternate exchange: a
			// retry for a deleted queue is lost (documented), and it refuses a queue that
			// does not exist before it publishes (TestDelayedExchangeRefusesMissingQueue).
			t.Skipf("the %s backend has no parking queue: a retry whose queue is gone is not kept", bc.name)
		}
		gone := r.prefix + ".gone"
		r.declareWorkQueue(gone)
		r.schedule(gone, "orphan", time.Second)
		r.schedule(r.queue, "behind", time.Second)
		ch, err := brokertest.Dial(t).Channel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDelete(gone, false, false, false); err != nil {
			t.Fatal(err)
		}
		if got := collect(t, r.queue, 1, 30*time.Second); got[0].msg.UUID != "behind" {
			t.Fatalf("got %s, want the retry behind the orphan", got[0].msg.UUID)
		}
		parked := collect(t, r.prefix+".parking", 1, 30*time.Second)
		if parked[0].msg.UUID != "orphan" || parked[0].msg.Metadata.Get(keys.Attempt) != "3" {
			t.Errorf("parked %s (%v), want orphan with its metadata", parked[0].msg.UUID, parked[0].msg.Metadata)
		}
	})
}

// TestBinaryLevelsLongDelays: 3s, 17s and 65s, scheduled together, each come back within
// the backend's precision (3 = 2+1, 17 = 16+1, 65 = 64+1: two levels each).
func TestBinaryLevelsLongDelays(t *testing.T) {
	skipShort(t)
	t.Parallel()
	bc := caseOf(delay.BinaryLevels(0))
	r := newRig(t, bc)
	delays := map[string]time.Duration{"3s": 3 * time.Second, "17s": 17 * time.Second, "65s": 65 * time.Second}
	for id, d := range delays {
		r.schedule(r.queue, id, d)
	}
	for _, a := range collect(t, r.queue, len(delays), 90*time.Second) {
		due := dueOf(t, a.msg)
		t.Logf("%s delay came back %s after its due time", a.msg.UUID, a.at.Sub(due).Round(time.Millisecond))
		checkOnTime(t, bc, a)
	}
}

func TestBinaryLevelsRefusesDelayPastMaximum(t *testing.T) {
	t.Parallel()
	h := dialHandoff(t)
	prefix := brokertest.Prefix(t)
	b, err := delay.New(delay.Spec{Name: delay.BinaryLevels(0).Name(), Prefix: prefix, Levels: 4}, backend.Env{Handoff: h})
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, b.Topology())
	if err := backend.Prepare(b, h, topology.ModeDeclare); err != nil {
		t.Fatal(err)
	}
	queue := prefix + ".orders"
	brokertest.Cleanup(t, []string{queue}, nil)
	if err := h.Ensure(topology.ModeDeclare, declare.Merge(topology.Topology{Queues: []topology.Queue{{Name: queue}}}, b.WorkQueue(queue))); err != nil {
		t.Fatal(err)
	}

	if d, err := b.Effective(15 * time.Second); err != nil || d != 15*time.Second {
		t.Errorf("Effective(15s) = %s, %v; want 15s, the maximum with 4 levels", d, err)
	}
	for _, d := range []time.Duration{15*time.Second + time.Millisecond, 16 * time.Second, time.Hour} {
		msg := message.NewMessage("late", nil)
		wdelay.Message(msg, wdelay.For(d))
		err := backend.Scheduler{Backend: b}.Publish(queue, msg)
		if !errors.Is(err, delay.ErrDelayTooLong) {
			t.Fatalf("Publish %s: %v, want ErrDelayTooLong", d, err)
		}
		for _, want := range []string{d.String(), "maximum 15s", `"` + queue + `"`} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not say %q", err, want)
			}
		}
	}
	for _, q := range b.DelayQueues() {
		if n := brokertest.QueueLength(t, q.Name); n != 0 {
			t.Errorf("a refused delay reached %s (%d messages)", q.Name, n)
		}
	}
}

// TestBackendsShareAPrefix: ttl-tiers and binary-levels declare no name two ways (their
// delivery exchanges differ in kind), so both can be prepared under one prefix.
func TestBackendsShareAPrefix(t *testing.T) {
	t.Parallel()
	h := dialHandoff(t)
	prefix := brokertest.Prefix(t)
	for _, name := range []delay.Backend{delay.TTLTiers(), delay.BinaryLevels(0), delay.TTLTiers()} {
		b, err := delay.New(delay.Spec{Name: name.Name(), Prefix: prefix, Tiers: []time.Duration{time.Second, time.Minute}, Levels: 4}, backend.Env{Handoff: h})
		if err != nil {
			t.Fatal(err)
		}
		brokertest.CleanupTopology(t, b.Topology())
		if err := backend.Prepare(b, h, topology.ModeDeclare); err != nil {
			t.Fatalf("%s under a prefix shared with the other backend: %v", name, err)
		}
	}
}

// TestBinaryLevelsRefusesAnotherLadderUnderItsPrefix: a binary-levels ladder of
// another number of levels under the same prefix would share the level exchanges and
// their bindings, which depend on Levels: Prepare refuses it, both ways, naming Levels,
// the queue it found and the fix (another prefix), and declares nothing; the same
// Levels again, or another prefix, is accepted.
func TestBinaryLevelsRefusesAnotherLadderUnderItsPrefix(t *testing.T) {
	t.Parallel()
	h := dialHandoff(t)
	prefix, other := brokertest.Prefix(t), brokertest.Prefix(t)+"-b"
	ladder := func(prefix string, levels int) backend.Backend {
		b, err := delay.New(delay.Spec{Name: delay.BinaryLevels(0).Name(), Prefix: prefix, Levels: levels}, backend.Env{Handoff: h})
		if err != nil {
			t.Fatal(err)
		}
		brokertest.CleanupTopology(t, b.Topology())
		return b
	}
	if err := backend.Prepare(ladder(prefix, 3), h, topology.ModeDeclare); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		levels     int
		found, why string
	}{
		{4, prefix + ".level.0", "fewer levels"},
		{2, prefix + ".level.2", "more levels"},
	} {
		b := ladder(prefix, c.levels)
		err := backend.Prepare(b, h, topology.ModeDeclare)
		if !errors.Is(err, topology.ErrMismatch) {
			t.Fatalf("Levels %d under a prefix with 3: %v, want ErrMismatch", c.levels, err)
		}
		for _, want := range []string{fmt.Sprintf("Levels: %d", c.levels), `"` + c.found + `"`, c.why, "change Prefix"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("Levels %d: error %q does not say %q", c.levels, err, want)
			}
		}
		if err := backend.Prepare(b, h, topology.ModeVerify); !errors.Is(err, topology.ErrMismatch) {
			t.Errorf("Levels %d in verify mode: %v, want ErrMismatch", c.levels, err)
		}
	}
	// Nothing of the refused ladder of 4 was declared.
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclarePassive(prefix+".level.3", true, false, false, false, nil); !amqperr.IsCode(err, 404) {
		t.Errorf("queue %s.level.3 after the refusal: %v, want 404", prefix, err)
	}
	for _, b := range []backend.Backend{ladder(prefix, 3), ladder(other, 4)} {
		if err := backend.Prepare(b, h, topology.ModeDeclare); err != nil {
			t.Errorf("%v", err)
		}
	}
}

// TestPrepare: the start-up checks on the broker at AMQP_URI, whatever its version:
// delayed-retry needs 4.3 (ErrUnsupported naming it before), delayed-exchange needs the
// plugin (ErrPluginMissing, with the 4.3 message from 4.3 on); verify mode checks without
// declaring, none does nothing.
func TestPrepare(t *testing.T) {
	t.Parallel()
	h := dialHandoff(t)
	v := h.Version()
	prefix := brokertest.Prefix(t)

	dr, err := delay.New(delay.Spec{Name: delay.DelayedRetry(0).Name(), RetryDelay: time.Second}, backend.Env{Handoff: h})
	if err != nil {
		t.Fatal(err)
	}
	err = backend.Prepare(dr, h, topology.ModeDeclare)
	switch at43 := version.DelayedRetry(v); {
	case at43 && err != nil:
		t.Errorf("delayed-retry on RabbitMQ %s: %v", v, err)
	case !at43 && (!errors.Is(err, delay.ErrUnsupported) || !strings.Contains(err.Error(), "RabbitMQ 4.3 or later") || !strings.Contains(err.Error(), "the broker is "+v)):
		t.Errorf("delayed-retry on RabbitMQ %s: %v, want ErrUnsupported naming 4.3 and the version", v, err)
	}

	dx, err := delay.New(delay.Spec{Name: delay.DelayedExchange().Name(), Prefix: prefix}, backend.Env{Handoff: h})
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, dx.Topology())
	err = backend.Prepare(dx, h, topology.ModeDeclare)
	switch {
	case version.NoPlugins(v):
		if !errors.Is(err, delay.ErrPluginMissing) || !strings.Contains(err.Error(), "RabbitMQ "+v+" cannot run the rabbitmq_delayed_message_exchange plugin (4.3 and later") {
			t.Errorf("delayed-exchange on RabbitMQ %s: %v, want ErrPluginMissing with the 4.3 message", v, err)
		}
	case err == nil:
		t.Logf("RabbitMQ %s has the delayed-message plugin", v)
	default:
		if !errors.Is(err, delay.ErrPluginMissing) || !strings.Contains(err.Error(), "rabbitmq-plugins enable rabbitmq_delayed_message_exchange") ||
			!strings.Contains(err.Error(), prefix+".delayed") {
			t.Errorf("delayed-exchange on RabbitMQ %s: %v, want ErrPluginMissing naming the exchange and the fix", v, err)
		}
		// Nothing declared, and the hand-off goes on (3.x closes the connection over
		// the unknown exchange type: the next publish reconnects).
		if err := h.Ensure(topology.ModeVerify, dx.Topology()); !errors.Is(err, topology.ErrMissing) {
			t.Errorf("after the refusal the exchange is checked as %v, want missing", err)
		}
	}

	tt, err := delay.New(delay.Spec{Name: delay.TTLTiers().Name(), Prefix: prefix, Tiers: []time.Duration{time.Second}}, backend.Env{Handoff: h})
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, tt.Topology())
	if err := backend.Prepare(tt, h, topology.ModeNone); err != nil {
		t.Fatal(err)
	}
	err = backend.Prepare(tt, h, topology.ModeVerify)
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), "ttl-tiers topology (mode verify)") {
		t.Fatalf("verify before declaring: %v", err)
	}
	if err := backend.Prepare(tt, h, topology.ModeDeclare); err != nil {
		t.Fatal(err)
	}
	if err := backend.Prepare(tt, h, topology.ModeVerify); err != nil {
		t.Fatalf("verify after declaring: %v", err)
	}
	// The hand-off still publishes after every refusal.
	q := prefix + ".after"
	brokertest.Cleanup(t, []string{q}, nil)
	if err := h.ToQueue(context.Background(), q, message.NewMessage("m", nil)); err != nil {
		t.Fatalf("publish after the start-up checks: %v", err)
	}
}

// TestDelayedExchangeRefusesMissingQueue needs the plugin: the binding made before the
// first publish proves the queue exists, since the plugin cannot return a publish.
func TestDelayedExchangeRefusesMissingQueue(t *testing.T) {
	t.Parallel()
	r := newRig(t, caseOf(delay.DelayedExchange()))
	msg := message.NewMessage("lost", nil)
	wdelay.Message(msg, wdelay.For(time.Second))
	missing := r.prefix + ".missing"
	if err := (backend.Scheduler{Backend: r.backend}).Publish(missing, msg); err == nil || !strings.Contains(err.Error(), missing) {
		t.Fatalf("Publish to a missing queue: %v, want an error naming it", err)
	}
}

// TestConformanceSurvivesBrokerRestart restarts the broker under test (stop_app and
// start_app through brokertest.Ctl, so on the RabbitMQ 4.x node of scripts/rabbitmq4.sh
// only that node), so it runs only when AMQPRETRY_BROKER_RESTART=1. It is not parallel:
// the restart would cut the other tests' connections. One restart serves every
// backend: each parks its retries, then the broker restarts once.
//
// The retries come due while the broker is stopped, and must all come back. Most
// restarts bring them back at once; but a broker that keeps its metadata in Mnesia
// (3.x; 4.0 to 4.2 by default) may expire them before it has restored its bindings, and
// then its dead-letter worker sends them again only brokertest.DeadLetterResend later
// (3 min by default): that is the bound, plus restartMargin.
func TestConformanceSurvivesBrokerRestart(t *testing.T) {
	brokertest.RequireRestart(t)
	resend := brokertest.DeadLetterResend(t)
	// One restart for every backend: all are prepared, then all their retries parked
	// right before it.
	type restartCase struct {
		bc  backendCase
		r   *rig
		why string // why the test does not apply, or ""
	}
	var cases []restartCase
	for _, bc := range backendCases() {
		r, why := prepareRig(t, bc)
		if r != nil {
			if _, ok := r.backend.(backend.InProcess); ok {
				r, why = nil, fmt.Sprintf("%s keeps its retries in this process: they do not outlive it, whatever the broker does", bc.name)
			}
		}
		cases = append(cases, restartCase{bc, r, why})
	}
	for _, c := range cases {
		if c.r == nil {
			continue
		}
		for i := range 3 {
			c.r.schedule(c.r.queue, "durable-"+strconv.Itoa(i), 5*time.Second) // a tier of conformanceTiers; still waiting when the broker stops
		}
	}
	restartBroker(t)
	back := time.Now()
	for _, c := range cases {
		t.Run(c.bc.name.Name(), func(t *testing.T) {
			if c.why != "" {
				t.Skip(c.why)
			}
			r := c.r
			r.t = t
			want := []string{"durable-0", "durable-1", "durable-2"}
			got, again := collectIDs(t, r.queue, want, max(resend+restartMargin-time.Since(back), restartMargin))
			for _, id := range want {
				a := got[id]
				t.Logf("%s came back %s after the broker did (%s after its due time)", id,
					a.at.Sub(back).Round(time.Millisecond), a.at.Sub(dueOf(t, a.msg)).Round(time.Millisecond))
				if late := a.at.Sub(back); late > restartMargin {
					t.Logf("%s: the broker's dead-letter worker sent it again after its timeout (%s): it expired before the broker had restored its bindings", id, resend)
				}
			}
			// The hand-off reconnects by itself, and the broker, which accepts
			// connections only once it has restored its bindings, routes a retry due
			// now at once.
			r.schedule(r.queue, "after-restart", time.Second)
			_, more := collectIDs(t, r.queue, []string{"after-restart"}, 30*time.Second)
			// A retry the broker dead-lettered as it stopped may come twice: at least
			// once, its worker sends again what the restart kept it from settling.
			for _, id := range append(again, more...) {
				if !slices.Contains(want, id) {
					t.Errorf("%s came back twice, or came back unasked", id)
				} else {
					t.Logf("%s came back twice (at-least-once dead lettering across the restart)", id)
				}
			}
		})
	}
}

// collectIDs consumes from queue, as collect does, until every message of want has
// arrived, or fails after timeout. It returns the first arrival of each and the ids of
// the others: any message that came again, or that was not asked for.
func collectIDs(t *testing.T, queue string, want []string, timeout time.Duration) (map[string]arrival, []string) {
	t.Helper()
	conn := brokertest.Dial(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	m := marshal.Marshaler{Options: marshal.Options{Retry: true}}
	got := map[string]arrival{}
	var others []string
	deadline := time.After(timeout)
	for missing := len(want); missing > 0; {
		select {
		case d, ok := <-deliveries:
			if !ok {
				t.Fatalf("queue %s: consumer closed with %d of %v still to come", queue, missing, want)
			}
			msg, err := m.Unmarshal(d)
			if err != nil {
				t.Fatalf("unmarshal delivery from %s: %v", queue, err)
			}
			_ = d.Ack(false)
			if _, seen := got[msg.UUID]; seen || !slices.Contains(want, msg.UUID) {
				others = append(others, msg.UUID)
				continue
			}
			got[msg.UUID] = arrival{msg: msg, at: time.Now()}
			missing--
		case <-deadline:
			t.Fatalf("queue %s: %d of %v still to come after %s (got %d, and %v)", queue, missing, want, timeout, len(got), others)
		}
	}
	return got, others
}

// TestDelayedExchangeShutdownWindow reproduces the window the README documents for the
// delayed-exchange backend: the plugin routes a message that comes due fire-and-forget,
// so retries due while the broker stops its application may be lost (measured 15 of
// 3,000). It schedules 3,000 confirmed retries whose due times span a stop_app and
// start_app, counts what reaches the work queue, and checks the loss against the README's
// bound of 1%. ttl-tiers and binary-levels lose nothing in the same situation
// (TestConformanceSurvivesBrokerRestart and the no-loss test).
func TestDelayedExchangeShutdownWindow(t *testing.T) {
	brokertest.RequireRestart(t)
	r := newRig(t, backendCase{name: delay.DelayedExchange(), precision: time.Second}) // skips without the plugin
	const n = 3000
	// Due one per millisecond from 3 s on: the restart begins while they come due.
	first := time.Now().Add(3 * time.Second)
	for i := range n {
		due := first.Add(time.Duration(i) * time.Millisecond)
		r.schedule(r.queue, fmt.Sprintf("w-%d", i), max(time.Until(due), time.Millisecond))
	}
	// The fault's time, not an event to wait for: the middle of the due window.
	time.Sleep(time.Until(first.Add(n * time.Millisecond / 2)))
	restartBroker(t)

	// Every retry is due by now. The plugin routes what is due, one due time after the
	// other, and then forgets it: once it holds none for the exchange, what reached the
	// work queue is all that will.
	exchange := r.backend.Topology().Exchanges[0].Name
	held := -1
	for deadline := time.Now().Add(time.Minute); held != 0; time.Sleep(250 * time.Millisecond) {
		held = pluginHeld(t, exchange)
		if held != 0 && time.Now().After(deadline) {
			t.Fatalf("the delayed-message plugin still holds %d retries of %s a minute after the restart, all past due", held, exchange)
		}
	}
	got := brokertest.QueueLength(t, r.queue)
	lost := n - got
	t.Logf("delayed-exchange: %d of %d retries due across stop_app/start_app reached the work queue, %d lost", got, n, lost)
	if lost < 0 || lost > n/100 {
		t.Errorf("lost %d of %d, outside the README's bound of 1%%", lost, n)
	}
}

// pluginHeld returns how many messages the delayed-message plugin holds for exchange
// (rabbit_delayed_message:messages_delayed/1, in every release of the plugin since 3.8).
func pluginHeld(t *testing.T, exchange string) int {
	t.Helper()
	u, err := amqp.ParseURI(brokertest.URI())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	expr := fmt.Sprintf(`{ok, X} = rabbit_exchange:lookup(rabbit_misc:r(<<%q>>, exchange, <<%q>>)), rabbit_delayed_message:messages_delayed(X).`, u.Vhost, exchange)
	out, err := brokertest.Ctl(ctx, "eval", expr)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	held, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatalf("messages the plugin holds: %q: %v", out, err)
	}
	return held
}

// restartMargin is how long after the broker accepts connections again a quorum queue
// may take to elect its leader, expire what came due and dead-letter it (well under a
// second on an idle machine; the rest is for a loaded one).
const restartMargin = 30 * time.Second

var restartMu sync.Mutex

// restartBroker restarts the broker's application (brokertest.RestartApp) and returns
// once it accepts connections again.
func restartBroker(t *testing.T) {
	t.Helper()
	restartMu.Lock()
	defer restartMu.Unlock()
	took, err := brokertest.RestartApp(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("broker restarted in %s", took.Round(time.Millisecond))
}

// skipShort skips a test that waits on the broker for seconds in the quick loop
// (go test -short); the test script runs it.
func skipShort(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("waits on the broker for seconds: not in -short")
	}
}
