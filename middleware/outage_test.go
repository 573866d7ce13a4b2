package middleware

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
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
// fails too and Consecutive first deliveries failed, the queue is in an outage. The
// failure that began it took the retry path (its run was an attempt); the messages that
// arrive wait, before the handler; probes run one at a time, each failed one taking the
// retry path in turn; the first success ends the outage and lets every waiting message
// run. No delivery runs the handler more than once.
func TestOutageBeginsProbesAndEnds(t *testing.T) {
	b := &fakeBackend{}
	rec := &outageRecorder{}
	e, poison := newEngine(t, amqpretry.Config{
		Policy:  amqpretry.Policy{MaxAttempts: 3},
		Outage:  amqpretry.Outage{Consecutive: 3, ProbeInterval: 5 * time.Millisecond},
		Observe: rec.observe,
	}, b)
	var down atomic.Bool
	down.Store(true)
	var mu sync.Mutex
	runs := map[string]int{} // "uuid attempt": runs
	h := func(msg *message.Message) ([]*message.Message, error) {
		mu.Lock()
		runs[msg.UUID+" "+strconv.Itoa(amqpretry.Attempt(msg))]++
		mu.Unlock()
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
	// A retry fails: 3 first deliveries failed in a row, and a retry. It takes the
	// retry path, as any failure.
	if _, err := mw(attemptMsg("retry", 2)); err != nil {
		t.Fatal(err)
	}
	if !e.outages.of("work").isDown.Load() || len(b.msgs()) != 4 {
		t.Fatalf("after the retry failed: down %v, parked %d; want the outage begun and its retry parked", e.outages.of("work").isDown.Load(), len(b.msgs()))
	}
	// More messages arrive while down: they wait, before the handler.
	others := make(chan error, 5)
	for i := range 5 {
		go func() {
			_, err := mw(attemptMsg("later-"+strconv.Itoa(i), 1))
			others <- err
		}()
	}
	waitFor(t, "two probes", func() bool { return e.outages.probes.Load() >= 2 })
	down.Store(false)
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
	// Each failed probe took the retry path: parked, the 4 before, and one per
	// failed probe.
	failed := 0
	rec.mu.Lock()
	for _, ev := range rec.events {
		if ev.Kind == amqpretry.EventProbe && ev.Err != nil {
			failed++
		}
	}
	rec.mu.Unlock()
	if got := len(b.msgs()); got != 4+failed {
		t.Errorf("parked %d, want %d: the 4 before the outage and one per failed probe", got, 4+failed)
	}
	mu.Lock()
	defer mu.Unlock()
	for k, n := range runs {
		if n != 1 {
			t.Errorf("%s ran %d times, want once: a run is an attempt", k, n)
		}
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
// once; the message that failed takes the retry path, the next one waits. Permanent
// never counts.
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
			e, _ := newEngine(t, amqpretry.Config{Outage: amqpretry.Outage{ProbeInterval: time.Hour}}, b)
			mw := e.Middleware(h)
			if name == "CircuitBreaker" { // its first failure is a plain error
				if _, err := mw(attemptMsg("first", 1)); err != nil {
					t.Fatal(err)
				}
				if e.outages.of("work").isDown.Load() {
					t.Fatal("a plain error began an outage")
				}
			}
			if _, err := mw(attemptMsg("m", 1)); err != nil {
				t.Fatal(err)
			}
			if !e.outages.of("work").isDown.Load() {
				t.Fatal("no outage after the first Unavailable failure")
			}
			ctx, cancel := context.WithCancel(context.Background())
			msg := attemptMsg("n", 1)
			msg.SetContext(ctx)
			done := make(chan error, 1)
			go func() {
				_, err := mw(msg)
				done <- err
			}()
			waitFor(t, "the next message to wait", func() bool { return waiting(e.outages.of("work")) == 1 })
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

// waiting counts the messages waiting in q's outage.
func waiting(q *outage) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiting)
}

// Close during an outage gives every waiting message back for redelivery, promptly;
// none of them ran.
func TestOutageCloseGivesBack(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Outage: amqpretry.Outage{ProbeInterval: time.Hour}}, b)
	var runs atomic.Int64
	mw := e.Middleware(func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, amqpretry.Unavailable(errors.New("down"))
	})
	if _, err := mw(hurriedAt("first")); err != nil { // begins the outage, and is retried
		t.Fatal(err)
	}
	done := make(chan error, 3)
	for i := range 3 {
		go func() {
			_, err := mw(hurriedAt("m" + strconv.Itoa(i)))
			done <- err
		}()
	}
	waitFor(t, "three waiting", func() bool { return waiting(e.outages.of("work")) == 3 })
	e.life.close()
	for range 3 {
		if err := <-done; !errors.Is(err, amqpretry.ErrHandoff) {
			t.Errorf("after Close: %v, want ErrHandoff (nacked for redelivery)", err)
		}
	}
	if got, n := len(b.msgs()), runs.Load(); got != 1 || n != 1 {
		t.Errorf("parked %d, handler runs %d; want 1 and 1, the message that began the outage", got, n)
	}
}

