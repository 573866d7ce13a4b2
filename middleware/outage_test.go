package middleware

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/sony/gobreaker"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// attemptMsg is a message on its attempt-th delivery.
func attemptMsg(uuid string, attempt int) *message.Message {
	msg := message.NewMessage(uuid, nil)
	if attempt > 1 {
		msg.Metadata.Set(keys.Attempt, strconv.Itoa(attempt))
	}
	return msg
}

// outageRecorder records the outage events.
type outageRecorder struct {
	mu     sync.Mutex
	events []amqpretry.Event
}

func (r *outageRecorder) observe(ev amqpretry.Event) {
	switch ev.Kind {
	case amqpretry.EventOutageStarted, amqpretry.EventOutageEnded, amqpretry.EventProbe:
		r.mu.Lock()
		r.events = append(r.events, ev)
		r.mu.Unlock()
	}
}

func (r *outageRecorder) kinds() []amqpretry.EventKind {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []amqpretry.EventKind
	for _, ev := range r.events {
		out = append(out, ev.Kind)
	}
	return out
}

// waitFor polls cond until it is true, or fails the test after a deadline.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// A dependency down: failures of first deliveries alone begin nothing; once a retry
// fails too and the failures reach Consecutive, the queue is in an outage. Then the
// failing message waits instead of being retried, probes run one at a time and cost no
// attempt, and the first success ends the outage and lets every waiting message run.
func TestOutageBeginsProbesAndEnds(t *testing.T) {
	b := &fakeBackend{}
	rec := &outageRecorder{}
	e, poison := newEngine(t, amqpretry.Config{
		Policy:  amqpretry.Policy{MaxAttempts: 3},
		Outage:  amqpretry.Outage{Consecutive: 3, ProbeInterval: 5 * time.Millisecond, MaxProbeInterval: 20 * time.Millisecond},
		Observe: rec.observe,
	}, b)
	var down atomic.Bool
	down.Store(true)
	var runs atomic.Int64
	h := func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		if down.Load() {
			return nil, errors.New("connection refused")
		}
		return nil, nil
	}
	mw := e.Middleware(h)
	// Three first deliveries fail: handed off as retries, no outage (no retry failed).
	for i := range 3 {
		if _, err := mw(attemptMsg("first-"+strconv.Itoa(i), 1)); err != nil {
			t.Fatal(err)
		}
	}
	if got := len(b.msgs()); got != 3 || e.outages.of("work").isDown.Load() {
		t.Fatalf("after 3 first-attempt failures: %d parked, down %v; want 3 parked and no outage", got, e.outages.of("work").isDown.Load())
	}
	// A retry fails: 4 in a row with a retry among them. The message waits.
	done := make(chan error, 1)
	go func() {
		_, err := mw(attemptMsg("retry", 2))
		done <- err
	}()
	waitFor(t, "the outage to begin", func() bool { return e.outages.of("work").isDown.Load() })
	// More messages arrive while down: they wait too, before the handler.
	others := make(chan error, 5)
	for i := range 5 {
		go func() {
			_, err := mw(attemptMsg("later-"+strconv.Itoa(i), 1))
			others <- err
		}()
	}
	// Let some probes fail.
	waitFor(t, "three probes", func() bool { return e.outages.probes.Load() >= 3 })
	// A message that fails three probes in a row takes the retry path: at most one
	// copy per three probes, never one per waiting message.
	if got, most := len(b.msgs()), 3+int(e.outages.probes.Load())/probesPerMessage; got > most {
		t.Errorf("parked %d while down, want at most %d: the 3 before the outage and one per %d failed probes", got, most, probesPerMessage)
	}
	down.Store(false)
	if err := <-done; err != nil {
		t.Fatalf("the message that began the outage: %v, want success once a probe succeeds", err)
	}
	for range 5 {
		if err := <-others; err != nil {
			t.Fatalf("a waiting message: %v", err)
		}
	}
	if e.outages.of("work").isDown.Load() {
		t.Error("still down after a success")
	}
	if len(poison.got()) != 0 {
		t.Errorf("poisoned %d, want 0", len(poison.got()))
	}
	kinds := rec.kinds()
	if len(kinds) < 3 || kinds[0] != amqpretry.EventOutageStarted || kinds[len(kinds)-1] != amqpretry.EventOutageEnded {
		t.Errorf("events %v: want OutageStarted, probes, OutageEnded", kinds)
	}
	// Runs while down: 3 + the retry + the failed probes + the successful runs of
	// the 6 waiting messages; never one per message per attempt.
	probes := e.outages.probes.Load()
	if got, want := runs.Load(), 3+1+probes+5; got > want {
		t.Errorf("handler runs %d, want at most %d (threshold + probes + the waiting messages once)", got, want)
	}
}

