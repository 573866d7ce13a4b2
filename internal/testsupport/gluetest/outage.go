package gluetest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/sony/gobreaker"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
)

// OutageIsNotAPoison: the scenario of issue 41, scaled to a test. Messages flow at a
// steady rate; one in 25 is bad for good (Permanent), one in 5 fails once at random;
// and in the middle the handler's dependency is down for longer than the whole retry
// schedule. With outage detection (the default), the outage poisons nothing, every
// Permanent message is poisoned, nothing is lost, the handler runs while down are
// bounded by the threshold and the probes (not by the traffic), the fail-once
// messages begin no outage of their own, and every message runs once per attempt. On
// ttl-tiers and binary-levels on any broker, and on delayed-retry and held retries on
// RabbitMQ 4.3.
func OutageIsNotAPoison(t *testing.T, m Major) {
	for _, tc := range []struct {
		name    delay.Backend
		held    int
		need43  bool
		quorum  bool
		variant string
	}{
		{name: delay.TTLTiers()},
		{name: delay.BinaryLevels(0)},
		{name: delay.DelayedRetry(0), need43: true, quorum: true},
		{name: delay.TTLTiers(), held: 2, need43: true, quorum: true, variant: "+held"},
	} {
		t.Run(tc.name.Name()+tc.variant, func(t *testing.T) {
			if tc.need43 {
				need43(t)
			}
			s := newSetup(t, m, tc.name)
			if tc.quorum {
				s.sub.QueueArgs = quorum
			}
			s.cfg.Backend = delay.HeldRetries(tc.held, 0, s.cfg.Backend)
			// MaxAttempts 4: a fail-once message may lose two attempts to the outage
			// (a run as it began, a probe) and still have one to spare. Each run is
			// an attempt.
			s.cfg.Policy = amqpretry.Policy{MaxAttempts: 4, Delays: amqpretry.Exponential(500*time.Millisecond, 2, time.Second), Jitter: -1}
			if tc.name == (delay.DelayedRetry(0)) {
				s.cfg.Policy = amqpretry.Policy{MaxAttempts: 4}
				s.cfg.Backend = delay.DelayedRetry(500 * time.Millisecond)
			} else {
				s.cfg.Backend = withTiers(s.cfg.Backend, 500*time.Millisecond, time.Second)
			}
			s.cfg.Outage = amqpretry.Outage{ProbeInterval: 200 * time.Millisecond}
			obs := &events{}
			const total = 120
			var down, started atomic.Bool
			// runsDown counts the handler's runs while the dependency is down,
			// runsBefore those before the outage began; published counts the
			// messages published while down, publishedAtStart those when it began.
			var runsDown, runsBefore, published, publishedAtStart atomic.Int64
			var wentDown atomic.Bool
			ranBeforeDown := map[string]bool{} // under mu
			s.cfg.Observe = func(ev amqpretry.Event) {
				if ev.Kind == amqpretry.EventOutageStarted {
					publishedAtStart.Store(published.Load())
					started.Store(true)
				}
				obs.observe(ev)
			}
			r := newRetry(t, m, s.sub, s.cfg)
			var mu sync.Mutex
			succeeded := map[string]bool{}
			failedOnce := map[string]bool{}
			ran := map[string][]int{} // the attempts each message ran on
			handle := func(msg *message.Message) error {
				mu.Lock()
				ran[msg.UUID] = append(ran[msg.UUID], amqpretry.Attempt(msg))
				mu.Unlock()
				i, _ := strconv.Atoi(msg.UUID[1:])
				if i%25 == 0 {
					return amqpretry.Permanent(errors.New("malformed"))
				}
				if down.Load() {
					runsDown.Add(1)
					if !started.Load() {
						runsBefore.Add(1)
					}
					return errDependencyDown
				}
				mu.Lock()
				defer mu.Unlock()
				if !wentDown.Load() {
					ranBeforeDown[msg.UUID] = true
				}
				if i%5 == 1 && !failedOnce[msg.UUID] {
					failedOnce[msg.UUID] = true
					return errFlaky
				}
				succeeded[msg.UUID] = true
				return nil
			}
			run(t, m, r, s.topic, handle)
			pub := m.Publisher(t, Sub{URI: brokertest.URI()})
			// 40 a second; the dependency is down from message 30 to message 90 and
			// a while after: longer than the whole retry schedule (0.5 s + 1 s).
			for i := range total {
				if i == 30 {
					wentDown.Store(true)
					down.Store(true)
				}
				if down.Load() {
					published.Add(1)
				}
				if err := pub.Publish(s.topic, message.NewMessage(fmt.Sprintf("m%03d", i), []byte("booking"))); err != nil {
					t.Fatal(err)
				}
				time.Sleep(25 * time.Millisecond) // pacing the traffic, not a wait for a result
				if i == 90 {
					waitFor(t, 10*time.Second, "the outage to begin", func() bool { return len(obs.of(amqpretry.EventOutageStarted)) > 0 })
					time.Sleep(2 * time.Second) // the outage lasts beyond the retry schedule
					down.Store(false)
				}
			}
			wantOK := 0
			for i := range total {
				if i%25 != 0 {
					wantOK++
				}
			}
			waitFor(t, 60*time.Second, "every good message handled", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(succeeded) == wantOK
			})
			perm := total / 25
			if total%25 != 0 {
				perm++
			}
			waitFor(t, 20*time.Second, "the permanent ones poisoned", func() bool { return r.Stats().Poisoned >= int64(perm) })
			poisonedIDs := map[string]amqpretry.Reason{}
			for range perm {
				msg := poisoned(t, s.prefix+".poison", 10*time.Second)
				poisonedIDs[msg.UUID] = middleware.ReadEnvelope(msg.Metadata).Reason
			}
			for id, reason := range poisonedIDs {
				if i, _ := strconv.Atoi(id[1:]); i%25 != 0 || reason != amqpretry.ReasonPermanent {
					t.Errorf("poisoned %s for %s: only the Permanent ones may be", id, reason)
				}
			}
			if st := r.Stats(); st.Poisoned != int64(perm) {
				t.Errorf("poisoned %d, want the %d Permanent ones", st.Poisoned, perm)
			}
			startedEv, ended, probes := obs.of(amqpretry.EventOutageStarted), obs.of(amqpretry.EventOutageEnded), obs.of(amqpretry.EventProbe)
			if len(startedEv) != 1 || len(ended) != 1 {
				t.Errorf("outages started %d, ended %d; want exactly one each (the fail-once fifth begins none)", len(startedEv), len(ended))
			}
			failedProbes := int64(0)
			for _, p := range probes {
				if errors.Is(p.Err, errDependencyDown) { // not a Permanent one's
					failedProbes++
				}
			}
			// Before the outage began: the first attempts of the messages published
			// while down until then and of those published before but not yet run,
			// and the retries that failed, at most Consecutive of them (the first
			// failed retry begins the outage once Consecutive failures are in a
			// row). Once it began: the failed probes, not one run per message per
			// attempt.
			mu.Lock()
			lag := int64(0)
			for i := range 30 {
				if i%25 != 0 && !ranBeforeDown[fmt.Sprintf("m%03d", i)] {
					lag++
				}
			}
			mu.Unlock()
			before, in := runsBefore.Load(), runsDown.Load()-runsBefore.Load()
			bound := publishedAtStart.Load() + lag + int64(s.cfg.WithDefaults().Outage.Consecutive)
			t.Logf("%s%s: handler runs while down %d: %d before the outage began (bound %d: %d published while down, %d before and not yet run, and Consecutive), %d in it (%d failed probes of %d); retries %d, outage lasted %v",
				tc.name, tc.variant, runsDown.Load(), before, bound, publishedAtStart.Load(), lag, in, failedProbes, len(probes), r.Stats().Retries, durations(ended))
			if before > bound {
				t.Errorf("handler ran %d times while down before the outage began, want at most %d: the first attempts of the messages published until then, and Consecutive retries", before, bound)
			}
			if in != failedProbes {
				t.Errorf("handler ran %d times while down in the outage, want only the %d failed probes", in, failedProbes)
			}
			mu.Lock()
			defer mu.Unlock()
			for id, attempts := range ran {
				for k, a := range attempts {
					if a != k+1 {
						t.Errorf("%s ran on attempts %v, want once per attempt", id, attempts)
						break
					}
				}
			}
		})
	}
}