// hurriedAt is a first delivery whose pauses end at once: its context is done only
// for the pause after Close (refuseClosed), not while it waits in the outage.
func hurriedAt(uuid string) *message.Message {
	return attemptMsg(uuid, 1)
}

// Detection off (a negative Outage.Consecutive): every failure takes the retry path.
func TestOutageOff(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Outage: amqpretry.Outage{Consecutive: -1}}, b)
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

// A message that fails for reasons of its own, seen as an outage, never holds its
// queue: it takes the retry path at once (its run was an attempt), and so does its
// failed probe; the next probe is another message, which succeeds and ends the
// outage: at the second probe.
func TestOutageBadMessageNeverHoldsTheQueue(t *testing.T) {
	b := &fakeBackend{}
	rec := &outageRecorder{}
	e, _ := newEngine(t, amqpretry.Config{
		Policy:  amqpretry.Policy{MaxAttempts: 5},
		Outage:  amqpretry.Outage{Consecutive: 2, ProbeInterval: time.Hour},
		Observe: rec.observe,
	}, b)
	var mu sync.Mutex
	ran := map[string][]int{}
	h := func(msg *message.Message) ([]*message.Message, error) {
		mu.Lock()
		ran[msg.UUID] = append(ran[msg.UUID], amqpretry.Attempt(msg))
		mu.Unlock()
		if msg.UUID != "good" {
			return nil, errors.New("the order references a deleted customer")
		}
		return nil, nil
	}
	mw := e.Middleware(h)
	for _, m := range []*message.Message{attemptMsg("bad-1", 1), attemptMsg("bad-2", 1), attemptMsg("bad-1", 2)} {
		if _, err := mw(m); err != nil { // each failure parked, the third begins the outage
			t.Fatal(err)
		}
	}
	q := e.outages.of("work")
	if !q.isDown.Load() || len(b.msgs()) != 3 {
		t.Fatalf("down %v, parked %d; want an outage, and the 3 failures parked", q.isDown.Load(), len(b.msgs()))
	}
	// bad-2's retry arrives first, then good's (it failed once, for a reason that
	// has passed): bad-2 probes, fails and is parked; good probes next and ends the
	// outage.
	done := make(chan error, 2)
	go func() { _, err := mw(attemptMsg("bad-2", 2)); done <- err }()
	waitFor(t, "bad-2 waiting", func() bool { return waiting(q) == 1 })
	go func() { _, err := mw(attemptMsg("good", 2)); done <- err }()
	waitFor(t, "good waiting", func() bool { return waiting(q) == 2 })
	probeNow(q)
	if err := <-done; err != nil {
		t.Fatalf("the bad message after its failed probe: %v, want its retry handed off", err)
	}
	waitFor(t, "the failed probe recorded", func() bool { return e.outages.probes.Load() == 1 })
	probeNow(q)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if q.isDown.Load() {
		t.Error("still down after the good message succeeded")
	}
	if got := len(b.msgs()); got != 4 {
		t.Errorf("parked %d, want 4: the 3 failures and the failed probe", got)
	}
	if got := probeErrs(rec); len(got) != 2 || got[0] == nil || got[1] != nil {
		t.Errorf("probes %v, want a failed one, then a success", got)
	}
	mu.Lock()
	defer mu.Unlock()
	want := map[string][]int{"bad-1": {1, 2}, "bad-2": {1, 2}, "good": {2}}
	for id, a := range want {
		if !slices.Equal(ran[id], a) {
			t.Errorf("%s ran on attempts %v, want %v: once per attempt", id, ran[id], a)
		}
	}
}

// probeNow makes q's next probe due now, and wakes its waiting messages.
func probeNow(q *outage) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.nextProbe = time.Now()
	q.signal()
}

// probeErrs lists the errors of rec's probes, in order.
func probeErrs(rec *outageRecorder) []error {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var out []error
	for _, ev := range rec.events {
		if ev.Kind == amqpretry.EventProbe {
			out = append(out, ev.Err)
		}
	}
	return out
}