// A storm of messages that each fail once and then succeed is no outage: their retries
// succeed.
func TestOutageNotFromMessagesThatFailOnce(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 3}}, b)
	fails := func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get(keys.Attempt) == "" {
			return nil, errors.New("first time fails")
		}
		return nil, nil
	}
	mw := e.Middleware(fails)
	for round := range 5 {
		for i := range 100 { // every first delivery of the round fails
			if _, err := mw(attemptMsg("m"+strconv.Itoa(round*100+i), 1)); err != nil {
				t.Fatal(err)
			}
		}
		for i := range 100 { // then their retries succeed
			if _, err := mw(attemptMsg("m"+strconv.Itoa(round*100+i), 2)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if e.outages.of("work").isDown.Load() || e.outages.started.Load() != 0 {
		t.Fatal("a storm of messages that fail once began an outage")
	}
	if got := len(b.msgs()); got != 500 {
		t.Errorf("parked %d, want 500 (one retry each)", got)
	}
}

// A flaky dependency (one run in five fails, retries included) begins no outage.
func TestOutageNotFromAFlakyFifth(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 5}}, b)
	rng := rand.New(rand.NewPCG(1, 2))
	attempts := map[string]int{}
	h := func(*message.Message) ([]*message.Message, error) {
		if rng.IntN(5) == 0 {
			return nil, errors.New("flaky")
		}
		return nil, nil
	}
	mw := e.Middleware(h)
	for i := range 5000 {
		id := "m" + strconv.Itoa(i%400)
		attempts[id]++
		if _, err := mw(attemptMsg(id, attempts[id])); err != nil {
			t.Fatal(err)
		}
	}
	if n := e.outages.started.Load(); n != 0 {
		t.Fatalf("a flaky fifth began %d outages", n)
	}
}

// An error marked Unavailable, and an open CircuitBreaker's refusal, begin an outage at
// once; Permanent never counts.
func TestOutageAtOnce(t *testing.T) {
	breaker := wmiddleware.NewCircuitBreaker(gobreaker.Settings{
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= 1 },
		Timeout:     time.Hour,
	})
	for name, h := range map[string]message.HandlerFunc{
		"Unavailable": failing(amqpretry.Unavailable(errors.New("database down"))),
		"CircuitBreaker": breaker.Middleware(func(*message.Message) ([]*message.Message, error) {
			return nil, errors.New("database down") // trips the breaker: the next runs get ErrOpenState
		}),
	} {
		t.Run(name, func(t *testing.T) {
			b := &fakeBackend{}
			e, _ := newEngine(t, amqpretry.Config{Outage: amqpretry.Outage{ProbeInterval: time.Hour, MaxProbeInterval: time.Hour}}, b)
			mw := e.Middleware(h)
			if name == "CircuitBreaker" { // its first failure is a plain error
				if _, err := mw(attemptMsg("first", 1)); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithCancel(context.Background())
			msg := attemptMsg("m", 1)
			msg.SetContext(ctx)
			done := make(chan error, 1)
			go func() {
				_, err := mw(msg)
				done <- err
			}()
			waitFor(t, "the outage", func() bool { return e.outages.of("work").isDown.Load() })
			cancel() // its subscriber closes: the message goes back to the broker
			err := <-done
			if !errors.Is(err, amqpretry.ErrHandoff) {
				t.Errorf("a waiting message whose subscriber closed: %v, want ErrHandoff (nacked for redelivery)", err)
			}
		})
	}
	t.Run("Permanent", func(t *testing.T) {
		b := &fakeBackend{}
		e, poison := newEngine(t, amqpretry.Config{Outage: amqpretry.Outage{Consecutive: 1}}, b)
		mw := e.Middleware(failing(amqpretry.Permanent(errors.New("malformed"))))
		for i := range 20 {
			if _, err := mw(attemptMsg("p"+strconv.Itoa(i), 3)); err != nil {
				t.Fatal(err)
			}
		}
		if e.outages.started.Load() != 0 || len(poison.got()) != 20 {
			t.Errorf("outages %d, poisoned %d; want 0 and 20", e.outages.started.Load(), len(poison.got()))
		}
	})
}

