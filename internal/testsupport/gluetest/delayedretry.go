package gluetest

// Tests of retries RabbitMQ 4.3 holds in the work queue itself (delayed retry of
// quorum queues): the delayed-retry backend, and its first stage in front of a copying
// backend (delay.HeldRetries).

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
)

// quorum is a work queue RabbitMQ 4.3 can hold retries in.
var quorum = amqp.Table{"x-queue-type": "quorum"}

// quorumToPoison is quorum with the test's poison queue as the dead-letter target, as
// docs/troubleshooting.md has work queues declared: past the delivery limit, a
// message goes there instead of being dropped.
func quorumToPoison(s setup) amqp.Table {
	return amqp.Table{"x-queue-type": "quorum", "x-dead-letter-exchange": "", "x-dead-letter-routing-key": s.prefix + ".poison"}
}

// reconnectBound bounds how long after a broker outage of the given length
// watermill-amqp's subscriber takes to reconnect, with its default ReconnectConfig (the
// library's subscriber configs keep it): attempts 500 ms apart, the interval growing
// 1.5 times per attempt up to 60 s, each randomized by 50%. After an outage of d the
// next interval is at most 1.5 d + 0.75 s, and never more than 90 s.
func reconnectBound(d time.Duration) time.Duration {
	return min(d*3/2+750*time.Millisecond, 90*time.Second)
}

// need43 skips t on a broker older than RabbitMQ 4.3.
func need43(t *testing.T) {
	t.Helper()
	if v := brokerVersion(t); !version.DelayedRetry(v) {
		t.Skipf("RabbitMQ %s has no delayed retry (4.3+); DelayedRetryRefusedBefore43 covers it", v)
	}
}

// events records what Config.Observe is told.
type events struct {
	mu  sync.Mutex
	all []amqpretry.Event
}

func (e *events) observe(ev amqpretry.Event) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.all = append(e.all, ev)
}

func (e *events) of(kind amqpretry.EventKind) []amqpretry.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []amqpretry.Event
	for _, ev := range e.all {
		if ev.Kind == kind {
			out = append(out, ev)
		}
	}
	return out
}

// DelayedRetry: the delayed-retry backend on RabbitMQ 4.3. Every retry waits the work
// queue's delay in the queue itself, the attempt counts up from the broker's own
// count, the last attempt and a permanent error are poisoned, and nothing is declared
// but the poison queue (no delay queue, no exchange).
func DelayedRetry(t *testing.T, m Major) {
	need43(t)
	s := newSetup(t, m, delay.DelayedRetry(0))
	const held = 400 * time.Millisecond
	s.sub.QueueArgs = quorum
	s.cfg.Backend = delay.DelayedRetry(held)
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3}
	obs := &events{}
	s.cfg.Observe = obs.observe
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		switch msg.UUID {
		case "perm":
			return amqpretry.Permanent(errors.New("malformed"))
		case "doomed":
			return errFlaky
		}
		return failFirst(2)(msg)
	})
	run(t, m, r, s.topic, rec.handle, rec.settle)
	for _, id := range []string{"ok", "doomed", "perm"} {
		publish(t, m, s.topic, id)
	}
	rec.waitSettled(t, 3+3+1, 30*time.Second)
	wantStats(t, r, 4, 2)
	got := attemptsByUUID(rec.snapshot())
	for id, want := range map[string][]int{"ok": {1, 2, 3}, "doomed": {1, 2, 3}, "perm": {1}} {
		if !slices.Equal(got[id], want) {
			t.Errorf("%s handled on attempts %v, want %v", id, got[id], want)
		}
	}
	const precision = 500 * time.Millisecond
	var prev time.Time
	for _, c := range rec.snapshot() {
		if c.msg.UUID != "ok" {
			continue
		}
		if !prev.IsZero() {
			if gap := c.at.Sub(prev); gap < held-20*time.Millisecond || gap > held+precision {
				t.Errorf("retry of ok came %s after its failure, want %s (+ up to %s)", gap, held, precision)
			}
		}
		prev = c.at
	}
	reasons := map[string]amqpretry.Reason{}
	for range 2 {
		msg := poisoned(t, s.prefix+".poison", 10*time.Second)
		env := middleware.ReadEnvelope(msg.Metadata)
		reasons[msg.UUID] = env.Reason
		if msg.UUID == "doomed" && !env.FirstFailure.Before(env.LastFailure.Add(-held/2)) {
			// Held retries come back without their envelope: the first failure is
			// the process's memory of it.
			t.Errorf("doomed: first failure %s, last %s: the first failure was lost on the way", env.FirstFailure, env.LastFailure)
		}
	}
	if reasons["doomed"] != amqpretry.ReasonMaxAttempts || reasons["perm"] != amqpretry.ReasonPermanent {
		t.Errorf("poisoned %v, want doomed for max-attempts and perm for permanent", reasons)
	}
	for _, ev := range obs.of(amqpretry.EventRetryScheduled) {
		if ev.Backend != (delay.DelayedRetry(0)).Name() || ev.Effective != held {
			t.Errorf("retry event %+v, want backend delayed-retry, effective %s", ev, held)
		}
	}
	late := 0
	for _, ev := range obs.of(amqpretry.EventDelivered) {
		if ev.Late {
			late++
			if ev.Lateness < -20*time.Millisecond || ev.Lateness > precision {
				t.Errorf("held retry late by %s", ev.Lateness)
			}
		}
	}
	if late != 4 {
		t.Errorf("%d held retries came back with a lateness, want 4", late)
	}
	// Nothing but the poison queue was declared for the retries.
	conn := brokertest.Dial(t)
	for _, name := range []string{s.prefix + ".parking", s.prefix + ".deliver", s.prefix + ".delay"} {
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if err := ch.ExchangeDeclarePassive(name, "fanout", true, false, false, false, nil); err == nil {
			t.Errorf("exchange %s was declared", name)
		}
	}
}