// Issue 41's scenario on the memory backend, in one process on Watermill's GoChannel:
// a batch while the dependency is up (one in 25 Permanent, one in 5 failing once: no
// outage), a batch while it is down (first attempts fail and are retried until a retry
// fails: the outage begins), a batch while in the outage (they wait), then the
// dependency returns. Only the Permanent messages are poisoned, every other one is
// handled, and while in the outage the handler runs only as a failed probe. A message
// runs once per attempt: those that failed while the dependency was down spent those
// attempts (MaxAttempts 4 leaves a fail-once message one to spare after two of them).
func TestOutageOnTheMemoryBackend(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1000}, watermill.NopLogger{})
	defer pubsub.Close()
	var down, started atomic.Bool
	var runsDown, runsDownBefore atomic.Int64
	rec := &outageRecorder{}
	retry, err := New(amqpretry.Config{
		Backend: delay.Memory(pubsub),
		Policy:  amqpretry.Policy{MaxAttempts: 4, Delays: []time.Duration{20 * time.Millisecond}, Jitter: -1},
		Outage:  amqpretry.Outage{ProbeInterval: 5 * time.Millisecond},
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
	var mu, ranMu sync.Mutex
	succeeded := map[string]bool{}
	failedOnce := map[string]bool{}
	ran := map[string][]int{} // the attempts each message ran on
	handle := func(msg *message.Message) error {
		ranMu.Lock()
		ran[msg.UUID] = append(ran[msg.UUID], amqpretry.Attempt(msg))
		ranMu.Unlock()
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
	// their retries, at most one each (GoChannel hands its subscriber the messages in
	// the order their sending goroutines take its lock, not in publish order, so a retry
	// can fail before the rule's run of first deliveries is complete, and begin nothing);
	// in the outage: the failed probes, and at most one delivery that passed the outage
	// check just before another's failure began the outage (seen 1 in 40 runs with -race).
	if before := runsDownBefore.Load(); before > 2*(batch-1) {
		t.Errorf("handler ran %d times while down before the outage began, want at most the %d first attempts and a retry of each", before, batch-1)
	}
	if in := runsDown.Load() - runsDownBefore.Load(); in < failedProbes || in > failedProbes+1 {
		t.Errorf("handler ran %d times while down in the outage, want the %d failed probes (and at most one delivery already past the outage check)", in, failedProbes)
	}
	ranMu.Lock()
	defer ranMu.Unlock()
	for id, attempts := range ran {
		for k, a := range attempts {
			if a != k+1 || a > 4 {
				t.Errorf("%s ran on attempts %v: once per attempt, at most MaxAttempts", id, attempts)
				break
			}
		}
	}
}

var errDependencyDown = errors.New("dial tcp 10.0.0.5:5432: connection refused")

// A few messages that fail attempt after attempt on an otherwise idle queue are
// poisons, not an outage, however many failures in a row they make: an outage needs
// Consecutive new messages to fail (in a row, or over the window). Each is poisoned at
// its last attempt; none waits. Then new messages fail too: that is an outage.
func TestOutageNotFromAFewPoisonMessages(t *testing.T) {
	for _, tc := range []struct {
		name   string
		outage amqpretry.Outage
		ok     bool // a good message between the rounds: no failures in a row
	}{
		{"in a row", amqpretry.Outage{Consecutive: 4, Ratio: 1, ProbeInterval: time.Millisecond}, false},
		{"over the window", amqpretry.Outage{Consecutive: 4, Ratio: 0.5, ProbeInterval: time.Millisecond}, true},
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
			// New messages fail, after those retries: Consecutive new messages
			// failed (a, b, c's first deliveries among them in a row), or Ratio of
			// the window's first deliveries: now it is an outage, at the fourth.
			for i := range 4 {
				if _, err := mw(attemptMsg("d"+strconv.Itoa(i), 1)); err != nil {
					t.Fatal(err)
				}
			}
			if e.outages.started.Load() != 1 {
				t.Error("no outage after Consecutive new messages and retries failed")
			}
		})
	}
}