// Close during an outage gives every waiting message back for redelivery, promptly.
func TestOutageCloseGivesBack(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Outage: amqpretry.Outage{ProbeInterval: time.Hour, MaxProbeInterval: time.Hour}}, b)
	mw := e.Middleware(failing(amqpretry.Unavailable(errors.New("down"))))
	done := make(chan error, 3)
	for i := range 3 {
		go func() {
			_, err := mw(hurriedAt("m" + strconv.Itoa(i)))
			done <- err
		}()
	}
	waitFor(t, "the outage", func() bool { return e.outages.of("work").isDown.Load() })
	e.life.close()
	for range 3 {
		if err := <-done; !errors.Is(err, amqpretry.ErrHandoff) {
			t.Errorf("after Close: %v, want ErrHandoff (nacked for redelivery)", err)
		}
	}
	if got := len(b.msgs()); got != 0 {
		t.Errorf("parked %d, want none", got)
	}
}

// hurriedAt is a first delivery whose pauses end at once: its context is done only
// for the pause after Close (refuseClosed), not while it waits in the outage.
func hurriedAt(uuid string) *message.Message {
	return attemptMsg(uuid, 1)
}

// Outage.Off: every failure takes the retry path.
func TestOutageOff(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Outage: amqpretry.Outage{Off: true}}, b)
	mw := e.Middleware(failing(amqpretry.Unavailable(errors.New("down"))))
	for i := range 10 {
		if _, err := mw(attemptMsg("m"+strconv.Itoa(i), 2)); err != nil {
			t.Fatal(err)
		}
	}
	if e.outages != nil || len(b.msgs()) != 10 {
		t.Errorf("outages %v, parked %d; want no detection and 10 retries", e.outages, len(b.msgs()))
	}
}

// A message that fails for reasons of its own, seen as an outage (its retries fail too,
// and nothing else runs on one consumer), fails three probes, then takes the retry
// path: the next message probes, succeeds and ends the outage. It never blocks the queue.
func TestOutageBadMessageNeverHoldsTheQueue(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{
		Policy: amqpretry.Policy{MaxAttempts: 5},
		Outage: amqpretry.Outage{Consecutive: 2, ProbeInterval: time.Millisecond, MaxProbeInterval: time.Hour}, // a fourth probe would wait 8ms, a twentieth ten minutes
	}, b)
	h := func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID != "good" {
			return nil, errors.New("the order references a deleted customer")
		}
		return nil, nil
	}
	mw := e.Middleware(h)
	if _, err := mw(attemptMsg("bad-1", 1)); err != nil { // a retry is parked
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { // another's retry fails: 2 messages in a row with a retry, an outage
		_, err := mw(attemptMsg("bad-2", 2))
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the bad message after its failed probes: %v, want its retry handed off", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the bad message blocked its queue: it probed for ever")
	}
	if got := e.outages.probes.Load(); got != probesPerMessage {
		t.Errorf("probes %d, want %d", got, probesPerMessage)
	}
	if got := len(b.msgs()); got != 2 {
		t.Errorf("parked %d, want 2: the first retry, and the one after its failed probes", got)
	}
	if _, err := mw(attemptMsg("good", 1)); err != nil { // the next message probes and succeeds
		t.Fatal(err)
	}
	if e.outages.of("work").isDown.Load() {
		t.Error("still down after the good message succeeded")
	}
}

