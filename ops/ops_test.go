package ops_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/derived"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
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
	h      backend.Handoff
	queues []string
}

func newRig(t *testing.T, workQueues ...string) *rig {
	t.Helper()
	return newRigWith(t, amqpretry.Config{Backend: delay.TTLTiers(testTiers...)}, workQueues...)
}

// newRigWith is newRig with retry (its Prefix is set here).
func newRigWith(t *testing.T, retry amqpretry.Config, workQueues ...string) *rig {
	t.Helper()
	brokertest.Dial(t) // skips without a broker
	prefix := brokertest.Prefix(t)
	retry.Prefix = prefix
	cfg := ops.Config{URI: brokertest.URI(), Retry: retry}
	r := &rig{t: t, prefix: prefix, cfg: cfg}
	for _, q := range workQueues {
		r.queues = append(r.queues, prefix+"."+q)
	}
	planned := retry
	if planned.WithDefaults().Backend != (delay.DelayedRetry(0)) {
		planned.Policy = amqpretry.Policy{Delays: []time.Duration{time.Second}, Jitter: -1}
	}
	p, err := planned.Plan(r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p)
	brokertest.Cleanup(t, append(slices.Clone(r.queues), prefix+".poison", prefix+".parking"), []string{prefix + ".parking", prefix + ".delayed"})
	o, err := ops.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = o.Close() })
	r.ops = o
	h, err := handoff.Dial(backend.HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	r.h = h
	return r
}

func (r *rig) apply() []string {
	r.t.Helper()
	created, err := r.ops.Apply(context.Background(), r.queues...)
	if err != nil {
		r.t.Fatal(err)
	}
	return created
}

func (r *rig) poisonQueue() string { return r.cfg.Retry.WithDefaults().PoisonQueue }

// poisoned is one message to put in the poison queue as the middleware would.
type poisoned struct {
	uuid, queue, err string
	reason           amqpretry.Reason
	attempt          int
	lastFailure      time.Time
}

func (r *rig) poison(msgs ...poisoned) {
	r.t.Helper()
	for _, p := range msgs {
		msg := message.NewMessage(p.uuid, []byte("payload of "+p.uuid))
		at := p.lastFailure
		if at.IsZero() {
			at = time.Now()
		}
		middleware.Envelope{
			Queue: p.queue, Topic: p.queue, Handler: "handler-" + p.queue, Reason: p.reason, Error: p.err,
			ErrorTypes: []string{"*fmt.wrapError", "*errors.errorString"}, Attempt: p.attempt, MaxAttempts: 5,
			FirstFailure: at.Add(-time.Minute), LastFailure: at,
		}.Write(msg.Metadata)
		msg.Metadata.Set("traceparent", traceparentOf(p.uuid))
		if err := r.h.ToQueue(context.Background(), r.poisonQueue(), msg); err != nil {
			r.t.Fatal(err)
		}
	}
}

// traceparentOf gives each poisoned message a W3C trace context of its own.
func traceparentOf(uuid string) string {
	return fmt.Sprintf("00-%032x-00f067aa0ba902b7-01", []byte(uuid))
}

func (r *rig) list(source ops.Source) []string {
	r.t.Helper()
	res, err := r.ops.List(context.Background(), source, ops.ListOptions{Limit: -1})
	if err != nil {
		r.t.Fatal(err)
	}
	ids := make([]string, len(res.Messages))
	for i, m := range res.Messages {
		ids[i] = m.UUID
	}
	return ids
}

func problems(findings []ops.Finding) []ops.Finding {
	var out []ops.Finding
	for _, f := range findings {
		if f.Status != ops.VerdictOK && f.Status != ops.VerdictUnchecked {
			out = append(out, f)
		}
	}
	return out
}

