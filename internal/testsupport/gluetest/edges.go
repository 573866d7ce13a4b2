package gluetest

// Tests of the edges a new user hit (issue 25): a poison queue that is gone, Close
// before the router, a Retry never closed, no log line with a nil error.

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/topology"
)

// noNilErr fails for every ERROR line logged without an error: watermill's loggers
// print it as err=<nil>.
func noNilErr(t *testing.T, logs *logCapture) {
	t.Helper()
	for _, l := range logs.at(watermill.ErrorLogLevel) {
		if l.Err == nil {
			t.Errorf("ERROR line without an error (err=<nil>): %q %v", l.Msg, l.Fields)
		}
	}
}

// waitFor polls cond until it is true, failing after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", timeout, what)
		}
	}
}

// PoisonQueueGoneNeverRerunsTheHandler: the poison queue is deleted while the router
// runs. In topology mode verify nothing declares it again: the message that failed
// for good runs through the handler once, then only its poison publish is retried,
// paced, while it waits in its work queue (nacked, nothing lost) and a canary behind it
// is handled. The ERROR names the queue and the command that creates it, Stats and an
// event flag it, and so does ops' Status. Once the queue is back, the message is
// poisoned without running the handler again. In declare mode the queue is declared
// again at the first poisoning.
func PoisonQueueGoneNeverRerunsTheHandler(t *testing.T, m Major) {
	for _, tc := range []struct {
		mode    topology.Mode
		backend delay.Backend
	}{
		{topology.ModeVerify, delay.TTLTiers()},
		{topology.ModeDeclare, delay.TTLTiers()},
		// Held in place: set aside in the work queue itself (RabbitMQ 4.3).
		{topology.ModeNone, delay.DelayedRetry(0)},
	} {
		mode := tc.mode
		t.Run(string(mode)+" "+tc.backend.Name(), func(t *testing.T) {
			if tc.backend == (delay.DelayedRetry(0)) {
				need43(t)
			}
			s := newSetup(t, m, tc.backend)
			logs := &logCapture{}
			s.cfg.Logger = logs
			s.cfg.Topology = mode
			obs := &events{}
			s.cfg.Observe = obs.observe
			poison := s.prefix + ".poison"
			ch, err := brokertest.Dial(t).Channel()
			if err != nil {
				t.Fatal(err)
			}
			if mode == topology.ModeNone {
				s.cfg.Backend = delay.DelayedRetry(300 * time.Millisecond)
			}
			plan, err := s.cfg.Plan(s.topic)
			if err != nil {
				t.Fatal(err)
			}
			if mode == topology.ModeNone {
				// Nothing declared by the library: the work queue as an administrator
				// made it, and no poison queue.
				s.sub.QueueArgs = quorum
				if _, err := ch.QueueDeclare(s.topic, true, false, false, false, workQueueArgs(t, s.cfg, s.topic)); err != nil {
					t.Fatal(err)
				}
			} else {
				apply(t, plan, s.topic) // what `amqpretry topology apply` creates
			}
			r := newRetry(t, m, s.sub, s.cfg)
			if _, err := ch.QueueDelete(poison, false, false, false); err != nil {
				t.Fatal(err)
			}
			rec := newRecorder(func(msg *message.Message) error {
				if msg.UUID == "canary" {
					return nil
				}
				return amqpretry.Permanent(errors.New("malformed order"))
			})
			run(t, m, r, s.topic, rec.handle)
			publish(t, m, s.topic, "bad")
			publish(t, m, s.topic, "canary")

			if mode == topology.ModeDeclare {
				if msg := poisoned(t, poison, 30*time.Second); msg.UUID != "bad" {
					t.Errorf("poisoned %s, want bad", msg.UUID)
				}
				rec.waitCalls(t, 2, 10*time.Second)
				waitFor(t, 10*time.Second, "1 poisoned", func() bool { return r.Stats().Poisoned == 1 })
				if got := attemptsByUUID(rec.snapshot()); len(got["bad"]) != 1 || len(got["canary"]) != 1 {
					t.Errorf("handled %v, want bad and canary once each", got)
				}
				if st := r.Stats(); st.PoisonPending != 0 {
					t.Errorf("stats %+v, want nothing pending", st)
				}
				noNilErr(t, logs)
				return
			}

			// Four poison publishes failed: 100+200+400 ms of pauses between them.
			waitFor(t, 30*time.Second, "4 failed poison publishes", func() bool { return r.Stats().HandoffFailures >= 4 })
			rec.waitCalls(t, 2, 10*time.Second)
			if got := attemptsByUUID(rec.snapshot()); len(got["bad"]) != 1 || len(got["canary"]) != 1 {
				t.Errorf("handled %v, want bad and canary once each: a message that failed for good ran through the handler again", got)
			}
			if st := r.Stats(); st.PoisonPending != 1 || st.Poisoned != 0 {
				t.Errorf("stats %+v, want 1 poison pending, none poisoned", st)
			}
			missing := 0
			for _, ev := range obs.of(amqpretry.EventHandoffFailed) {
				if ev.Cause == "poison-queue-missing" && ev.Reason == amqpretry.ReasonPermanent {
					missing++
				}
			}
			if missing < 4 {
				t.Errorf("%d events with cause poison-queue-missing, want at least 4", missing)
			}
			named := false
			for _, l := range logs.at(watermill.ErrorLogLevel) {
				if l.Err != nil && strings.Contains(l.Err.Error(), `poison queue "`+poison+`" does not exist`) &&
					strings.Contains(l.Err.Error(), "`amqpretry topology apply --backend "+tc.backend.Name()+" --prefix "+s.prefix) {
					named = true
				}
			}
			if !named {
				t.Errorf("no ERROR names the missing poison queue and the command: %+v", logs.at(watermill.ErrorLogLevel))
			}
			o, err := ops.New(ops.Config{URI: brokertest.URI(), Retry: s.cfg})
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			st, err := o.Status(context.Background(), ops.StatusOptions{})
			if err != nil {
				t.Fatal(err)
			}
			flagged := false
			for _, f := range st.Flags {
				flagged = flagged || f.Kind == ops.FlagMissing && f.Name == poison
			}
			if !flagged {
				t.Errorf("status flags %+v, want the missing poison queue", st.Flags)
			}

			// The administrator creates it again: the message is poisoned, the handler
			// does not run it again.
			apply(t, plan)
			msg := poisoned(t, poison, 30*time.Second)
			if env := middleware.ReadEnvelope(msg.Metadata); msg.UUID != "bad" || env.Reason != amqpretry.ReasonPermanent || !strings.Contains(env.Error, "malformed order") {
				t.Errorf("poisoned %s (%s, %q), want bad for permanent with the handler's error", msg.UUID, env.Reason, env.Error)
			}
			waitFor(t, 10*time.Second, "1 poisoned, none pending", func() bool {
				st := r.Stats()
				return st.Poisoned == 1 && st.PoisonPending == 0
			})
			if got := attemptsByUUID(rec.snapshot()); len(got["bad"]) != 1 {
				t.Errorf("handled bad %d times, want once", len(got["bad"]))
			}
			waitFor(t, 10*time.Second, "empty work queue", func() bool { return brokertest.QueueLength(t, s.topic) == 0 })
			noNilErr(t, logs)
		})
	}
}