// Issue 41's scenario on the memory backend, in one process on Watermill's GoChannel:
// a batch while the dependency is up (one in 25 Permanent, one in 5 failing once: no
// outage), a batch while it is down (first attempts fail and are retried until a retry
// fails: the outage begins), a batch while in the outage (they wait), then the
// dependency returns. Only the Permanent messages are poisoned, every other one is
// handled, and while in the outage the handler runs only as a failed probe.
func TestOutageOnTheMemoryBackend(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1000}, watermill.NopLogger{})
	defer pubsub.Close()
	var down, started atomic.Bool
	var runsDown, runsDownBefore atomic.Int64
	rec := &outageRecorder{}
	retry, err := New(amqpretry.Config{
		Backend: delay.Memory{Publisher: pubsub},
		Policy:  amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{20 * time.Millisecond}},
		Outage:  amqpretry.Outage{ProbeInterval: 5 * time.Millisecond, MaxProbeInterval: 20 * time.Millisecond},
		Observe: func(ev amqpretry.Event) {
			if ev.Kind == amqpretry.EventOutageStarted {
				started.Store(true)
			}
			rec.observe(ev)
		},
	}, Transport{})
	if err != nil {
		t.Fatal(err)
	}
	defer retry.Close()
	poisonCh, err := pubsub.Subscribe(context.Background(), retry.r.cfg.PoisonQueue)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	succeeded := map[string]bool{}
	failedOnce := map[string]bool{}
	handle := func(msg *message.Message) error {
		i, _ := strconv.Atoi(msg.UUID[1:])
		if i%25 == 0 {
			return amqpretry.Permanent(errors.New("malformed"))
		}
		if down.Load() {
			runsDown.Add(1)
			if !started.Load() {
				runsDownBefore.Add(1)
			}
			return errDependencyDown
		}
		mu.Lock()
		defer mu.Unlock()
		if i%5 == 1 && !failedOnce[msg.UUID] {
			failedOnce[msg.UUID] = true
			return errors.New("flaky downstream")
		}
		succeeded[msg.UUID] = true
		return nil
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("bookings", "work", pubsub, handle).AddMiddleware(retry.Middleware)
	go func() { _ = router.Run(context.Background()) }()
	defer router.Close()
	<-router.Running()

	const batch = 25
	good := 0
	publish := func(from int) {
		for i := from; i < from+batch; i++ {
			if i%25 != 0 {
				good++
			}
			if err := pubsub.Publish("work", message.NewMessage(fmt.Sprintf("m%03d", i), nil)); err != nil {
				t.Fatal(err)
			}
		}
	}
	handled := func(n int) func() bool {
		return func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(succeeded) == n
		}
	}
	publish(0) // up: the fail-once fifth is retried, and begins no outage
	waitFor(t, "the first batch handled", handled(good))
	if n := retry.Stats().Outages; n != 0 {
		t.Fatalf("%d outages while the dependency is up", n)
	}
	down.Store(true)
	publish(batch) // down: first attempts fail, until a retry fails too
	waitFor(t, "the outage to begin", started.Load)
	publish(2 * batch) // in the outage: they wait
	waitFor(t, "three failed probes", func() bool { return retry.Stats().Probes >= 3 })
	down.Store(false)
	waitFor(t, "every good message handled", handled(good))

	perm := 3 // m000, m025, m050
	for range perm {
		select {
		case msg := <-poisonCh:
			msg.Ack()
			if i, _ := strconv.Atoi(msg.UUID[1:]); i%25 != 0 || ReadEnvelope(msg.Metadata).Reason != amqpretry.ReasonPermanent {
				t.Errorf("poisoned %s for %s: only the Permanent ones may be", msg.UUID, ReadEnvelope(msg.Metadata).Reason)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the Permanent messages not poisoned within 10 s")
		}
	}
	st := retry.Stats()
	if st.Poisoned != int64(perm) || st.Outages != 1 || st.InOutage != 0 {
		t.Errorf("stats %+v: want the %d Permanent ones poisoned and one outage, over", st, perm)
	}
	failedProbes := int64(0)
	rec.mu.Lock()
	for _, ev := range rec.events {
		if ev.Kind == amqpretry.EventProbe && errors.Is(ev.Err, errDependencyDown) { // not a Permanent one's
			failedProbes++
		}
	}
	rec.mu.Unlock()
	// Before the outage: the down batch's first attempts (those not Permanent) and
	// the retry that tripped it; in the outage: the failed probes only.
	if before := runsDownBefore.Load(); before > batch-1+1 {
		t.Errorf("handler ran %d times while down before the outage began, want at most the %d first attempts and the retry that began it", before, batch-1)
	}
	if in := runsDown.Load() - runsDownBefore.Load(); in != failedProbes {
		t.Errorf("handler ran %d times while down in the outage, want the %d failed probes", in, failedProbes)
	}
}

