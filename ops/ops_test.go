package ops_test

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strconv"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/topology"
)

var testTiers = []time.Duration{time.Second, 2 * time.Second}

// rig is an Ops on a fresh prefix whose topology (and work queues) are deleted at the
// end.
type rig struct {
	t      *testing.T
	prefix string
	cfg    ops.Config
	ops    *ops.Ops
	h      *delay.Handoff
	queues []string
}

func newRig(t *testing.T, workQueues ...string) *rig {
	t.Helper()
	brokertest.Dial(t) // skips without a broker
	prefix := brokertest.Prefix(t)
	cfg := ops.Config{URI: brokertest.URI(), Delay: delay.Config{Prefix: prefix, Tiers: testTiers}}
	r := &rig{t: t, prefix: prefix, cfg: cfg}
	for _, q := range workQueues {
		r.queues = append(r.queues, prefix+"."+q)
	}
	p, err := ops.PlanTopology(cfg, r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p.Topology)
	brokertest.Cleanup(t, r.queues, nil)
	o, err := ops.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = o.Close() })
	r.ops = o
	h, err := delay.Dial(delay.HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	r.h = h
	return r
}

func (r *rig) apply() {
	r.t.Helper()
	if _, err := r.ops.Apply(context.Background(), r.queues...); err != nil {
		r.t.Fatal(err)
	}
}

// poisoned is one message to put in the poison queue as the middleware would.
type poisoned struct {
	uuid, queue, reason, err string
	attempt                  int
	lastFailure              time.Time
}

func (r *rig) poison(msgs ...poisoned) {
	r.t.Helper()
	for _, p := range msgs {
		msg := message.NewMessage(p.uuid, []byte("payload of "+p.uuid))
		at := p.lastFailure
		if at.IsZero() {
			at = time.Now()
		}
		md := msg.Metadata
		md.Set(middleware.QueueKey, p.queue)
		md.Set(middleware.TopicKey, p.queue)
		md.Set(middleware.HandlerKey, "handler-"+p.queue)
		md.Set(middleware.PoisonReasonKey, p.reason)
		md.Set(middleware.ErrorKey, p.err)
		md.Set(middleware.ErrorTypesKey, "*fmt.wrapError > *errors.errorString")
		md.Set(middleware.AttemptKey, strconv.Itoa(p.attempt))
		md.Set(middleware.MaxAttemptsKey, "5")
		md.Set(middleware.FirstFailureKey, at.Add(-time.Minute).UTC().Format(time.RFC3339Nano))
		md.Set(middleware.LastFailureKey, at.UTC().Format(time.RFC3339Nano))
		md.Set("traceparent", traceparentOf(p.uuid))
		if err := r.h.PublishMessage(context.Background(), "", r.ops.PoisonQueue(), msg, nil); err != nil {
			r.t.Fatal(err)
		}
	}
}

// traceparentOf gives each poisoned message a W3C trace context of its own.
func traceparentOf(uuid string) string {
	return fmt.Sprintf("00-%032x-00f067aa0ba902b7-01", []byte(uuid))
}

func (r *rig) list(queue string) []string {
	r.t.Helper()
	res, err := r.ops.List(context.Background(), queue, ops.ListOptions{Limit: -1})
	if err != nil {
		r.t.Fatal(err)
	}
	ids := make([]string, len(res.Messages))
	for i, m := range res.Messages {
		ids[i] = m.UUID
	}
	return ids
}