// HeldRetriesThenCopies: the first delay.HeldRetries retries wait in the work queue
// (no copy; the envelope the process kept is in the metadata when they come back, as
// on a copy), the later ones go through ttl-tiers with the policy's schedule started
// again from its first delay; a RetryAfter skips the first stage, to the copying
// backend at once.
func HeldRetriesThenCopies(t *testing.T, m Major) {
	need43(t)
	s := newSetup(t, m, delay.TTLTiers())
	const held = 300 * time.Millisecond
	s.sub.QueueArgs = quorum
	s.cfg.Backend = delay.HeldRetries(2, held, s.cfg.Backend)
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{500 * time.Millisecond, 2 * time.Second}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "throttled" {
			if amqpretry.Attempt(msg) == 1 {
				return amqpretry.RetryAfter(errors.New("429"), 2*time.Second)
			}
			return nil
		}
		return failFirst(3)(msg)
	})
	run(t, m, r, s.topic, rec.handle, rec.settle)
	publish(t, m, s.topic, "m1")
	publish(t, m, s.topic, "throttled")
	rec.waitSettled(t, 4+2, 30*time.Second)
	wantStats(t, r, 4, 0)

	var m1 []delivery
	for _, c := range rec.snapshot() {
		if c.msg.UUID == "m1" {
			m1 = append(m1, c)
		}
	}
	if len(m1) != 4 {
		t.Fatalf("m1 handled %d times, want 4", len(m1))
	}
	for i, c := range m1 {
		env := middleware.ReadEnvelope(c.msg.Metadata)
		if got := amqpretry.Attempt(c.msg); got != i+1 {
			t.Errorf("call %d saw attempt %d", i+1, got)
		}
		switch i {
		case 1, 2: // held: the envelope comes from the process's memory
			if env.Attempt != i+1 || env.EffectiveDelay != held || env.Due.IsZero() || env.Error != errFlaky.Error() || env.FirstFailure.IsZero() {
				t.Errorf("held retry %d: envelope %+v, want attempt %d, effective %s, a due time, the error and the first failure", i, env, i+1, held)
			}
			if late := c.at.Sub(env.Due); late < -20*time.Millisecond {
				t.Errorf("held retry %d came %s before its due time", i, -late)
			}
			if gap := c.at.Sub(m1[i-1].at); gap < held-20*time.Millisecond || gap > held+500*time.Millisecond {
				t.Errorf("held retry %d came %s after its failure, want %s", i, gap, held)
			}
		case 3: // the first copy: the schedule's first delay, on the 500ms tier
			// The schedule starts again after the held retries: its first delay.
			if env.RequestedDelay != 500*time.Millisecond || env.EffectiveDelay != 500*time.Millisecond || env.Attempt != 4 {
				t.Errorf("copied retry envelope %+v, want requested and effective 500ms (the schedule's first delay), attempt 4", env)
			}
		}
	}
	for _, c := range rec.snapshot() {
		if c.msg.UUID == "throttled" && amqpretry.Attempt(c.msg) == 2 {
			if env := middleware.ReadEnvelope(c.msg.Metadata); env.RequestedDelay != 2*time.Second {
				t.Errorf("RetryAfter in the first stage: envelope %+v, want a 2s copy", env)
			}
		}
	}
}