// The failures of an outage are its own: once it ends, the next outage is judged on
// the runs after it. Here failures of many messages fill the ratio's window while the
// queue is down; after the first success, one message failing once must be retried as
// usual, not begin a second outage on the first one's failures.
func TestOutageEndForgetsItsFailures(t *testing.T) {
	o := newOutages(amqpretry.Outage{Consecutive: 1000, Ratio: 0.8, ProbeInterval: time.Hour})
	o.window = 10 // a window the failures below fill, whatever Consecutive derives
	q := o.of("work")
	now := time.Now()
	down := &amqpretry.Decision{Unavailable: true}
	plain := &amqpretry.Decision{}
	if ed, _, _ := q.record("m0", errors.New("connection refused"), down, 2, 0, now); ed != started {
		t.Fatalf("Unavailable: edge %v; want an outage begun", ed)
	}
	for i := 1; i < 10; i++ { // the window fills with failures of other messages, first deliveries and retries
		if ed, _, _ := q.record("m"+strconv.Itoa(i), errors.New("connection refused"), plain, 1+i%2, 0, now); ed != noEdge || !q.isDown.Load() {
			t.Fatalf("failure %d while down: edge %v, down %v", i, ed, q.isDown.Load())
		}
	}
	if ed, _, _ := q.record("m1", nil, nil, 2, 0, now); ed != ended {
		t.Fatalf("a success: edge %v, want the outage ended", ed)
	}
	if ed, _, _ := q.record("flaky", errors.New("deadlock detected"), plain, 2, 0, now); ed != noEdge {
		t.Errorf("one failure after the outage: edge %v; want it retried as usual, no second outage on the first one's failures", ed)
	}
}

// Issue 49: a wave of retries that fail again (messages that fail their first two
// attempts), with a few first deliveries failing among them, is not an outage: most
// new messages succeed. It is one once Consecutive new messages fail in a row, and a
// retry; or, over the window, once Ratio of its first deliveries fail as well as Ratio
// of its runs.
func TestOutageNotFromRetriesAlone(t *testing.T) {
	q := newOutages(amqpretry.Config{}.WithDefaults().Outage).of("work")
	now := time.Now()
	plain := &amqpretry.Decision{}
	for i := range 600 {
		// Retries failing again; a new message one run in ten, two in three of
		// which succeed.
		attempt, err, dec := 2, errors.New("fails twice"), plain
		if i%10 == 9 {
			attempt = 1
			if i%30 != 29 {
				err, dec = nil, nil
			}
		}
		if ed, _, _ := q.record("m"+strconv.Itoa(i), err, dec, attempt, 0, now); ed != noEdge {
			t.Fatalf("retries failing again, and a third of the new messages, began an outage at run %d", i)
		}
	}
	q.record("ok", nil, nil, 1, 0, now) // the row starts again
	cons := q.cfg.Consecutive
	for i := range cons - 1 {
		if ed, _, _ := q.record("new"+strconv.Itoa(i), errors.New("connection refused"), plain, 1, 0, now); ed != noEdge {
			t.Fatalf("%d new messages failing, and no retry, began an outage", i+1)
		}
	}
	if ed, _, _ := q.record("old", errors.New("connection refused"), plain, 2, 0, now); ed != noEdge {
		t.Fatalf("%d new messages and a retry failing began an outage, want %d new ones", cons-1, cons)
	}
	if ed, _, _ := q.record("new", errors.New("connection refused"), plain, 1, 0, now); ed != started {
		t.Errorf("the %dth new message failing, after a retry: edge %v, want the outage begun", cons, ed)
	}
}

// The ratio rule: a dependency that fails most calls, not all, with successes breaking
// every row: it trips once Ratio of the window's runs, and of its first deliveries,
// failed; a window whose failures are mostly retries, with the new messages mostly
// succeeding, does not.
func TestOutageRatioNeedsNewMessagesToFail(t *testing.T) {
	cfg := amqpretry.Outage{Consecutive: 10, Ratio: 0.8}
	// 9 in 10 runs fail, new messages and retries alike.
	q := newOutages(cfg).of("work")
	now := time.Now()
	plain := &amqpretry.Decision{}
	tripped := -1
	for i := range 200 {
		var err error
		if i%10 != 9 {
			err = errors.New("connection refused")
		}
		dec := plain
		if err == nil {
			dec = nil
		}
		if ed, _, _ := q.record("m"+strconv.Itoa(i), err, dec, 1+i%2, 0, now); ed == started {
			tripped = i
			break
		}
	}
	if tripped < 0 {
		t.Error("a dependency failing 9 calls in 10 began no outage")
	}
	// 9 in 10 runs fail too, but they are retries of a few; the new messages, one in
	// ten runs, mostly succeed.
	q = newOutages(cfg).of("work")
	for i := range 2000 {
		attempt, fail := 2, true
		if i%10 == 9 {
			attempt, fail = 1, i%30 == 29 // a third of the new ones fail
		}
		var err error
		var dec *amqpretry.Decision
		if fail {
			err, dec = errors.New("fails twice"), plain
		}
		if ed, _, _ := q.record("r"+strconv.Itoa(i%7), err, dec, attempt, 0, now); ed == started {
			t.Fatalf("retries failing, new messages mostly succeeding, began an outage at run %d", i)
		}
	}
}