// CloseBeforeTheRouterHandsNothingOff: Close is called while the router still runs
// (deferred closes run in that order). A message that fails after it is not handed
// off: it is nacked for redelivery, paced, and stays in its work queue; the first one is
// logged, naming the order to close in; Close logged what it did before, and a second
// Close does nothing.
func CloseBeforeTheRouterHandsNothingOff(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	logs := &logCapture{}
	s.cfg.Logger = logs
	s.cfg.Backend = delay.TTLTiers(500 * time.Millisecond)
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(*message.Message) error { return errFlaky })
	sub := m.Subscriber(t, r)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, Logger())
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("orders", s.topic, sub, rec.handle).AddMiddleware(r.Middleware)
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = router.Close()
		}
	})

	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	publish(t, m, s.topic, "late")
	calls := rec.waitCalls(t, 3, 30*time.Second)
	// Paced as failed hand-offs are: 100 then 200 ms between the first three runs.
	if gap := calls[2].at.Sub(calls[0].at); gap < 300*time.Millisecond {
		t.Errorf("three runs within %s: not paced", gap)
	}
	if st := r.Stats(); st.Retries != 0 || st.Poisoned != 0 || st.HandoffFailures != 0 {
		t.Errorf("stats %+v after Close, want nothing handed off", st)
	}
	for _, q := range []string{s.prefix + ".delay.500ms", s.prefix + ".poison", s.prefix + ".parking"} {
		if n := brokertest.QueueLength(t, q); n != 0 {
			t.Errorf("%d messages in %s after Close", n, q)
		}
	}
	warned := 0
	for _, l := range logs.at(watermill.ErrorLogLevel) {
		if strings.Contains(l.Msg, "after Close") {
			warned++
			if !errors.Is(l.Err, amqpretry.ErrHandoff) || !strings.Contains(l.Err.Error(), "close the router first, then the Retry") {
				t.Errorf("the line after Close does not name the order: %v", l.Err)
			}
		}
	}
	if warned != 1 {
		t.Errorf("%d lines for messages failed after Close, want 1 (the first)", warned)
	}
	if err := r.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	closed := 0
	for _, l := range logs.at(watermill.InfoLogLevel) {
		if strings.HasPrefix(l.Msg, "Broker-side retry closed") {
			closed++
			if l.Fields["handoffs_waited_for"] == nil {
				t.Errorf("the closing line does not say what Close waited for: %v", l.Fields)
			}
		}
	}
	if closed != 1 {
		t.Errorf("%d closing lines, want 1", closed)
	}
	// The router stops: the message is in its work queue, not lost.
	stopped = true
	if err := router.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the message back in its work queue", func() bool { return brokertest.QueueLength(t, s.topic) == 1 })
	if st := r.Stats(); st.Retries != 0 || st.Poisoned != 0 {
		t.Errorf("stats %+v after the router stopped, want nothing handed off", st)
	}
	noNilErr(t, logs)
}