var errDependencyDown = errors.New("dial tcp 10.0.0.5:5432: connection refused")

func durations(evs []amqpretry.Event) []time.Duration {
	var out []time.Duration
	for _, ev := range evs {
		out = append(out, ev.Duration.Round(time.Millisecond))
	}
	return out
}

// OutageBeginsAtOnceOnUnavailableAndAnOpenBreaker: an error marked Unavailable, or
// the refusal of Watermill's CircuitBreaker middleware (placed inside the retry
// middleware) while open, begins the work queue's outage on its first occurrence: that
// run was an attempt and takes the retry path, the other messages wait, and the outage
// ends when the dependency returns, every message handled, none poisoned. Every run is
// an attempt: a retry copy for the run that began it and for each failed probe, none
// for the messages that waited.
func OutageBeginsAtOnceOnUnavailableAndAnOpenBreaker(t *testing.T, m Major) {
	for _, breaker := range []bool{false, true} {
		name := "unavailable"
		if breaker {
			name = "circuit-breaker"
		}
		t.Run(name, func(t *testing.T) {
			s := newSetup(t, m, delay.TTLTiers())
			s.cfg.Backend = delay.TTLTiers(300 * time.Millisecond)
			s.cfg.Policy = amqpretry.Policy{MaxAttempts: 5, Delays: amqpretry.Exponential(300*time.Millisecond, 2, 10*time.Minute), Jitter: -1}
			// Consecutive is far above what the test fails: only the one error (or
			// refusal) can begin the outage.
			s.cfg.Outage = amqpretry.Outage{Consecutive: 1000, ProbeInterval: 100 * time.Millisecond}
			var down atomic.Bool
			down.Store(true)
			var runs, runsAtStart atomic.Int64
			runsAtStart.Store(-1)
			obs := &events{}
			var retriesAtStart atomic.Int64
			var r Retry
			s.cfg.Observe = func(ev amqpretry.Event) {
				if ev.Kind == amqpretry.EventOutageStarted {
					runsAtStart.Store(runs.Load())
					retriesAtStart.Store(r.Stats().Retries)
				}
				obs.observe(ev)
			}
			r = newRetry(t, m, s.sub, s.cfg)
			var mu sync.Mutex
			okAttempts := map[string][]int{}
			ran := map[string][]int{} // the attempts each message ran on
			handle := func(msg *message.Message) error {
				runs.Add(1)
				mu.Lock()
				ran[msg.UUID] = append(ran[msg.UUID], amqpretry.Attempt(msg))
				mu.Unlock()
				if down.Load() {
					err := errors.New("dial tcp 10.0.0.5:5432: connection refused")
					if !breaker {
						err = amqpretry.Unavailable(err)
					}
					return err
				}
				mu.Lock()
				defer mu.Unlock()
				okAttempts[msg.UUID] = append(okAttempts[msg.UUID], amqpretry.Attempt(msg))
				return nil
			}
			// The breaker opens after 3 failures in a row; open, it refuses for
			// 200 ms, then lets one message through (half-open).
			const tripAfter = 3
			cb := wmiddleware.NewCircuitBreaker(gobreaker.Settings{
				Name:        s.prefix,
				Timeout:     200 * time.Millisecond,
				ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= tripAfter },
			})
			sub := m.Subscriber(t, r)
			newRouter(t, func(router *message.Router) {
				h := router.AddConsumerHandler("handler-"+s.topic, s.topic, sub, handle)
				if breaker {
					// The first added is the outermost: the breaker runs inside the
					// retry, which sees its refusals.
					h.AddMiddleware(r.Middleware, cb.Middleware)
				} else {
					h.AddMiddleware(r.Middleware)
				}
			})
			const total = 8
			for i := range total {
				publish(t, m, s.topic, fmt.Sprintf("m%d", i))
			}
			waitFor(t, 20*time.Second, "the outage to begin", func() bool { return len(obs.of(amqpretry.EventOutageStarted)) > 0 })
			wantRuns, wantRetries := int64(1), int64(0) // the first Unavailable error begins it
			if breaker {
				// The breaker's failures are retried (copies) until it opens; its
				// first refusal begins the outage, with no copy.
				wantRuns, wantRetries = tripAfter, tripAfter
			}
			if got := runsAtStart.Load(); got != wantRuns {
				t.Errorf("the handler ran %d times before the outage began, want %d", got, wantRuns)
			}
			if got := retriesAtStart.Load(); got != wantRetries {
				t.Errorf("%d retries when the outage began, want %d", got, wantRetries)
			}
			started := obs.of(amqpretry.EventOutageStarted)
			if breaker && !errors.Is(started[0].Err, gobreaker.ErrOpenState) {
				t.Errorf("outage began on %v, want the open breaker's refusal (%v)", started[0].Err, gobreaker.ErrOpenState)
			}
			// Probes fail while the dependency is down; then it returns.
			waitFor(t, 20*time.Second, "two probes", func() bool { return len(obs.of(amqpretry.EventProbe)) >= 2 })
			if st := r.Stats(); st.Poisoned != 0 || st.InOutage != 1 {
				t.Errorf("while down: %+v, want none poisoned, one queue in outage", st)
			}
			down.Store(false)
			waitFor(t, 30*time.Second, "every message handled", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(okAttempts) == total
			})
			waitFor(t, 10*time.Second, "the outage to end", func() bool { return len(obs.of(amqpretry.EventOutageEnded)) == 1 })
			failedProbes := int64(0)
			for _, p := range obs.of(amqpretry.EventProbe) {
				if p.Err != nil {
					failedProbes++
				}
			}
			mu.Lock()
			for id, attempts := range okAttempts {
				if len(attempts) != 1 {
					t.Errorf("%s handled successfully %d times (attempts %v), want once", id, len(attempts), attempts)
				}
			}
			for id, attempts := range ran {
				// Once per attempt (the breaker's refusals are attempts the handler
				// does not see).
				for k, a := range attempts {
					if a < k+1 || (k > 0 && a <= attempts[k-1]) || (!breaker && a != k+1) {
						t.Errorf("%s ran on attempts %v, want once per attempt: a run is an attempt, and waiting spends none", id, attempts)
						break
					}
				}
			}
			mu.Unlock()
			if st := r.Stats(); st.Retries != wantRetries+1+failedProbes || st.Poisoned != 0 || st.InOutage != 0 || st.Outages != 1 {
				t.Errorf("after: %+v, want %d retries (%d before the outage, the run that began it, %d failed probes), none poisoned, one outage, over",
					st, wantRetries+1+failedProbes, wantRetries, failedProbes)
			}
			if n := len(obs.of(amqpretry.EventOutageStarted)); n != 1 {
				t.Errorf("%d outages began, want 1", n)
			}
		})
	}
}