var errDependencyDown = errors.New("dial tcp 10.0.0.5:5432: connection refused")

// A few messages that fail attempt after attempt on an otherwise idle queue are
// poisons, not an outage, however many failures in a row they make: an outage needs
// the failures of Consecutive different messages (in a row, or over the Window). Each
// is poisoned at its last attempt; none waits.
func TestOutageNotFromAFewPoisonMessages(t *testing.T) {
	for _, tc := range []struct {
		name   string
		outage amqpretry.Outage
		ok     bool // a good message between the rounds: no failures in a row
	}{
		{"in a row", amqpretry.Outage{Consecutive: 4, Ratio: 1, Window: 1000}, false},
		{"over the window", amqpretry.Outage{Consecutive: 4, Ratio: 0.5, Window: 8}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &fakeBackend{}
			e, poison := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 20}, Outage: tc.outage}, b)
			mw := e.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if msg.UUID == "ok" {
					return nil, nil
				}
				return nil, errors.New("missing customer id")
			})
			// Three messages, each failing its 20 attempts, taking turns: 60
			// failures, retries among them, of 3 different messages; in a row, or
			// three in four runs.
			// A deadline for each: a message taken for an outage would wait forever.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			for attempt := 1; attempt <= 20; attempt++ {
				for _, id := range []string{"a", "b", "c"} {
					msg := attemptMsg(id, attempt)
					msg.SetContext(ctx)
					if _, err := mw(msg); err != nil {
						t.Fatalf("%s on attempt %d: %v", id, attempt, err)
					}
				}
				if tc.ok {
					if _, err := mw(attemptMsg("ok", 1)); err != nil {
						t.Fatal(err)
					}
				}
			}
			if n := e.outages.started.Load(); n != 0 {
				t.Errorf("three poison messages began %d outages", n)
			}
			if got := len(poison.got()); got != 3 {
				t.Errorf("poisoned %d, want the 3 at their last attempt", got)
			}
			// A fourth message failing on its first delivery makes it Consecutive
			// different ones, new messages failing as well as retries: now it is an
			// outage.
			dctx, dcancel := context.WithCancel(context.Background())
			msg := attemptMsg("d", 1)
			msg.SetContext(dctx)
			done := make(chan error, 1)
			go func() {
				_, err := mw(msg)
				done <- err
			}()
			waitFor(t, "the outage", func() bool { return e.outages.of("work").isDown.Load() })
			dcancel()
			if err := <-done; !errors.Is(err, amqpretry.ErrHandoff) {
				t.Errorf("the waiting message whose subscriber closed: %v, want ErrHandoff", err)
			}
		})
	}
}