// ForgottenCloseIsWarnedAndClosed: a Retry dropped without Close is found by the
// garbage collector: a WARN says so, and its hand-off connection is closed.
func ForgottenCloseIsWarnedAndClosed(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	logs := &logCapture{}
	s.cfg.Logger = logs
	plan, err := s.cfg.Plan()
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, plan)
	func() {
		if _, err := m.New(s.sub, s.cfg); err != nil {
			t.Fatal(err)
		}
	}()
	has := func(level watermill.LogLevel, prefix string) bool {
		for _, l := range logs.at(level) {
			if strings.HasPrefix(l.Msg, prefix) {
				return true
			}
		}
		return false
	}
	waitFor(t, 30*time.Second, "a WARN for the forgotten Close, and the Retry closed", func() bool {
		runtime.GC()
		return has(watermill.ErrorLogLevel, "Retry garbage-collected without Close") && has(watermill.InfoLogLevel, "Broker-side retry closed")
	})
	noNilErr(t, logs)
}

// RetryAfterIsNeverUndercutOnDelayedRetry: on delayed-retry alone, whose work queue
// holds every retry for one delay, a RetryAfter longer than it is held again until it is
// due: it never comes back early. The adjustment is logged below ERROR.
func RetryAfterIsNeverUndercutOnDelayedRetry(t *testing.T, m Major) {
	need43(t)
	s := newSetup(t, m, delay.DelayedRetry(0))
	const held, after = 400 * time.Millisecond, 700 * time.Millisecond
	s.sub.QueueArgs = quorumToPoison(s) // no ERROR about a quorum queue that drops
	s.cfg.Backend = delay.DelayedRetry(held)
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3}
	logs := &logCapture{}
	s.cfg.Logger = logs
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if amqpretry.Attempt(msg) == 1 {
			return amqpretry.RetryAfter(errors.New("429 too many requests"), after)
		}
		return nil
	})
	run(t, m, r, s.topic, rec.handle, rec.settle)
	publish(t, m, s.topic, "throttled")
	calls := rec.waitCalls(t, 2, 30*time.Second)
	if got := attemptsByUUID(calls); len(got["throttled"]) != 2 || got["throttled"][1] != 2 {
		t.Fatalf("handled %v, want attempts [1 2]", got)
	}
	if gap := calls[1].at.Sub(calls[0].at); gap < after {
		t.Errorf("RetryAfter(%s) came back after %s: undercut", after, gap)
	}
	wantStats(t, r, 1, 0)
	for _, l := range logs.at(watermill.ErrorLogLevel) {
		t.Errorf("ERROR line: %q %v %v", l.Msg, l.Err, l.Fields)
	}
}