func TestTopologyVerifyThenApply(t *testing.T) {
	r := newRig(t, "orders")
	ctx := context.Background()
	res, err := r.ops.Verify(ctx, ops.VerifyOptions{Bind: true}, r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	err = res.Err()
	if !errors.Is(err, topology.ErrMissing) {
		t.Fatalf("verify on a fresh prefix: %v, want ErrMissing", err)
	}
	for _, name := range []string{r.prefix + ".delay.1s", r.prefix + ".parking", r.prefix + ".poison", r.prefix + ".deliver", r.queues[0], "amqpretry topology apply --backend ttl-tiers --prefix " + r.prefix + " --tiers 1s,2s --queue " + r.queues[0]} {
		if !contains(err.Error(), name) {
			t.Errorf("verify error does not name %q:\n%v", name, err)
		}
	}
	r.apply()
	r.apply() // idempotent
	res, err = r.ops.Verify(ctx, ops.VerifyOptions{Bind: true}, r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	if err := res.Err(); err != nil {
		t.Fatalf("verify after apply: %v", err)
	}
	for _, f := range res.Report.Findings {
		if f.Kind == "queue" && !f.ArgsCompared {
			t.Errorf("guest may configure: arguments of %s should be compared", f.Name)
		}
	}

	// A tier queue declared with another TTL is a mismatch naming the argument.
	other := r.cfg
	other.Delay.Tiers = []time.Duration{time.Second, 3 * time.Second}
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	bad := r.prefix + ".delay.3s"
	brokertest.Cleanup(t, []string{bad}, nil)
	if _, err := ch.QueueDeclare(bad, true, false, false, false, amqp.Table{
		topology.QueueTypeArg: topology.QueueTypeQuorum, topology.MessageTTLArg: int64(9000),
		topology.DeadLetterExchangeArg: r.prefix + ".deliver", topology.DeadLetterStrategyArg: topology.DeadLetterAtLeastOnce,
		topology.OverflowArg: topology.OverflowRejectPublish,
	}); err != nil {
		t.Fatal(err)
	}
	o2, err := ops.New(other)
	if err != nil {
		t.Fatal(err)
	}
	defer o2.Close()
	res, err = o2.Verify(ctx, ops.VerifyOptions{}, r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	problems := res.Report.Problems()
	if len(problems) != 1 || problems[0].Name != bad || problems[0].Status != topology.StatusMismatch || problems[0].Arg != topology.MessageTTLArg {
		t.Fatalf("want one mismatch on %s naming an argument, got %+v", bad, problems)
	}
	if !errors.Is(res.Err(), topology.ErrMismatch) {
		t.Errorf("Err() = %v, want ErrMismatch", res.Err())
	}
	t.Logf("mismatch: %s", problems[0])
}

func contains(s, sub string) bool { return len(sub) == 0 || len(s) >= len(sub) && indexOf(s, sub) >= 0 }

func indexOf(s, sub string) int {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return i
		}
	}
	return -1
}

func TestListAndShowPoison(t *testing.T) {
	r := newRig(t, "orders", "billing")
	r.apply()
	orders, billing := r.queues[0], r.queues[1]
	old := time.Now().Add(-2 * time.Hour)
	r.poison(
		poisoned{uuid: "p1", queue: orders, reason: middleware.PoisonMaxAttempts, err: "warehouse offline", attempt: 5, lastFailure: old},
		poisoned{uuid: "p2", queue: billing, reason: middleware.PoisonPermanent, err: "missing customer id", attempt: 1},
		poisoned{uuid: "p3", queue: orders, reason: middleware.PoisonPermanent, err: "bad sku", attempt: 2},
	)
	ctx := context.Background()
	for _, tt := range []struct {
		name   string
		filter ops.Filter
		want   []string
	}{
		{"all", ops.Filter{}, []string{"p1", "p2", "p3"}},
		{"queue", ops.Filter{Queue: orders}, []string{"p1", "p3"}},
		{"reason", ops.Filter{Reason: middleware.PoisonPermanent}, []string{"p2", "p3"}},
		{"error substring", ops.Filter{Error: "customer"}, []string{"p2"}},
		{"older than", ops.Filter{OlderThan: time.Hour}, []string{"p1"}},
		{"newer than", ops.Filter{NewerThan: time.Hour}, []string{"p2", "p3"}},
		{"id", ops.Filter{IDs: []string{"p3"}}, []string{"p3"}},
	} {
		res, err := r.ops.ListPoison(ctx, ops.ListOptions{Filter: tt.filter})
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, m := range res.Messages {
			got = append(got, m.UUID)
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("%s: got %v, want %v", tt.name, got, tt.want)
		}
	}
	res, err := r.ops.ListPoison(ctx, ops.ListOptions{Filter: ops.Filter{IDs: []string{"p1"}}, Full: true})
	if err != nil || len(res.Messages) != 1 {
		t.Fatalf("show p1: %v, %+v", err, res)
	}
	m := res.Messages[0]
	if m.Queue != orders || m.Reason != middleware.PoisonMaxAttempts || m.Error != "warehouse offline" || m.Attempt != 5 || m.MaxAttempts != 5 ||
		m.Handler != "handler-"+orders || len(m.ErrorTypes) != 2 || !m.LastFailure.Equal(old.UTC().Truncate(0)) && m.LastFailure.Sub(old).Abs() > time.Millisecond ||
		string(m.Payload) != "payload of p1" {
		t.Errorf("envelope of p1: %+v", m)
	}
	if got := r.list(r.ops.PoisonQueue()); !slices.Equal(got, []string{"p1", "p2", "p3"}) {
		t.Errorf("after listing, the poison queue holds %v, want p1 p2 p3 in order", got)
	}
}

func TestRedriveDryRunChangesNothing(t *testing.T) {
	r := newRig(t, "orders")
	r.apply()
	for i := range 20 {
		r.poison(poisoned{uuid: fmt.Sprintf("m%02d", i), queue: r.queues[0], reason: middleware.PoisonMaxAttempts, err: "e", attempt: 5})
	}
	before := r.list(r.ops.PoisonQueue())
	res, err := r.ops.RedrivePoison(context.Background(), ops.MoveOptions{DryRun: true, ResetAttempts: true, Filter: ops.Filter{Error: "e"}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Matched != 20 || res.Done != 0 || len(res.Messages) != 20 {
		t.Errorf("dry run: %+v", res.Progress)
	}
	if got := r.list(r.ops.PoisonQueue()); !slices.Equal(got, before) {
		t.Errorf("poison queue after dry run: %v, want %v", got, before)
	}
	if n := brokertest.QueueLength(t, r.queues[0]); n != 0 {
		t.Errorf("work queue got %d messages from a dry run", n)
	}
}

func TestRedrivePoison(t *testing.T) {
	r := newRig(t, "orders", "billing")
	r.apply()
	orders, billing, gone := r.queues[0], r.queues[1], r.prefix+".gone"
	r.poison(
		poisoned{uuid: "a1", queue: orders, reason: middleware.PoisonMaxAttempts, err: "timeout", attempt: 5},
		poisoned{uuid: "b1", queue: billing, reason: middleware.PoisonPermanent, err: "bad input", attempt: 1},
		poisoned{uuid: "g1", queue: gone, reason: middleware.PoisonMaxAttempts, err: "timeout", attempt: 5},
		poisoned{uuid: "a2", queue: orders, reason: middleware.PoisonMaxAttempts, err: "timeout", attempt: 5},
		poisoned{uuid: "b2", queue: billing, reason: middleware.PoisonMaxAttempts, err: "timeout", attempt: 5},
	)
	var progress []ops.Progress
	res, err := r.ops.RedrivePoison(context.Background(), ops.MoveOptions{
		Filter: ops.Filter{Error: "timeout"}, ResetAttempts: true, Rate: 50,
		Progress: func(p ops.Progress) { progress = append(progress, p) },
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Done != 3 || res.Unroutable != 1 || res.Skipped != 1 || len(res.Unrouted) != 1 || res.Unrouted[0].UUID != "g1" {
		t.Errorf("result: %+v", res)
	}
	if len(progress) != 5 {
		t.Errorf("progress called %d times, want 5", len(progress))
	}
	// What stays, stays in order: the one not matching and the one whose queue is gone.
	if got := r.list(r.ops.PoisonQueue()); !slices.Equal(got, []string{"b1", "g1"}) {
		t.Errorf("poison queue holds %v, want b1 g1", got)
	}
	check := func(queue string, want ...string) {
		t.Helper()
		var got []string
		for _, msg := range brokertest.Drain(t, queue) {
			got = append(got, msg.UUID)
			if msg.Metadata.Get(middleware.AttemptKey) != "" || msg.Metadata.Get(middleware.PoisonReasonKey) != "" {
				t.Errorf("%s: attempt %q, reason %q left after a redrive with reset", msg.UUID, msg.Metadata.Get(middleware.AttemptKey), msg.Metadata.Get(middleware.PoisonReasonKey))
			}
			if msg.Metadata.Get(ops.RedriveCountKey) != "1" || msg.Metadata.Get(ops.RedrivenFromKey) != r.ops.PoisonQueue() {
				t.Errorf("%s: redrive metadata %v", msg.UUID, msg.Metadata)
			}
			if msg.Metadata.Get(middleware.ErrorKey) != "timeout" {
				t.Errorf("%s: failure envelope lost: %v", msg.UUID, msg.Metadata)
			}
			if msg.Metadata.Get("traceparent") != traceparentOf(msg.UUID) {
				t.Errorf("%s: trace context lost by the redrive: %q", msg.UUID, msg.Metadata.Get("traceparent"))
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("queue %s got %v, want %v", queue, got, want)
		}
	}
	check(orders, "a1", "a2")
	check(billing, "b2")

	// Without reset, the attempt count stays.
	r.poison(poisoned{uuid: "k1", queue: orders, reason: middleware.PoisonMaxAttempts, err: "x", attempt: 5})
	if _, err := r.ops.RedrivePoison(context.Background(), ops.MoveOptions{Filter: ops.Filter{IDs: []string{"k1"}}}); err != nil {
		t.Fatal(err)
	}
	got := brokertest.Drain(t, orders)
	if len(got) != 1 || got[0].Metadata.Get(middleware.AttemptKey) != "5" {
		t.Errorf("redrive without reset: %v", got)
	}
}

func TestPurgePoison(t *testing.T) {
	r := newRig(t, "orders")
	r.apply()
	r.poison(
		poisoned{uuid: "x1", queue: r.queues[0], reason: middleware.PoisonPermanent, err: "junk", attempt: 1},
		poisoned{uuid: "x2", queue: r.queues[0], reason: middleware.PoisonMaxAttempts, err: "keep", attempt: 5},
		poisoned{uuid: "x3", queue: r.queues[0], reason: middleware.PoisonPermanent, err: "junk", attempt: 1},
	)
	if _, err := r.ops.PurgePoison(context.Background(), ops.MoveOptions{}); err == nil {
		t.Fatal("purge without filter nor All succeeded")
	}
	res, err := r.ops.PurgePoison(context.Background(), ops.MoveOptions{Filter: ops.Filter{Reason: middleware.PoisonPermanent}})
	if err != nil || res.Done != 2 {
		t.Fatalf("purge: %v, %+v", err, res)
	}
	if got := r.list(r.ops.PoisonQueue()); !slices.Equal(got, []string{"x2"}) {
		t.Errorf("after purge: %v", got)
	}
}

// TestParkingRedrive: a retry whose work queue was deleted is parked; once the queue is
// re-created, parking redrive sends it there.
func TestParkingRedrive(t *testing.T) {
	r := newRig(t, "orders")
	r.apply()
	queue := r.queues[0]
	backend, err := delay.New(delay.Config{Prefix: r.prefix, Tiers: testTiers, Handoff: r.h})
	if err != nil {
		t.Fatal(err)
	}
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("parked-1", []byte("retry"))
	msg.Metadata.Set(middleware.QueueKey, queue)
	msg.Metadata.Set(middleware.AttemptKey, "2")
	wdelay.Message(msg, wdelay.For(time.Second))
	if err := backend.Publish(queue, msg); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, func() bool { return brokertest.QueueLength(t, r.ops.ParkingQueue()) == 1 })

	s, err := r.ops.Status(context.Background(), ops.StatusOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !s.Flagged() || !slices.ContainsFunc(s.Flags, func(f string) bool { return contains(f, "PARKED 1 messages") }) {
		t.Errorf("status does not flag the parked retry: %v", s.Flags)
	}
	parked, err := r.ops.ListParking(context.Background(), ops.ListOptions{})
	if err != nil || len(parked.Messages) != 1 || parked.Messages[0].Queue != queue || parked.Messages[0].Attempt != 2 {
		t.Fatalf("parking list: %v %+v", err, parked)
	}

	// Redrive before the queue exists: it stays parked.
	res, err := r.ops.RedriveParking(context.Background(), ops.MoveOptions{})
	if err != nil || res.Unroutable != 1 || res.Done != 0 {
		t.Fatalf("redrive to a missing queue: %v %+v", err, res)
	}
	if n := brokertest.QueueLength(t, r.ops.ParkingQueue()); n != 1 {
		t.Fatalf("parking holds %d after an unroutable redrive, want 1", n)
	}

	r.apply() // re-creates the work queue and its binding
	res, err = r.ops.RedriveParking(context.Background(), ops.MoveOptions{})
	if err != nil || res.Done != 1 {
		t.Fatalf("parking redrive: %v %+v", err, res)
	}
	got := brokertest.Drain(t, queue)
	if len(got) != 1 || got[0].UUID != "parked-1" || got[0].Metadata.Get(middleware.AttemptKey) != "2" {
		t.Fatalf("work queue got %v", got)
	}
	if n := brokertest.QueueLength(t, r.ops.ParkingQueue()); n != 0 {
		t.Errorf("parking holds %d after the redrive", n)
	}
}

// TestStatusStuck: a delay queue whose dead letters are refused by their destination
// (a full work queue with x-overflow reject-publish, under at-least-once dead
// lettering) keeps its head past its due time: STUCK.
//
// Those expired messages leave the ready list (AMQP sees an empty queue), so the check
// needs the broker's own counts: rabbitmqctl here.
func TestStatusStuck(t *testing.T) {
	if _, err := exec.LookPath(brokertest.CtlCommand()[0]); err != nil {
		t.Skipf("needs %s: %v", brokertest.CtlCommand()[0], err)
	}
	if out, err := brokertest.Ctl(context.Background(), "-q", "list_queues", "name"); err != nil {
		t.Skipf("rabbitmqctl does not reach the broker: %v\n%s", err, out)
	}
	r := newRig(t, "full")
	queue := r.queues[0]
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-max-length": int64(0), topology.OverflowArg: topology.OverflowRejectPublish}); err != nil {
		t.Fatal(err)
	}
	r.apply()
	backend, err := delay.New(delay.Config{Prefix: r.prefix, Tiers: testTiers, Handoff: r.h})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("stuck-1", []byte("x"))
	wdelay.Message(msg, wdelay.For(time.Second))
	if err := backend.Publish(queue, msg); err != nil {
		t.Fatal(err)
	}
	tier := r.prefix + ".delay.1s"
	var s ops.Status
	waitFor(t, 30*time.Second, func() bool {
		s, err = r.ops.Status(context.Background(), ops.StatusOptions{
			StuckMargin: time.Second, Peek: ops.PeekAlways,
			Counts: ops.RabbitmqctlCounts(brokertest.CtlCommand(), ops.VHost(brokertest.URI())), BacklogInterval: time.Second,
		})
		if err != nil {
			t.Fatal(err)
		}
		return slices.ContainsFunc(s.Queues, func(q ops.QueueStatus) bool { return q.Name == tier && q.Stuck })
	})
	if !slices.ContainsFunc(s.Flags, func(f string) bool { return contains(f, "STUCK delay queue "+tier) }) {
		t.Errorf("flags: %v", s.Flags)
	}
	for _, q := range s.Queues {
		if q.Name == tier && (!q.BacklogKnown || q.DeadLetterBacklog != 1) {
			t.Errorf("stuck queue status: %+v", q)
		}
	}
	// Empty the stuck queue so that cleanup is quick.
	_, _ = ch.QueuePurge(tier, false)
}

func TestStatusHealthy(t *testing.T) {
	r := newRig(t)
	r.apply()
	r.poison(poisoned{uuid: "old", queue: "q", reason: middleware.PoisonPermanent, err: "e", attempt: 1, lastFailure: time.Now().Add(-time.Hour)})
	s, err := r.ops.Status(context.Background(), ops.StatusOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s.Flagged() {
		t.Errorf("flags on a healthy topology: %v", s.Flags)
	}
	if s.Broker == "" || !s.PluginKnown {
		t.Errorf("broker %q, plugin known %v (%s)", s.Broker, s.PluginKnown, s.PluginNote)
	}
	last := s.Queues[len(s.Queues)-1]
	if last.Role != ops.RolePoison || last.Messages != 1 || !last.AgeKnown || last.OldestAge < time.Hour {
		t.Errorf("poison queue status: %+v", last)
	}
	if n := brokertest.QueueLength(t, r.ops.PoisonQueue()); n != 1 {
		t.Errorf("the peek changed the poison queue: %d messages", n)
	}
}

func waitFor(t *testing.T, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(200 * time.Millisecond)
	}
}