// The failures of an outage are its own: once it ends, the next outage is judged on
// the runs after it. Here failures of many messages fill the ratio's window while the
// queue is down; after the first success, one message failing once must be retried as
// usual, not begin a second outage on the first one's failures.
func TestOutageEndForgetsItsFailures(t *testing.T) {
	q := newOutages(amqpretry.Outage{Consecutive: 1000, Ratio: 0.8, Window: 10, ProbeInterval: time.Hour, MaxProbeInterval: time.Hour}).of("work")
	now := time.Now()
	down := &amqpretry.Decision{Unavailable: true}
	plain := &amqpretry.Decision{}
	if wait, ed, _, _ := q.record("m0", errors.New("connection refused"), down, 2, 3, 0, now); !wait || ed != started {
		t.Fatalf("Unavailable: wait %v, edge %v; want an outage begun", wait, ed)
	}
	for i := 1; i < 10; i++ { // the window fills with failures of other messages, first deliveries and retries
		if wait, _, _, _ := q.record("m"+strconv.Itoa(i), errors.New("connection refused"), plain, 1+i%2, 3, 0, now); !wait {
			t.Fatalf("failure %d while down: the message does not wait", i)
		}
	}
	if _, ed, _, _ := q.record("m1", nil, nil, 2, 3, 0, now); ed != ended {
		t.Fatalf("a success: edge %v, want the outage ended", ed)
	}
	if wait, ed, _, _ := q.record("flaky", errors.New("deadlock detected"), plain, 2, 3, 0, now); wait || ed != noEdge {
		t.Errorf("one failure after the outage: wait %v, edge %v; want it retried as usual, no second outage on the first one's failures", wait, ed)
	}
}

// Retryable says no to a dependency that is down while outage detection is on: the
// outage deals with it, not Watermill's in-process Retry.
func TestOutageRetryableRefusesUnavailable(t *testing.T) {
	down := amqpretry.Unavailable(errors.New("connection refused"))
	on, _ := newEngine(t, amqpretry.Config{}, &fakeBackend{})
	if on.Retryable(down) {
		t.Error("Retryable(Unavailable) with outage detection on: true, want false")
	}
	if !on.Retryable(errors.New("deadlock")) {
		t.Error("Retryable(a plain error): false, want true")
	}
	off, _ := newEngine(t, amqpretry.Config{Outage: amqpretry.Outage{Off: true}}, &fakeBackend{})
	if !off.Retryable(down) {
		t.Error("Retryable(Unavailable) with outage detection off: false, want true (a plain failure then)")
	}
}

// A wave of retries that fail again (messages that fail twice), with no first delivery
// failing, is not an outage: new messages do not fail.
func TestOutageNotFromRetriesAlone(t *testing.T) {
	q := newOutages(amqpretry.Config{}.WithDefaults().Outage).of("work")
	now := time.Now()
	for i := range 200 {
		if wait, ed, _, _ := q.record("m"+strconv.Itoa(i), errors.New("fails twice"), &amqpretry.Decision{}, 2, 3, 0, now); wait || ed != noEdge {
			t.Fatalf("retry %d failing again began an outage", i)
		}
	}
	// One first delivery failing among them completes the rule.
	if wait, ed, _, _ := q.record("new", errors.New("connection refused"), &amqpretry.Decision{}, 1, 3, 0, now); !wait || ed != started {
		t.Errorf("a first delivery failing too: wait %v, edge %v; want the outage begun", wait, ed)
	}
}