// DelayedRetryOnAQueueWithoutItFallsBackLoudly: a quorum work queue that exists without
// the delayed-retry arguments. In declare mode, subscribing fails with the fix (a
// policy, or re-creating the queue). Where nothing is declared (topology mode none),
// every nack comes back at once: the first early return is held again (it may be a nack
// lost with its connection), the second in a row is logged at ERROR, and the retries go
// to the copying backend instead of looping at wire speed; with the delayed-retry
// backend alone the message is poisoned, saying why.
func DelayedRetryOnAQueueWithoutItFallsBackLoudly(t *testing.T, m Major) {
	need43(t)
	s := newSetup(t, m, delay.TTLTiers())
	s.sub.QueueArgs = quorum
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(s.topic, true, false, false, false, quorum); err != nil {
		t.Fatal(err)
	}
	s.cfg.Backend = delay.HeldRetries(2, 2*time.Second, s.cfg.Backend)
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 4, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}

	t.Run("declare", func(t *testing.T) {
		r := newRetry(t, m, s.sub, s.cfg)
		_, err := m.Subscriber(t, r).Subscribe(context.Background(), s.topic)
		if err == nil || !strings.Contains(err.Error(), "x-delayed-retry") || !strings.Contains(err.Error(), "set_policy") {
			t.Fatalf("Subscribe = %v, want the argument clash with the policy fix", err)
		}
	})
	// ttl-tiers with newSetup's tiers behind the held retries; delayed-retry holding
	// for the held retries' delay.
	held := delay.DelayedRetry(2 * time.Second)
	for _, name := range []delay.Backend{s.cfg.Backend, held} {
		t.Run("none/"+name.Name(), func(t *testing.T) {
			cfg := s.cfg
			cfg.Backend, cfg.Topology = name, topology.ModeNone
			logs := &logCapture{}
			cfg.Logger = logs
			if name == held {
				cfg.Policy = amqpretry.Policy{MaxAttempts: 4}
			}
			// The administrator's topology, but the work queue as it is.
			plan, err := cfg.Plan(s.topic)
			if err != nil {
				t.Fatal(err)
			}
			plan.Queues = slices.DeleteFunc(plan.Queues, func(q topology.Queue) bool { return q.Name == s.topic })
			apply(t, plan)
			r := newRetry(t, m, s.sub, cfg)
			rec := newRecorder(failFirst(3))
			run(t, m, r, s.topic, rec.handle)
			publish(t, m, s.topic, "m-"+name.Name())
			if name == held {
				msg := poisoned(t, s.prefix+".poison", 30*time.Second)
				if env := middleware.ReadEnvelope(msg.Metadata); env.Reason != amqpretry.ReasonHandoffFailed || !strings.Contains(env.Error, "does not hold delayed retries") {
					t.Errorf("poisoned with %+v, want handoff-failed saying the queue does not hold delayed retries", env)
				}
			} else {
				calls := rec.waitCalls(t, 4, 30*time.Second)
				if env := middleware.ReadEnvelope(calls[3].msg.Metadata); env.EffectiveDelay != 500*time.Millisecond {
					t.Errorf("the retry after the fast return went to %+v, want a 500ms copy", env)
				}
			}
			if !hasLine(logs, watermill.ErrorLogLevel, "does not hold delayed retries", "x-delayed-retry") {
				t.Errorf("no ERROR line about the queue; errors: %+v", logs.at(watermill.ErrorLogLevel))
			}
		})
	}
}