func TestTopologyVerifyThenApply(t *testing.T) {
	r := newRig(t, "orders")
	ctx := context.Background()
	findings, err := r.ops.Verify(ctx, ops.VerifyOptions{Bind: true}, r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	missing := map[string]bool{}
	for _, f := range findings {
		if f.Status == ops.VerdictMissing {
			missing[f.Kind+" "+f.Name] = true
		}
	}
	for _, want := range []string{"queue " + r.prefix + ".delay.1s", "queue " + r.prefix + ".parking", "queue " + r.prefix + ".poison",
		"exchange " + r.prefix + ".deliver", "work queue " + r.queues[0], "binding " + r.queues[0]} {
		if !missing[want] {
			t.Errorf("verify on a fresh prefix does not find %s missing: %v", want, findings)
		}
	}
	if created := r.apply(); !slices.Equal(created, r.queues) {
		t.Errorf("first apply created %v, want %v", created, r.queues)
	}
	if created := r.apply(); len(created) != 0 { // idempotent
		t.Errorf("second apply created %v", created)
	}
	findings, err = r.ops.Verify(ctx, ops.VerifyOptions{Bind: true}, r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range findings {
		if f.Status != ops.VerdictOK {
			t.Errorf("after apply, with --bind and configure permission: %+v", f)
		}
	}
	findings, _ = r.ops.Verify(ctx, ops.VerifyOptions{}, r.queues...)
	for _, f := range findings {
		if f.Kind == "binding" && f.Status != ops.VerdictUnchecked {
			t.Errorf("binding not asserted but %s", f.Status)
		}
	}

	// A tier queue declared with another TTL is a mismatch naming the argument.
	other := r.cfg
	other.Retry.Backend = delay.TTLTiers(time.Second, 3*time.Second)
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	bad := r.prefix + ".delay.3s"
	brokertest.Cleanup(t, []string{bad}, nil)
	if _, err := ch.QueueDeclare(bad, true, false, false, false, amqp.Table{
		declare.QueueTypeArg: declare.QueueTypeQuorum, declare.MessageTTLArg: int64(9000),
		declare.DeadLetterExchangeArg: r.prefix + ".deliver", declare.DeadLetterStrategyArg: declare.DeadLetterAtLeastOnce,
		declare.OverflowArg: declare.OverflowRejectPublish,
	}); err != nil {
		t.Fatal(err)
	}
	o2, err := ops.New(other)
	if err != nil {
		t.Fatal(err)
	}
	defer o2.Close()
	findings, err = o2.Verify(ctx, ops.VerifyOptions{}, r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	p := problems(findings)
	if len(p) != 1 || p[0].Name != bad || p[0].Status != ops.VerdictMismatch || p[0].Arg != declare.MessageTTLArg {
		t.Fatalf("want one mismatch on %s naming an argument, got %+v", bad, p)
	}
	if _, err := o2.Apply(ctx, r.queues...); !errors.Is(err, topology.ErrMismatch) || !strings.Contains(err.Error(), bad) {
		t.Errorf("apply over a mismatch: %v, want ErrMismatch naming %s", err, bad)
	}
}

// TestVerifyWithoutConfigurePermission (issue 19): a user without configure
// permission cannot compare arguments; a queue declared with other arguments is then
// unchecked, never ok.
func TestVerifyWithoutConfigurePermission(t *testing.T) {
	skipShort(t)
	r := newRig(t, "orders")
	r.apply()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	// Re-create the 2s tier with another TTL.
	tier := r.prefix + ".delay.2s"
	if _, err := ch.QueueDelete(tier, false, false, false); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(tier, true, false, false, false, amqp.Table{declare.QueueTypeArg: declare.QueueTypeQuorum, declare.MessageTTLArg: int64(9000)}); err != nil {
		t.Fatal(err)
	}
	uri := brokertest.RestrictedUser(t)
	cfg := r.cfg
	cfg.URI = uri
	o, err := ops.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	findings, err := o.Verify(context.Background(), ops.VerifyOptions{Bind: true}, r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range findings {
		if f.Kind == "queue" && f.Name == tier && f.Status != ops.VerdictUnchecked {
			t.Errorf("mismatched %s checked by a user without configure permission: %+v, want unchecked", tier, f)
		}
		if f.Kind == "queue" && f.Status == ops.VerdictOK {
			t.Errorf("%s ok although its arguments could not be compared", f.Name)
		}
		if f.Kind == "binding" && f.Status != ops.VerdictOK {
			t.Errorf("binding asserted without configure permission: %+v", f)
		}
	}
}

// TestApplyHeldRetriesWorkQueue: with held retries the plan gives each work
// queue its arguments; Apply creates a missing one with them (a quorum queue), and a
// work queue declared otherwise is a mismatch.
func TestApplyHeldRetriesWorkQueue(t *testing.T) {
	r := newRigWith(t, amqpretry.Config{Backend: delay.HeldRetries(1, 500*time.Millisecond, delay.TTLTiers(testTiers...))}, "orders", "classic")
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(r.queues[1], true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	created, err := r.ops.Apply(context.Background(), r.queues...)
	if !errors.Is(err, topology.ErrMismatch) || !strings.Contains(err.Error(), r.queues[1]) {
		t.Fatalf("apply over a classic work queue that needs delayed retries: %v", err)
	}
	if !slices.Equal(created, r.queues[:1]) {
		t.Errorf("created %v, want %v", created, r.queues[:1])
	}
	// The created work queue is a quorum queue with the delayed-retry arguments and the
	// poison queue as its dead-letter target: the same declaration is a no-op, a
	// classic one is refused.
	args := backend.WithDeadLetter(backend.WorkQueueArgs(500*time.Millisecond), r.prefix+".poison")
	if _, err := ch.QueueDeclare(r.queues[0], true, false, false, false, args); err != nil {
		t.Fatalf("work queue not declared with the plan's arguments: %v", err)
	}
	if _, err := ch.QueueDeclare(r.queues[0], true, false, false, false, nil); !amqperr.IsCode(err, amqp.PreconditionFailed) {
		t.Errorf("work queue declared classic: %v", err)
	}
	ch2, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch2.Close()
	if _, err := ch2.QueueDelete(r.queues[1], false, false, false); err != nil {
		t.Fatal(err)
	}
	findings, err := r.ops.Verify(context.Background(), ops.VerifyOptions{}, r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	var work []string
	for _, f := range findings {
		if f.Kind == "work queue" {
			work = append(work, f.Name+" "+string(f.Status))
		}
	}
	if want := []string{r.queues[0] + " ok", r.queues[1] + " missing"}; !slices.Equal(work, want) {
		t.Errorf("work queue findings %v, want %v", work, want)
	}
}

func TestListAndShowPoison(t *testing.T) {
	r := newRig(t, "orders", "billing")
	r.apply()
	orders, billing := r.queues[0], r.queues[1]
	old := time.Now().Add(-2 * time.Hour)
	r.poison(
		poisoned{uuid: "p1", queue: orders, reason: amqpretry.ReasonMaxAttempts, err: "warehouse offline", attempt: 5, lastFailure: old},
		poisoned{uuid: "p2", queue: billing, reason: amqpretry.ReasonPermanent, err: "missing customer id", attempt: 1},
		poisoned{uuid: "p3", queue: orders, reason: amqpretry.ReasonPermanent, err: "bad sku", attempt: 2},
	)
	ctx := context.Background()
	for _, tt := range []struct {
		name   string
		filter ops.Filter
		want   []string
	}{
		{"all", ops.Filter{}, []string{"p1", "p2", "p3"}},
		{"queue", ops.Filter{Queue: orders}, []string{"p1", "p3"}},
		{"reason", ops.Filter{Reason: amqpretry.ReasonPermanent}, []string{"p2", "p3"}},
		{"error substring", ops.Filter{Error: "customer"}, []string{"p2"}},
		{"older than", ops.Filter{OlderThan: time.Hour}, []string{"p1"}},
		{"newer than", ops.Filter{NewerThan: time.Hour}, []string{"p2", "p3"}},
		{"id", ops.Filter{IDs: []string{"p3"}}, []string{"p3"}},
	} {
		res, err := r.ops.List(ctx, ops.Poison, ops.ListOptions{Filter: tt.filter})
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, m := range res.Messages {
			got = append(got, m.UUID)
		}
		if !slices.Equal(got, tt.want) || !res.Complete || res.Depth != 3 || res.Scanned != 3 {
			t.Errorf("%s: got %v (%+v), want %v", tt.name, got, res, tt.want)
		}
	}
	res, err := r.ops.List(ctx, ops.Poison, ops.ListOptions{Filter: ops.Filter{IDs: []string{"p1"}}, Full: true})
	if err != nil || len(res.Messages) != 1 {
		t.Fatalf("show p1: %v, %+v", err, res)
	}
	m := res.Messages[0]
	if m.Queue != orders || m.Reason != amqpretry.ReasonMaxAttempts || m.Error != "warehouse offline" || m.Attempt != 5 || m.MaxAttempts != 5 ||
		m.Handler != "handler-"+orders || len(m.ErrorTypes) != 2 || m.LastFailure.Sub(old).Abs() > time.Millisecond || !m.Time.Equal(m.LastFailure) ||
		string(m.Payload) != "payload of p1" || m.Metadata.Get("traceparent") != traceparentOf("p1") || m.RoutingKey != r.poisonQueue() {
		t.Errorf("envelope of p1: %+v", m)
	}
	res, err = r.ops.List(ctx, ops.Poison, ops.ListOptions{Limit: 2})
	if err != nil || len(res.Messages) != 2 || res.Complete {
		t.Errorf("limit 2: %v %+v", err, res)
	}
	if got := r.list(ops.Poison); !slices.Equal(got, []string{"p1", "p2", "p3"}) {
		t.Errorf("after listing, the poison queue has %v, want p1 p2 p3 in order", got)
	}
}

// TestListNamesTheDeliveryLimit: a message the broker dead-lettered from a quorum work
// queue to the poison queue past its x-delivery-limit (what becomes of one no client
// can read, docs/troubleshooting.md) carries no envelope: List reports reason
// delivery-limit and the work queue it came from, which a redrive sends it back to.
func TestListNamesTheDeliveryLimit(t *testing.T) {
	r := newRig(t)
	r.apply()
	work := r.prefix + ".orders"
	brokertest.Cleanup(t, []string{work}, nil)
	conn := brokertest.Dial(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	args := amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(1), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": r.poisonQueue()}
	if _, err := ch.QueueDeclare(work, true, false, false, false, args); err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", work, true, false,
		amqp.Publishing{Headers: amqp.Table{"_watermill_message_uuid": "u1"}, Body: []byte("unread"), DeliveryMode: amqp.Persistent})
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := dc.WaitContext(context.Background()); !ok || err != nil {
		t.Fatalf("publish not confirmed: %v", err)
	}
	// A delivery whose channel closes unacknowledged counts as failed, as when a client
	// cannot read it and loses its connection.
	waitFor(t, 30*time.Second, func() bool {
		c, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		ds, err := c.Consume(work, "", false, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		select {
		case <-ds:
		case <-time.After(time.Second):
		}
		_ = c.Close()
		return brokertest.QueueLength(t, r.poisonQueue()) == 1
	})
	ctx := context.Background()
	res, err := r.ops.List(ctx, ops.Poison, ops.ListOptions{Filter: ops.Filter{Reason: amqpretry.ReasonDeliveryLimit}})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Messages) != 1 || res.Messages[0].UUID != "u1" || res.Messages[0].Queue != work {
		t.Fatalf("reason delivery-limit: %+v, want u1 from %s", res.Messages, work)
	}
	if _, err := r.ops.Redrive(ctx, ops.Poison, ops.MoveOptions{Filter: ops.Filter{IDs: []string{"u1"}}}); err != nil {
		t.Fatal(err)
	}
	if got := brokertest.Drain(t, work); len(got) != 1 || got[0].UUID != "u1" {
		t.Errorf("redriven to %s: %v, want u1", work, got)
	}
}

func TestRedriveDryRunChangesNothing(t *testing.T) {
	r := newRig(t, "orders")
	r.apply()
	for i := range 20 {
		r.poison(poisoned{uuid: fmt.Sprintf("m%02d", i), queue: r.queues[0], reason: amqpretry.ReasonMaxAttempts, err: "e", attempt: 5})
	}
	before := r.list(ops.Poison)
	for _, move := range []func(context.Context, ops.Source, ops.MoveOptions) (ops.MoveResult, error){r.ops.Redrive, r.ops.Purge} {
		res, err := move(context.Background(), ops.Poison, ops.MoveOptions{DryRun: true, ResetAttempts: true, Filter: ops.Filter{Error: "e"}})
		if err != nil {
			t.Fatal(err)
		}
		if res.Matched != 20 || res.Done != 0 || len(res.Messages) != 20 || !res.DryRun {
			t.Errorf("dry run: %+v", res)
		}
		if got := r.list(ops.Poison); !slices.Equal(got, before) {
			t.Errorf("poison queue after dry run: %v, want %v", got, before)
		}
	}
	if n := brokertest.QueueLength(t, r.queues[0]); n != 0 {
		t.Errorf("work queue got %d messages from a dry run", n)
	}
}

// TestRedriveDryRunUnroutable (issue 43): a dry run of a redrive towards a deleted
// queue counted the messages as redriven; the run leaves them (unroutable). The dry
// run checks each queue passively, as the run's publish would find it, and reports
// the same: the message is in Unrouted, not in Messages.
func TestRedriveDryRunUnroutable(t *testing.T) {
	r := newRig(t, "orders", "billing")
	r.apply()
	r.poison(poisoned{uuid: "o-1", queue: r.queues[0], reason: amqpretry.ReasonMaxAttempts, err: "e", attempt: 5})
	r.poison(poisoned{uuid: "b-1", queue: r.queues[1], reason: amqpretry.ReasonMaxAttempts, err: "e", attempt: 5})
	r.poison(poisoned{uuid: "b-2", queue: r.queues[1], reason: amqpretry.ReasonMaxAttempts, err: "e", attempt: 5})
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDelete(r.queues[1], false, false, false); err != nil {
		t.Fatal(err)
	}
	uuids := func(ms []ops.Message) []string {
		var out []string
		for _, m := range ms {
			out = append(out, m.UUID)
		}
		return out
	}
	for _, dry := range []bool{true, false} {
		res, err := r.ops.Redrive(context.Background(), ops.Poison, ops.MoveOptions{DryRun: dry})
		if err != nil || res.Matched != 3 || res.Unroutable != 2 || !slices.Equal(uuids(res.Unrouted), []string{"b-1", "b-2"}) ||
			!slices.Equal(uuids(res.Messages), []string{"o-1"}) {
			t.Errorf("redrive (dry run %v) towards a deleted queue: %v %+v", dry, err, res)
		}
	}
}

func TestRedrivePoison(t *testing.T) {
	r := newRig(t, "orders", "billing")
	r.apply()
	orders, billing, gone := r.queues[0], r.queues[1], r.prefix+".gone"
	r.poison(
		poisoned{uuid: "a1", queue: orders, reason: amqpretry.ReasonMaxAttempts, err: "timeout", attempt: 5},
		poisoned{uuid: "b1", queue: billing, reason: amqpretry.ReasonPermanent, err: "bad input", attempt: 1},
		poisoned{uuid: "g1", queue: gone, reason: amqpretry.ReasonMaxAttempts, err: "timeout", attempt: 5},
		poisoned{uuid: "a2", queue: orders, reason: amqpretry.ReasonMaxAttempts, err: "timeout", attempt: 5},
		poisoned{uuid: "b2", queue: billing, reason: amqpretry.ReasonMaxAttempts, err: "timeout", attempt: 5},
	)
	var progress []ops.MoveResult
	res, err := r.ops.Redrive(context.Background(), ops.Poison, ops.MoveOptions{
		Filter: ops.Filter{Error: "timeout"}, ResetAttempts: true, Rate: 50,
		Progress: func(p ops.MoveResult) { progress = append(progress, p) },
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Done != 3 || res.Unroutable != 1 || res.Skipped != 1 || len(res.Unrouted) != 1 || res.Unrouted[0].UUID != "g1" || res.Unrouted[0].Queue != gone || res.Stopped != "" {
		t.Errorf("result: %+v", res)
	}
	if len(progress) != 5 || progress[4].Scanned != 5 || progress[0].Scanned != 1 {
		t.Errorf("progress called %d times: %+v", len(progress), progress)
	}
	// What stays, stays in order: the one not matching and the one whose queue is gone.
	if got := r.list(ops.Poison); !slices.Equal(got, []string{"b1", "g1"}) {
		t.Errorf("poison queue has %v, want b1 g1", got)
	}
	if _, err := brokertest.Dial(t).Channel(); err != nil {
		t.Fatal(err)
	}
	check := func(queue string, want ...string) {
		t.Helper()
		var got []string
		for _, msg := range brokertest.Drain(t, queue) {
			got = append(got, msg.UUID)
			env := middleware.ReadEnvelope(msg.Metadata)
			if env.Attempt != 0 || env.Reason != "" {
				t.Errorf("%s: attempt %d, reason %q left after a redrive with reset", msg.UUID, env.Attempt, env.Reason)
			}
			if env.Redriven != 1 || env.RedrivenFrom != r.poisonQueue() || time.Since(env.RedrivenAt) > time.Minute {
				t.Errorf("%s: redrive envelope %+v", msg.UUID, env)
			}
			if env.Error != "timeout" || env.Queue != queue || env.MaxAttempts != 5 {
				t.Errorf("%s: failure envelope lost: %+v", msg.UUID, env)
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
	r.poison(poisoned{uuid: "k1", queue: orders, reason: amqpretry.ReasonMaxAttempts, err: "x", attempt: 5})
	if _, err := r.ops.Redrive(context.Background(), ops.Poison, ops.MoveOptions{Filter: ops.Filter{IDs: []string{"k1"}}}); err != nil {
		t.Fatal(err)
	}
	got := brokertest.Drain(t, orders)
	if len(got) != 1 || got[0].Metadata.Get(keys.Attempt) != "5" {
		t.Errorf("redrive without reset: %v", got)
	}
}

func TestPurgePoison(t *testing.T) {
	r := newRig(t, "orders")
	r.apply()
	r.poison(
		poisoned{uuid: "x1", queue: r.queues[0], reason: amqpretry.ReasonPermanent, err: "junk", attempt: 1},
		poisoned{uuid: "x2", queue: r.queues[0], reason: amqpretry.ReasonMaxAttempts, err: "keep", attempt: 5},
		poisoned{uuid: "x3", queue: r.queues[0], reason: amqpretry.ReasonPermanent, err: "junk", attempt: 1},
	)
	if _, err := r.ops.Purge(context.Background(), ops.Poison, ops.MoveOptions{}); err == nil || !strings.Contains(err.Error(), "MoveOptions.All") {
		t.Fatalf("purge without filter nor All: %v", err)
	}
	res, err := r.ops.Purge(context.Background(), ops.Poison, ops.MoveOptions{Filter: ops.Filter{Reason: amqpretry.ReasonPermanent}})
	if err != nil || res.Done != 2 {
		t.Fatalf("purge: %v, %+v", err, res)
	}
	if got := r.list(ops.Poison); !slices.Equal(got, []string{"x2"}) {
		t.Errorf("after purge: %v", got)
	}
	if res, err := r.ops.Purge(context.Background(), ops.Poison, ops.MoveOptions{All: true}); err != nil || res.Done != 1 {
		t.Errorf("purge --all: %v %+v", err, res)
	}
}

// TestWindowKeepsOrder: with a window smaller than the run, the run stops when the
// window is full, and what it kept is back in its place, in order.
func TestWindowKeepsOrder(t *testing.T) {
	r := newRig(t, "orders", "billing")
	r.apply()
	for i := range 10 { // even: orders, odd: billing
		r.poison(poisoned{uuid: fmt.Sprintf("m%d", i), queue: r.queues[i%2], reason: amqpretry.ReasonPermanent, err: "e", attempt: 1})
	}
	res, err := r.ops.Redrive(context.Background(), ops.Poison, ops.MoveOptions{Filter: ops.Filter{Queue: r.queues[1]}, Window: 3})
	if err != nil || res.Stopped != "window" || res.Done != 2 {
		t.Fatalf("redrive with a small window: %v %+v", err, res)
	}
	// m0, m2, m4 were kept (not matching); m1, m3 redriven before the window filled;
	// the rest was never looked at. Kept and never taken each keep their order; a
	// quorum queue may put the kept behind the others (see scan.close).
	got := r.list(ops.Poison)
	kept := slices.DeleteFunc(slices.Clone(got), func(id string) bool { return !slices.Contains([]string{"m0", "m2", "m4"}, id) })
	rest := slices.DeleteFunc(slices.Clone(got), func(id string) bool { return slices.Contains([]string{"m0", "m2", "m4"}, id) })
	if !slices.Equal(kept, []string{"m0", "m2", "m4"}) || !slices.Equal(rest, []string{"m5", "m6", "m7", "m8", "m9"}) {
		t.Errorf("poison queue after the run: %v", got)
	}
	t.Logf("poison queue after a run stopped by its window: %v", got)
	if _, err := r.ops.List(context.Background(), ops.Poison, ops.ListOptions{Window: -1}); err == nil {
		t.Error("negative window accepted")
	}
}

// TestRedriveInterrupted: a cancelled context stops a redrive between two messages,
// with no error and every message in exactly one place.
func TestRedriveInterrupted(t *testing.T) {
	r := newRig(t, "orders")
	r.apply()
	for i := range 50 {
		r.poison(poisoned{uuid: fmt.Sprintf("m%02d", i), queue: r.queues[0], reason: amqpretry.ReasonPermanent, err: "e", attempt: 1})
	}
	ctx, cancel := context.WithCancel(context.Background())
	res, err := r.ops.Redrive(ctx, ops.Poison, ops.MoveOptions{Rate: 100, Progress: func(p ops.MoveResult) {
		if p.Done == 10 {
			cancel()
		}
	}})
	if err != nil || res.Stopped != "interrupted" || res.Done != 10 {
		t.Fatalf("interrupted redrive: %v %+v", err, res)
	}
	left := r.list(ops.Poison)
	moved := brokertest.Drain(t, r.queues[0])
	if len(left) != 40 || len(moved) != 10 || left[0] != "m10" {
		t.Errorf("after the interrupt: %d left (first %v), %d moved", len(left), left[:1], len(moved))
	}
}

// schedule parks msg for queue through the backend of cfg, as code other than the
// middleware does (backend.Scheduler, from Watermill's delay metadata).
func (r *rig) schedule(cfg amqpretry.Config, queue string, msg *message.Message, d time.Duration) {
	r.t.Helper()
	b, err := derived.Of(cfg).Open(backend.Env{Handoff: r.h})
	if err != nil {
		r.t.Fatal(err)
	}
	wdelay.Message(msg, wdelay.For(d))
	if err := (backend.Scheduler{Backend: b}).Publish(queue, msg); err != nil {
		r.t.Fatal(err)
	}
}

// TestParkingRedrive: retries whose work queue was deleted are parked, one with the
// middleware's envelope, one scheduled by other code (no envelope: its routing key
// names the queue); once the queue is re-created, parking redrive sends both there. On
// both backends with a parking queue; binary-levels spells the delay in its routing
// key before the queue.
func TestParkingRedrive(t *testing.T) {
	for _, cfg := range []amqpretry.Config{
		{Backend: delay.TTLTiers(testTiers...)},
		{Backend: delay.BinaryLevels(2), Policy: amqpretry.Policy{Delays: []time.Duration{time.Second}, Jitter: -1}},
	} {
		t.Run(cfg.WithDefaults().Backend.Name(), func(t *testing.T) {
			r := newRigWith(t, cfg, "orders")
			cfg.Prefix = r.prefix
			r.apply()
			queue := r.queues[0]
			ch, err := brokertest.Dial(t).Channel()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
				t.Fatal(err)
			}
			withEnvelope := message.NewMessage("parked-1", []byte("retry"))
			middleware.Envelope{Queue: queue, Attempt: 2, Due: time.Now().Add(time.Second), EffectiveDelay: time.Second}.Write(withEnvelope.Metadata)
			r.schedule(cfg, queue, withEnvelope, time.Second)
			r.schedule(cfg, queue, message.NewMessage("parked-2", []byte("scheduled")), time.Second)
			parking := r.prefix + ".parking"
			waitFor(t, 30*time.Second, func() bool { return brokertest.QueueLength(t, parking) == 2 })

			s, err := r.ops.Status(context.Background(), ops.StatusOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Contains(s.Flags, ops.Flag{Kind: ops.FlagParkingQueue, Name: parking, Role: "parking", Count: 2}) {
				t.Errorf("status does not flag the parked retries: %+v", s.Flags)
			}
			parked, err := r.ops.List(context.Background(), ops.Parking, ops.ListOptions{})
			if err != nil || len(parked.Messages) != 2 {
				t.Fatalf("parking list: %v %+v", err, parked)
			}
			for _, m := range parked.Messages {
				if m.Queue != queue {
					t.Errorf("parked %s: queue %q, want %q (routing key %q)", m.UUID, m.Queue, queue, m.RoutingKey)
				}
			}
			if parked.Messages[0].Attempt != 2 || parked.Messages[1].Attempt != 0 {
				t.Errorf("attempts: %d, %d", parked.Messages[0].Attempt, parked.Messages[1].Attempt)
			}

			// Redrive before the queue exists: they stay parked.
			res, err := r.ops.Redrive(context.Background(), ops.Parking, ops.MoveOptions{})
			if err != nil || res.Unroutable != 2 || res.Done != 0 {
				t.Fatalf("redrive to a missing queue: %v %+v", err, res)
			}
			if n := brokertest.QueueLength(t, parking); n != 2 {
				t.Fatalf("parking has %d after an unroutable redrive, want 2", n)
			}

			r.apply() // re-creates the work queue and its binding
			res, err = r.ops.Redrive(context.Background(), ops.Parking, ops.MoveOptions{})
			if err != nil || res.Done != 2 {
				t.Fatalf("parking redrive: %v %+v", err, res)
			}
			got := brokertest.Drain(t, queue)
			if len(got) != 2 || got[0].UUID != "parked-1" || got[0].Metadata.Get(keys.Attempt) != "2" || got[1].UUID != "parked-2" {
				t.Fatalf("work queue got %v", got)
			}
			for _, msg := range got {
				if _, ok := msg.Metadata[keys.Tier]; ok {
					t.Errorf("%s: the redriven copy kept the tier header", msg.UUID)
				}
			}
			if n := brokertest.QueueLength(t, parking); n != 0 {
				t.Errorf("parking has %d after the redrive", n)
			}
		})
	}
}

// ctlCounts reads the broker's counts with rabbitmqctl, as the command does.
func ctlCounts(t *testing.T) func(ctx context.Context) (ops.BrokerCounts, error) {
	t.Helper()
	if _, err := exec.LookPath(brokertest.CtlCommand()[0]); err != nil {
		if brokertest.CI() {
			t.Fatalf("needs %s: %v", brokertest.CtlCommand()[0], err)
		}
		t.Skipf("needs %s: %v", brokertest.CtlCommand()[0], err)
	}
	if out, err := brokertest.Ctl(context.Background(), "-q", "list_queues", "name"); err != nil {
		if brokertest.CI() {
			t.Fatalf("rabbitmqctl does not reach the broker: %v\n%s", err, out)
		}
		t.Skipf("rabbitmqctl does not reach the broker: %v\n%s", err, out)
	}
	return func(ctx context.Context) (ops.BrokerCounts, error) {
		out, err := brokertest.Ctl(ctx, "-q", "list_queues", "name", "messages", "messages_ready", "messages_unacknowledged", "--no-table-headers")
		if err != nil {
			return ops.BrokerCounts{}, err
		}
		c := ops.BrokerCounts{Messages: map[string]int{}, Ready: map[string]int{}, Unacked: map[string]int{}}
		for _, line := range strings.Split(string(out), "\n") {
			f := strings.Split(strings.TrimSpace(line), "\t")
			if len(f) != 4 {
				continue
			}
			c.Messages[f[0]], _ = strconv.Atoi(f[1])
			c.Ready[f[0]], _ = strconv.Atoi(f[2])
			c.Unacked[f[0]], _ = strconv.Atoi(f[3])
		}
		return c, nil
	}
}

// TestStatusStuck: a delay queue whose dead letters are refused by their destination
// (a full work queue with x-overflow reject-publish, under at-least-once dead
// lettering) keeps them past their due time: stuck. Those expired messages leave the
// ready list (AMQP sees an empty queue), so the check needs the broker's own counts.
func TestStatusStuck(t *testing.T) {
	t.Parallel()
	skipShort(t)
	counts := ctlCounts(t)
	r := newRig(t, "full")
	queue := r.queues[0]
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-max-length": int64(0), declare.OverflowArg: declare.OverflowRejectPublish}); err != nil {
		t.Fatal(err)
	}
	r.apply()
	r.schedule(r.cfg.Retry, queue, message.NewMessage("stuck-1", []byte("x")), time.Second)
	tier := r.prefix + ".delay.1s"
	var s ops.Status
	waitFor(t, 30*time.Second, func() bool {
		s, err = r.ops.Status(context.Background(), ops.StatusOptions{StuckMargin: time.Second, Peek: "always", Counts: counts, SampleInterval: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		return slices.ContainsFunc(s.Queues, func(q ops.QueueStatus) bool { return q.Name == tier && q.Stuck })
	})
	if !slices.ContainsFunc(s.Flags, func(f ops.Flag) bool {
		return f.Kind == ops.FlagStuck && f.Name == tier && f.Count == 1 && f.Interval == time.Second
	}) {
		t.Errorf("flags: %+v", s.Flags)
	}
	for _, q := range s.Queues {
		if q.Name == tier && (!q.Counted || q.Expired != 1 || q.Ready != 0) {
			t.Errorf("stuck queue status: %+v", q)
		}
	}
	// Empty the stuck queue so that cleanup is quick.
	_, _ = ch.QueuePurge(tier, false)
}

func TestStatusHealthy(t *testing.T) {
	r := newRig(t, "orders")
	r.apply()
	r.poison(poisoned{uuid: "old", queue: "q", reason: amqpretry.ReasonPermanent, err: "e", attempt: 1, lastFailure: time.Now().Add(-time.Hour)})
	s, err := r.ops.Status(context.Background(), ops.StatusOptions{WorkQueues: r.queues})
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Flags) != 0 {
		t.Errorf("flags on a healthy topology: %+v", s.Flags)
	}
	if s.Broker == "" || s.Backend != (delay.TTLTiers()).Name() || s.Prefix != r.prefix || s.Counted {
		t.Errorf("status: %+v", s)
	}
	var roles []string
	for _, q := range s.Queues {
		roles = append(roles, q.Role)
	}
	if !slices.Equal(roles, []string{"delay", "delay", "parking", "poison", "work"}) {
		t.Errorf("roles %v", roles)
	}
	poison := s.Queues[3]
	if poison.Ready != 1 || !poison.Peeked || !poison.AgeKnown || poison.OldestAge < time.Hour {
		t.Errorf("poison queue status: %+v", poison)
	}
	if n := brokertest.QueueLength(t, r.poisonQueue()); n != 1 {
		t.Errorf("the peek changed the poison queue: %d messages", n)
	}
	s, err = r.ops.Status(context.Background(), ops.StatusOptions{Peek: "never"})
	if err != nil || s.Queues[3].Peeked {
		t.Errorf("peek never: %v %+v", err, s.Queues)
	}
	if _, err := r.ops.Status(context.Background(), ops.StatusOptions{Peek: "sometimes"}); err == nil {
		t.Error("unknown peek mode accepted")
	}
}

// TestStatusMissing: on a fresh prefix every queue is missing, each flagged once.
func TestStatusMissing(t *testing.T) {
	r := newRig(t, "orders")
	s, err := r.ops.Status(context.Background(), ops.StatusOptions{WorkQueues: r.queues})
	if err != nil {
		t.Fatal(err)
	}
	var flagged []string
	for _, f := range s.Flags {
		flagged = append(flagged, string(f.Kind)+" "+f.Role+" "+f.Name)
	}
	want := []string{"missing delay " + r.prefix + ".delay.1s", "missing delay " + r.prefix + ".delay.2s", "missing parking " + r.prefix + ".parking",
		"missing poison " + r.prefix + ".poison", "missing work " + r.queues[0]}
	if !slices.Equal(flagged, want) {
		t.Errorf("flags %v, want %v", flagged, want)
	}
	if _, err := r.ops.List(context.Background(), ops.Poison, ops.ListOptions{}); err == nil || !strings.Contains(err.Error(), r.poisonQueue()) {
		t.Errorf("list of a missing queue: %v", err)
	}
}

// TestStatusNearLimit: the broker's file descriptors and sockets past 80% of their
// limits are flagged, with the numbers; the counts come from the broker, the limits
// from a Counts that wraps it.
func TestStatusNearLimit(t *testing.T) {
	r := newRig(t)
	r.apply()
	s, err := r.ops.Status(context.Background(), ops.StatusOptions{Counts: func(context.Context) (ops.BrokerCounts, error) {
		return ops.BrokerCounts{FileDescriptors: 900, FileDescriptorLimit: 1000, Sockets: 10, SocketLimit: 800}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(s.Flags, []ops.Flag{{Kind: ops.FlagNearLimit, Name: "file_descriptors", Count: 900, Limit: 1000}}) || !s.Counted || s.SocketLimit != 800 {
		t.Errorf("status: %+v", s)
	}
	s, err = r.ops.Status(context.Background(), ops.StatusOptions{Counts: func(context.Context) (ops.BrokerCounts, error) {
		return ops.BrokerCounts{}, errors.New("rabbitmqctl: no answer")
	}})
	if err != nil || s.Counted || s.CountsError != "rabbitmqctl: no answer" {
		t.Errorf("failing counts: %v %+v", err, s)
	}
}

// TestUnderReplicated (issue 20): a quorum queue with fewer members online than it has
// is flagged by Status and reported by Verify; one with all its members online is not.
// The members come from a Counts of the test's own (three members, one of the poison
// queue's down); the command's TestStatusCounts reads real ones through rabbitmqctl, and
// the cluster no-loss test with a node down.
func TestUnderReplicated(t *testing.T) {
	r := newRig(t)
	r.apply()
	plan, err := r.cfg.Retry.Plan(r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	poison := r.prefix + ".poison"
	for _, down := range []int{0, 1} {
		counts := func(context.Context) (ops.BrokerCounts, error) {
			c := ops.BrokerCounts{Members: map[string]int{}, Online: map[string]int{}}
			for _, q := range plan.Queues {
				c.Members[q.Name], c.Online[q.Name] = 3, 3
			}
			c.Online[poison] -= down
			return c, nil
		}
		s, err := r.ops.Status(context.Background(), ops.StatusOptions{Counts: counts})
		if err != nil {
			t.Fatal(err)
		}
		var flagged []ops.Flag
		for _, f := range s.Flags {
			if f.Kind == ops.FlagUnderReplicated {
				flagged = append(flagged, f)
			}
		}
		want := []ops.Flag{{Kind: ops.FlagUnderReplicated, Name: poison, Role: "poison", Count: 2, Limit: 3}}
		if down == 0 {
			want = nil
		}
		if !slices.Equal(flagged, want) {
			t.Errorf("%d member down: flags %+v, want %+v", down, flagged, want)
		}
		findings, err := r.ops.Verify(context.Background(), ops.VerifyOptions{Counts: counts}, r.queues...)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range findings {
			if f.Kind != "queue" {
				continue
			}
			online := 3
			if f.Name == poison {
				online -= down
			}
			if f.Members != 3 || f.Online != online {
				t.Errorf("%d member down: verify of %s reports %d of %d members online, want %d of 3", down, f.Name, f.Online, f.Members, online)
			}
		}
	}
}

// TestStatusDelayedExchange: the plugin is known only from the backend's own
// exchange; a broker that cannot run it (4.3+) is flagged so.
func TestStatusDelayedExchange(t *testing.T) {
	r := newRigWith(t, amqpretry.Config{Backend: delay.DelayedExchange()})
	s, err := r.ops.Status(context.Background(), ops.StatusOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := ops.Flag{Kind: ops.FlagMissing, Name: r.prefix + ".delayed", Role: "exchange"}
	if version.NoPlugins(s.Broker) {
		want = ops.Flag{Kind: ops.FlagMissing, Name: "rabbitmq_delayed_message_exchange", Role: "plugin"}
	}
	if s.DelayedExchange || !slices.Contains(s.Flags, want) {
		t.Errorf("status on RabbitMQ %s: %+v, want flag %+v", s.Broker, s, want)
	}
	for _, q := range s.Queues {
		if q.Role == "parking" || q.Role == "delay" {
			t.Errorf("delayed-exchange has no %s queue: %+v", q.Role, q)
		}
	}
	if _, err := r.ops.List(context.Background(), ops.Parking, ops.ListOptions{}); err == nil {
		t.Error("parking list on delayed-exchange")
	}
}

// TestStatusHeldRetries (RabbitMQ 4.3+): retries a work queue holds in delayed retry
// count in the broker's messages but in neither ready nor unacked (a passive declare
// shows 0): status reports them held, and does not call the queue stuck.
func TestStatusHeldRetries(t *testing.T) {
	r := newRigWith(t, amqpretry.Config{Backend: delay.DelayedRetry(20 * time.Second)}, "orders")
	s, err := r.ops.Status(context.Background(), ops.StatusOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !version.DelayedRetry(s.Broker) {
		t.Skipf("RabbitMQ %s has no delayed retry (4.3+)", s.Broker)
	}
	counts := ctlCounts(t)
	queue := r.queues[0]
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := r.ops.Apply(context.Background(), r.queues...); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := ch.Publish("", queue, false, false, amqp.Publishing{Body: []byte(strconv.Itoa(i))}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, func() bool { return brokertest.QueueLength(t, queue) == 3 })
	for range 3 { // fail each once: returned, the broker holds it 20 s
		d, ok, err := ch.Get(queue, false)
		if err != nil || !ok {
			t.Fatalf("get: %v %v", ok, err)
		}
		if err := d.Nack(false, true); err != nil {
			t.Fatal(err)
		}
	}
	var q ops.QueueStatus
	waitFor(t, 10*time.Second, func() bool {
		s, err = r.ops.Status(context.Background(), ops.StatusOptions{WorkQueues: r.queues, Counts: counts, SampleInterval: 500 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		q = s.Queues[len(s.Queues)-1]
		return q.Held == 3
	})
	if q.Name != queue || q.Role != "work" || q.Ready != 0 || q.Messages != 3 || q.Unacked != 0 || q.Stuck || len(s.Flags) != 0 {
		t.Errorf("work queue holding 3 retries: %+v, flags %+v", q, s.Flags)
	}
	_, _ = ch.QueuePurge(queue, false)
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

// TestPasswordNeverInErrors: a malformed URI with a password, and one that dials and
// fails authentication: the password never appears in the error of New, the one entry
// point that dials.
func TestPasswordNeverInErrors(t *testing.T) {
	brokertest.Dial(t)
	u, err := url.Parse(brokertest.URI())
	if err != nil {
		t.Fatal(err)
	}
	const secret = "s3cret"
	u.User = url.UserPassword("guest", secret)
	for _, uri := range []string{"amqp://user:" + secret + "@host:badport/", "amqp//user:" + secret + "@host/", u.String()} {
		_, err := ops.New(ops.Config{URI: uri})
		if err == nil || strings.Contains(err.Error(), secret) {
			t.Errorf("New(%s): %v", brokertest.Redact(uri), err)
		}
		if uri == u.String() && !errors.Is(err, amqp.ErrCredentials) && !strings.Contains(err.Error(), "ACCESS_REFUSED") {
			t.Errorf("auth failure not recognisable: %v", err)
		}
		t.Logf("%v", err)
	}
}

// TestApplyDelayedRetryBackend: Apply and Verify with the delayed-retry backend: the
// work queue is created a quorum queue with the delayed-retry arguments (the broker's
// version does not matter to Apply: on 3.10.8 the arguments are accepted and unused).
func TestApplyDelayedRetryBackend(t *testing.T) {
	r := newRigWith(t, amqpretry.Config{Backend: delay.DelayedRetry(0)}, "orders")
	created, err := r.ops.Apply(context.Background(), r.queues...)
	if err != nil || !slices.Equal(created, r.queues) {
		t.Fatalf("apply: %v %v", created, err)
	}
	findings, err := r.ops.Verify(context.Background(), ops.VerifyOptions{Bind: true}, r.queues...)
	if err != nil || len(problems(findings)) != 0 {
		t.Errorf("verify: %v %+v", err, findings)
	}
}

// TestPartialRunKeepsOrder: a run that stops early (a limit) gives back what it kept
// without reordering the queue, even for messages given back before (RabbitMQ puts a
// message it requeued before behind those still in the queue, measured on 3.10.8 and
// 4.3.6); and a run right after another sees every message (the broker requeues
// asynchronously).
func TestPartialRunKeepsOrder(t *testing.T) {
	r := newRig(t, "orders")
	r.apply()
	for i := range 6 {
		r.poison(poisoned{uuid: fmt.Sprintf("m%d", i), queue: r.queues[0], reason: amqpretry.ReasonPermanent, err: "e", attempt: 1})
	}
	ctx := context.Background()
	want := []string{"m0", "m1", "m2", "m3", "m4", "m5"}
	for round := range 3 {
		if got := r.list(ops.Poison); !slices.Equal(got, want) {
			t.Fatalf("round %d: queue has %v, want %v", round, got, want)
		}
		res, err := r.ops.List(ctx, ops.Poison, ops.ListOptions{Filter: ops.Filter{IDs: []string{"m1"}}, Limit: 1})
		if err != nil || len(res.Messages) != 1 || res.Scanned != 2 || res.Depth != 6 {
			t.Fatalf("round %d: show m1: %v %+v", round, err, res)
		}
	}
	res, err := r.ops.Redrive(ctx, ops.Poison, ops.MoveOptions{Limit: 1, Filter: ops.Filter{IDs: []string{"m2"}}})
	if err != nil || res.Done != 1 || res.Stopped != "limit" {
		t.Fatalf("redrive m2: %v %+v", err, res)
	}
	if got := r.list(ops.Poison); !slices.Equal(got, []string{"m0", "m1", "m3", "m4", "m5"}) {
		t.Errorf("after a redrive stopped at its limit: %v", got)
	}
}

// TestStatusKeepsOrder: Status reads every message of the poison queue to find the
// oldest, and gives all of them back at once: a quorum queue would put a head given
// back alone behind the others (RabbitMQ 3.10.8 at every return, 4.3.6 from the
// second). It reads no delay queue unless told to ("always"): a delay queue's head
// moved to the end would expire late.
func TestStatusKeepsOrder(t *testing.T) {
	r := newRig(t, "orders")
	r.apply()
	old := time.Now().Add(-time.Hour)
	for i := range 3 {
		at := time.Now()
		if i == 1 {
			at = old // the oldest is not the head
		}
		r.poison(poisoned{uuid: fmt.Sprintf("m%d", i), queue: r.queues[0], reason: amqpretry.ReasonPermanent, err: "e", attempt: 1, lastFailure: at})
	}
	r.schedule(r.cfg.Retry, r.queues[0], message.NewMessage("d1", nil), 2*time.Second)
	for range 3 {
		s, err := r.ops.Status(context.Background(), ops.StatusOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range s.Queues {
			switch {
			case q.Role == "poison" && (!q.Peeked || !q.AgeKnown || q.OldestAge < time.Hour || q.Ready != 3):
				t.Errorf("poison queue: %+v", q)
			case q.Role == "delay" && q.Peeked:
				t.Errorf("delay queue read without Peek always: %+v", q)
			}
		}
	}
	if got := r.list(ops.Poison); !slices.Equal(got, []string{"m0", "m1", "m2"}) {
		t.Errorf("poison queue after three status calls: %v", got)
	}
}

// skipShort skips a test that waits on the broker for seconds in the quick loop
// (go test -short); the test script runs it.
func skipShort(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("waits on the broker for seconds: not in -short")
	}
}