// RetryAfterIsNeverUndercutOnTTLTiers: a RetryAfter longer than the longest tier is
// parked again when it comes back, until it is due: the handler never sees it early.
// The adjustment is logged below ERROR.
func RetryAfterIsNeverUndercutOnTTLTiers(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	const after = 1200 * time.Millisecond
	s.cfg.Backend = delay.TTLTiers(500 * time.Millisecond)
	logs := &logCapture{}
	s.cfg.Logger = logs
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if amqpretry.Attempt(msg) == 1 {
			return amqpretry.RetryAfter(errors.New("503 retry after 1.2s"), after)
		}
		return nil
	})
	run(t, m, r, s.topic, rec.handle)
	publish(t, m, s.topic, "throttled")
	calls := rec.waitCalls(t, 2, 30*time.Second)
	if got := attemptsByUUID(calls); len(got["throttled"]) != 2 || got["throttled"][1] != 2 {
		t.Fatalf("handled %v, want attempts [1 2]", got)
	}
	if gap := calls[1].at.Sub(calls[0].at); gap < after {
		t.Errorf("RetryAfter(%s) came back after %s: undercut", after, gap)
	}
	if env := middleware.ReadEnvelope(calls[1].msg.Metadata); env.RequestedDelay != after || calls[1].at.Before(env.Due) {
		t.Errorf("envelope %+v at %s: want the delay asked for, and due before the arrival", env, calls[1].at)
	}
	wantStats(t, r, 1, 0)
	for _, l := range logs.at(watermill.ErrorLogLevel) {
		t.Errorf("ERROR line: %q %v %v", l.Msg, l.Err, l.Fields)
	}
}

// PolicyDelayPastTheLongestTierIsNeverEarly (issue 43 §4): a delay of the policy's
// longer than the longest tier is parked again when it comes back, as a RetryAfter
// is, until it is due: the handler never sees it before the delay asked for (it came
// back after the longest tier). Validate accepts it, start-up says so at INFO, and
// nothing is logged at ERROR.
func PolicyDelayPastTheLongestTierIsNeverEarly(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	const tier, asked = time.Second, 3 * time.Second
	s.cfg.Backend = delay.TTLTiers(tier)
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{asked}, Jitter: -1}
	if err := s.cfg.Validate(); err != nil {
		t.Fatalf("Validate() = %v, want accepted (parked again until due)", err)
	}
	logs := &logCapture{}
	s.cfg.Logger = logs
	r := newRetry(t, m, s.sub, s.cfg)
	if !hasLine(logs, watermill.InfoLogLevel, "longer than the longest tier; those retries are parked again until they are due", "") {
		t.Errorf("no INFO line at start saying the longest delay is parked again; lines: %+v", logs.at(watermill.InfoLogLevel))
	}
	rec := newRecorder(failFirst(1))
	run(t, m, r, s.topic, rec.handle)
	publish(t, m, s.topic, "long")
	calls := rec.waitCalls(t, 2, 30*time.Second)
	if got := attemptsByUUID(calls); len(got["long"]) != 2 || got["long"][1] != 2 {
		t.Fatalf("handled %v, want attempts [1 2]", got)
	}
	if gap := calls[1].at.Sub(calls[0].at); gap < asked {
		t.Errorf("the policy's delay of %s came back after %s: early (the longest tier is %s)", asked, gap, tier)
	}
	env := middleware.ReadEnvelope(calls[1].msg.Metadata)
	if env.RequestedDelay != asked || env.Due.Before(calls[0].at.Add(asked)) || calls[1].at.Before(env.Due) {
		t.Errorf("envelope requested %s, due %s, handled at %s after a failure at %s: want %s asked, due no earlier than that after the failure, and handled no earlier than due",
			env.RequestedDelay, env.Due, calls[1].at, calls[0].at, asked)
	}
	wantStats(t, r, 1, 0)
	for _, l := range logs.at(watermill.ErrorLogLevel) {
		t.Errorf("ERROR line: %q %v %v", l.Msg, l.Err, l.Fields)
	}
}