// DelayedRetryRefusedBefore43: before RabbitMQ 4.3 a quorum queue ignores the
// delayed-retry arguments, so every nack would come back at once: New refuses, naming
// the version it needs. On 4.3 and later, the delayed-message plugin cannot run: the
// delayed-exchange backend is refused with a message that says so.
func DelayedRetryRefusedBefore43(t *testing.T, m Major) {
	brokertest.Dial(t)
	v := brokerVersion(t)
	prefix := brokertest.Prefix(t)
	brokertest.Cleanup(t, []string{prefix + ".poison", prefix + ".parking"}, []string{prefix + ".parking", prefix + ".deliver", prefix + ".delay"})
	sub := Sub{URI: brokertest.URI(), QueueArgs: quorum}
	if !version.DelayedRetry(v) {
		for _, cfg := range []amqpretry.Config{
			{Prefix: prefix, Backend: delay.DelayedRetry(0)},
			{Prefix: prefix, Backend: delay.HeldRetries(2, 0, delay.TTLTiers(time.Second))},
		} {
			_, err := m.New(sub, cfg)
			if !errors.Is(err, delay.ErrUnsupported) || !strings.Contains(err.Error(), "4.3") || !strings.Contains(err.Error(), v) {
				t.Errorf("New(%s) on %s = %v, want ErrUnsupported naming 4.3", cfg.Backend, v, err)
			}
		}
		// Refused before anything was declared.
		ch, err := brokertest.Dial(t).Channel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDeclarePassive(prefix+".poison", true, false, false, false, nil); err == nil {
			t.Errorf("the poison queue was declared by a Retry the broker cannot run")
		}
		return
	}
	_, err := m.New(sub, amqpretry.Config{Prefix: prefix, Backend: delay.DelayedExchange()})
	if !errors.Is(err, delay.ErrPluginMissing) || !strings.Contains(err.Error(), "cannot run") || !strings.Contains(err.Error(), delay.BinaryLevels(0).Name()) {
		t.Errorf("delayed-exchange on %s: %v, want ErrPluginMissing saying the plugin cannot run and naming what to use", v, err)
	}
}

// DelayedRetryWaitsThroughFaults: retries held in the work queue survive their
// consumer's connection being closed and the broker's application being restarted: they
// come back after their delay, the attempt counting on, and nothing is lost or
// poisoned early. (The no-loss test adds a consumer SIGKILL, with thousands of
// messages.) Both faults make watermill-amqp reconnect, which races with itself: it
// runs without the race detector (scripts/test.sh runs it so on RabbitMQ 4.3).
func DelayedRetryWaitsThroughFaults(t *testing.T, m Major) {
	if raceEnabled {
		t.Skip("watermill-amqp's reconnection has data races of its own (ConnectionWrapper, v2.1.3 and v3.0.1): run without -race")
	}
	brokertest.RequireRestart(t)
	need43(t)
	for _, fault := range [][]string{{"close_all_connections", "test"}, {"stop_app"}} {
		t.Run(fault[0], func(t *testing.T) {
			s := newSetup(t, m, delay.DelayedRetry(0))
			s.sub.QueueArgs = quorum
			s.cfg.Backend = delay.DelayedRetry(5 * time.Second)
			s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3}
			r := newRetry(t, m, s.sub, s.cfg)
			rec := newRecorder(failFirst(1))
			run(t, m, r, s.topic, rec.handle, rec.settle)
			const n = 20
			for i := range n {
				publish(t, m, s.topic, "m"+strings.Repeat("x", i))
			}
			rec.waitSettled(t, n, 30*time.Second) // every first attempt failed: all held
			ctx := context.Background()
			faulted := time.Now()
			var outage time.Duration // how long the subscriber could not reconnect
			if fault[0] == "stop_app" {
				var err error
				if outage, err = brokertest.RestartApp(ctx); err != nil {
					t.Fatal(err)
				}
			} else if out, err := brokertest.Ctl(ctx, fault...); err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			// The held retries come due their delay (5s) after their failure, and are
			// delivered once the subscriber is back: bound both, with a margin for a
			// loaded machine.
			bound := 5*time.Second + reconnectBound(outage) + 30*time.Second
			calls := rec.waitCalls(t, 2*n, bound)
			t.Logf("%s: broker out %s; all %d retries handled %s after the fault (bound %s)", fault[0],
				outage.Round(time.Millisecond), n, time.Since(faulted).Round(time.Millisecond), bound.Round(time.Millisecond))
			got := attemptsByUUID(calls)
			if len(got) != n {
				t.Errorf("%d distinct messages handled, want %d", len(got), n)
			}
			for id, attempts := range got {
				if attempts[0] != 1 || attempts[len(attempts)-1] < 2 {
					t.Errorf("%s handled on attempts %v, want 1 then a retry", id, attempts)
				}
			}
			if st := r.Stats(); st.Poisoned != 0 {
				t.Errorf("%d poisoned across the fault", st.Poisoned)
			}
		})
	}
}