// CloseDuringAnOutageLosesNothing: messages wait in an outage, one in each of three
// consumers of the work queue, more in their prefetch; the router's Close returns
// within its close timeout, then the Retry's. A new Retry and router on the same queue,
// the dependency back, handle every message: none lost, none poisoned, none parked for
// the outage. On ttl-tiers on any broker, and on delayed-retry and held retries on
// RabbitMQ 4.3, whose work queue counts each return of a message as an attempt
// (x-acquired-count): there a message given back comes back one attempt later.
func CloseDuringAnOutageLosesNothing(t *testing.T, m Major) {
	for _, tc := range []struct {
		name    delay.Backend
		held    int
		variant string
	}{
		{name: delay.TTLTiers()},
		{name: delay.DelayedRetry(0)},
		{name: delay.TTLTiers(), held: 2, variant: "+held"},
	} {
		counted := tc.name == (delay.DelayedRetry(0)) || tc.held > 0 // the broker counts returns as attempts
		t.Run(tc.name.Name()+tc.variant, func(t *testing.T) {
			if counted {
				need43(t)
			}
			s := newSetup(t, m, tc.name)
			s.sub.Prefetch = 4
			s.cfg.Backend = delay.HeldRetries(tc.held, 0, s.cfg.Backend)
			s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3, Delays: amqpretry.Exponential(300*time.Millisecond, 2, 10*time.Minute), Jitter: -1}
			if counted {
				s.sub.QueueArgs = quorum
			}
			if tc.name == (delay.DelayedRetry(0)) {
				s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3}
				s.cfg.Backend = delay.DelayedRetry(300 * time.Millisecond)
			} else {
				s.cfg.Backend = delay.TTLTiers(300 * time.Millisecond)
			}
			// No probe comes while the test looks: the messages only wait.
			s.cfg.Outage = amqpretry.Outage{ProbeInterval: time.Hour}
			const consumers, total = 3, 20
			var down atomic.Bool
			down.Store(true)
			var mu sync.Mutex
			handled := map[string]int{}
			attempts := map[string][]int{}
			ranDown := map[string]int{} // runs while down
			handle := func(msg *message.Message) error {
				if down.Load() {
					mu.Lock()
					ranDown[msg.UUID]++
					mu.Unlock()
					return amqpretry.Unavailable(errors.New("dial tcp 10.0.0.5:5432: connection refused"))
				}
				mu.Lock()
				defer mu.Unlock()
				handled[msg.UUID]++
				attempts[msg.UUID] = append(attempts[msg.UUID], amqpretry.Attempt(msg))
				return nil
			}
			// start runs a Retry and a router of consumers handlers on the queue;
			// waiting counts the messages inside the retry middleware.
			var waiting atomic.Int64
			inside := func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					waiting.Add(1)
					defer waiting.Add(-1)
					return h(msg)
				}
			}
			start := func() (Retry, *message.Router) {
				r, err := m.New(s.sub, s.cfg)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = r.Close() })
				router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, Logger())
				if err != nil {
					t.Fatal(err)
				}
				for i := range consumers {
					router.AddConsumerHandler(fmt.Sprintf("handler-%d", i), s.topic, m.Subscriber(t, r), handle).AddMiddleware(inside, r.Middleware)
				}
				go func() { _ = router.Run(context.Background()) }()
				<-router.Running()
				t.Cleanup(func() { _ = router.Close() })
				return r, router
			}
			r1, router1 := start()
			if plan, err := s.cfg.Plan(); err == nil {
				brokertest.CleanupTopology(t, plan)
			}
			pub := m.Publisher(t, Sub{URI: brokertest.URI()})
			for i := range total {
				if err := pub.Publish(s.topic, message.NewMessage(fmt.Sprintf("m%02d", i), []byte("booking"))); err != nil {
					t.Fatal(err)
				}
			}
			ranWhileDown := func() int {
				mu.Lock()
				defer mu.Unlock()
				return len(ranDown)
			}
			waitFor(t, 20*time.Second, "a message waiting in each consumer, the runs before the outage handed off", func() bool {
				return waiting.Load() == consumers && r1.Stats().Retries == int64(ranWhileDown())
			})
			runsDown := ranWhileDown()
			// The runs before the outage began (the first, and any that read it not
			// begun yet, one per consumer at most) were attempts: each took the
			// retry path. The waiting ones spent nothing.
			if st := r1.Stats(); st.InOutage != 1 || st.Retries != int64(runsDown) || runsDown > consumers || st.Poisoned != 0 {
				t.Fatalf("while down: %+v, %d messages ran; want the queue in an outage, one retry per run, at most %d, nothing poisoned", st, runsDown, consumers)
			}
			closed := make(chan error, 1)
			go func() { closed <- router1.Close() }()
			select {
			case err := <-closed:
				if err != nil {
					t.Fatalf("router.Close during an outage: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("router.Close did not return within 30 s")
			}
			if err := r1.Close(); err != nil {
				t.Fatal(err)
			}
			if n := waiting.Load(); n != 0 {
				t.Errorf("%d messages still waiting after Close", n)
			}
			st1 := r1.Stats()
			down.Store(false)
			r2, _ := start()
			waitFor(t, 30*time.Second, "every message handled after the restart", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(handled) == total
			})
			mu.Lock()
			dups := 0
			byAttempt := map[int]int{}
			for id, n := range handled {
				dups += n - 1
				a := attempts[id]
				byAttempt[a[0]]++
				if want := 1 + ranDown[id]; a[0] != want && !counted {
					t.Errorf("%s ran on attempt %v after the restart, want %d (it ran %d times while down): waiting in the outage, or going back to the queue, spent an attempt", id, a, want, ranDown[id])
				}
			}
			mu.Unlock()
			st2 := r2.Stats()
			t.Logf("%s%s: %d messages, %d ran while down, %d handled more than once, first runs by attempt %v; first Retry %+v", tc.name.Name(), tc.variant, total, runsDown, dups, byAttempt, st1)
			if st1.Retries != int64(runsDown) || st1.Poisoned != 0 || st2.Retries != 0 || st2.Poisoned != 0 {
				t.Errorf("retried or poisoned for the outage: before Close %+v (%d ran while down), after %+v", st1, runsDown, st2)
			}
		})
	}
}