// Probes rotate: the next probe is the message with the most attempts left, of those
// the one that has waited longest, but never the latest probe's message while another
// waits.
func TestOutageProbesRotate(t *testing.T) {
	q := newOutages(amqpretry.Outage{Consecutive: 10, Ratio: 0.8, ProbeInterval: time.Hour}).of("work")
	now := time.Now()
	if ed, _, _ := q.record("t", errors.New("down"), &amqpretry.Decision{Unavailable: true}, 1, 0, now); ed != started {
		t.Fatal("no outage")
	}
	type probed struct {
		msg   string
		token uint64
	}
	got := make(chan probed, 8)
	closing := make(chan struct{})
	defer close(closing)
	wait := func(msg string, attempt int) {
		n := waiting(q)
		go func() {
			token, err := q.await(context.Background(), closing, msg, attempt)
			if err != nil {
				t.Error(err)
			}
			got <- probed{msg, token}
		}()
		waitFor(t, msg+" waiting", func() bool { return waiting(q) > n })
	}
	probe := func(want string) probed {
		t.Helper()
		probeNow(q)
		p := <-got
		if p.msg != want || p.token == 0 {
			t.Fatalf("probe %+v, want %s", p, want)
		}
		return p
	}
	fail := func(p probed) {
		q.record(p.msg, errors.New("down"), &amqpretry.Decision{}, 1, p.token, now)
	}
	// x and z are first deliveries, x waiting longest; y is a retry.
	wait("x", 1)
	wait("y", 2)
	wait("z", 1)
	fail(probe("x"))
	// x comes back (its retry) before the next probe: it was the latest probe.
	wait("x", 2)
	fail(probe("z"))
	// y and x are both on attempt 2: y waited longer.
	fail(probe("y"))
	// Only x is left: the latest probe was y's.
	p := probe("x")
	if ed, _, _ := q.record("x", nil, nil, 2, p.token, now); ed != ended {
		t.Errorf("a successful probe: edge %v, want the outage ended", ed)
	}
	// A message alone probes again: nothing else asks.
	if ed, _, _ := q.record("t", errors.New("down"), &amqpretry.Decision{Unavailable: true}, 1, 0, now); ed != started {
		t.Fatal("no second outage")
	}
	wait("x", 3)
	fail(probe("x"))
	wait("x", 4)
	probe("x")
}

// A message alone on its queue in a long outage: it begins the outage, then probes on
// each of its deliveries, alone; each run is an attempt, so it runs MaxAttempts times
// in all and is poisoned after the last, as without outage detection, never more.
func TestOutageRunsNoMoreThanMaxAttempts(t *testing.T) {
	b := &fakeBackend{}
	e, poison := newEngine(t, amqpretry.Config{
		Policy: amqpretry.Policy{MaxAttempts: 3},
		Outage: amqpretry.Outage{ProbeInterval: time.Hour},
	}, b)
	var runs atomic.Int64
	mw := e.Middleware(func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, amqpretry.Unavailable(errors.New("connection refused"))
	})
	if _, err := mw(attemptMsg("m", 1)); err != nil { // begins the outage, parked
		t.Fatal(err)
	}
	q := e.outages.of("work")
	for attempt := 2; attempt <= 3; attempt++ { // its retries: each waits, then probes
		done := make(chan error, 1)
		go func() { _, err := mw(attemptMsg("m", attempt)); done <- err }()
		waitFor(t, "the retry waiting", func() bool { return waiting(q) == 1 })
		probeNow(q)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if n, parked, poisoned := runs.Load(), len(b.msgs()), len(poison.got()); n != 3 || parked != 2 || poisoned != 1 {
		t.Errorf("runs %d, parked %d, poisoned %d; want 3 runs (MaxAttempts), 2 retries and the poisoning", n, parked, poisoned)
	}
	if !q.isDown.Load() || e.outages.probes.Load() != 2 {
		t.Errorf("down %v, probes %d; want still down, after 2 failed probes", q.isDown.Load(), e.outages.probes.Load())
	}
}