// CopyingBackendOnADelayedRetryQueueKeepsIt: moving off delayed-retry, a work queue
// declared with the delayed-retry arguments (which RabbitMQ 4.3 compares, and which
// cannot change) may still hold retries. A copying config that declares it without
// them fails to subscribe with the fix (keep the arguments, or topology mode verify),
// never telling to delete it; with the arguments kept in Queue.Arguments it subscribes,
// and a retry the queue held for the delayed-retry config comes back to it.
func CopyingBackendOnADelayedRetryQueueKeepsIt(t *testing.T, m Major) {
	need43(t)
	s := newSetup(t, m, delay.DelayedRetry(0))
	s.sub.QueueArgs = quorum
	s.cfg.Backend = delay.DelayedRetry(2 * time.Second)
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 4}
	old := newRetry(t, m, s.sub, s.cfg)
	oldRec := newRecorder(failFirst(1))
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, Logger())
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("old", s.topic, m.Subscriber(t, old), oldRec.handle).AddMiddleware(old.Middleware)
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	publish(t, m, s.topic, "held")
	oldRec.waitCalls(t, 1, 30*time.Second)
	if err := router.Close(); err != nil { // the retry waits in the work queue
		t.Fatal(err)
	}

	cfg := s.cfg
	cfg.Backend, cfg.Policy = delay.TTLTiers(500*time.Millisecond), amqpretry.Policy{MaxAttempts: 4, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
	_, err = m.Subscriber(t, newRetry(t, m, s.sub, cfg)).Subscribe(context.Background(), s.topic)
	if err == nil || !strings.Contains(err.Error(), "x-delayed-retry") || !strings.Contains(err.Error(), "Queue.Arguments") || strings.Contains(err.Error(), "delete it and") {
		t.Fatalf("Subscribe = %v, want the argument clash with the fix: keep the arguments", err)
	}
	// The work queue as the delayed-retry config declared it, every argument named
	// (RabbitMQ's refusal names one): its dead-letter target too.
	kept := s.sub
	kept.QueueArgs = workQueueArgs(t, s.cfg, s.topic)
	for k, v := range kept.QueueArgs {
		if !strings.Contains(err.Error(), fmt.Sprintf("%s: %s", k, declare.FormatValue(v))) {
			t.Errorf("Subscribe = %v, does not name %s %v", err, k, v)
		}
	}
	rec := newRecorder(failFirst(0))
	run(t, m, newRetry(t, m, kept, cfg), s.topic, rec.handle)
	if calls := rec.waitCalls(t, 1, 30*time.Second); calls[0].msg.UUID != "held" {
		t.Errorf("got %q, want the held retry", calls[0].msg.UUID)
	}
}

// workQueueArgs are the arguments cfg's subscribers declare work queue queue with (no
// Queue.Arguments of the user's), as its plan has them.
func workQueueArgs(t *testing.T, cfg amqpretry.Config, queue string) amqp.Table {
	t.Helper()
	plan, err := cfg.Plan(queue)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range plan.Queues {
		if q.Name == queue {
			return q.Args
		}
	}
	t.Fatalf("the plan of %s declares no work queue %s", cfg.Backend, queue)
	return nil
}
