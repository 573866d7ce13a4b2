package middleware

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/sony/gobreaker"

	"github.com/amqpretry/amqpretry"
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

// waitFor polls cond until it holds, or fails the test after a deadline.
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
	if got := len(b.msgs()); got != 3 || e.outages.of("work").isDown() {
		t.Fatalf("after 3 first-attempt failures: %d parked, down %v; want 3 parked and no outage", got, e.outages.of("work").isDown())
	}
	// A retry fails: 4 in a row with a retry among them. The message waits.
	done := make(chan error, 1)
	go func() {
		_, err := mw(attemptMsg("retry", 2))
		done <- err
	}()
	waitFor(t, "the outage to begin", func() bool { return e.outages.of("work").isDown() })
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
	if got := len(b.msgs()); got != 3 {
		t.Errorf("parked %d while down, want none beyond the 3 before the outage", got)
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
	if e.outages.of("work").isDown() {
		t.Error("still down after a success")
	}
	if len(poison.got()) != 0 || len(b.msgs()) != 3 {
		t.Errorf("poisoned %d, parked %d; want 0 and 3", len(poison.got()), len(b.msgs()))
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
	if e.outages.of("work").isDown() || e.outages.started.Load() != 0 {
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
			waitFor(t, "the outage", func() bool { return e.outages.of("work").isDown() })
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
	waitFor(t, "the outage", func() bool { return e.outages.of("work").isDown() })
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

// The failures of an outage are its own: once it ends, the next outage is judged on
// the runs after it. Here the failed probes fill the ratio's window; after the first
// success one message failing once (a first delivery) must be retried as usual, not
// begin a second outage on the first one's failures.
func TestOutageEndForgetsItsFailures(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{
		Policy: amqpretry.Policy{MaxAttempts: 3},
		Outage: amqpretry.Outage{Consecutive: 1000, Ratio: 0.8, Window: 10, ProbeInterval: time.Millisecond, MaxProbeInterval: time.Millisecond},
	}, b)
	var down atomic.Bool
	down.Store(true)
	var flaky atomic.Int64
	h := func(msg *message.Message) ([]*message.Message, error) {
		switch {
		case msg.UUID == "flaky" && flaky.Add(1) == 1:
			return nil, errors.New("deadlock detected")
		case msg.UUID == "flaky":
			return nil, nil
		case down.Load():
			return nil, amqpretry.Unavailable(errors.New("connection refused"))
		}
		return nil, nil
	}
	mw := e.Middleware(h)
	done := make(chan error, 1)
	go func() { // a retry: the outage begins at once, and it probes
		_, err := mw(attemptMsg("retry", 2))
		done <- err
	}()
	q := e.outages.of("work")
	waitFor(t, "the window full of failed probes", func() bool {
		q.mu.Lock()
		defer q.mu.Unlock()
		return q.filled == len(q.runs) && q.failures == len(q.runs)
	})
	down.Store(false)
	if err := <-done; err != nil {
		t.Fatalf("the waiting message: %v, want success once a probe succeeds", err)
	}
	if q.isDown() {
		t.Fatal("still down after a success")
	}
	if _, err := mw(attemptMsg("flaky", 1)); err != nil {
		t.Fatal(err)
	}
	if n := e.outages.started.Load(); n != 1 {
		t.Errorf("outages begun: %d, want 1: one failure after the outage began another on the first one's failures", n)
	}
	if got := len(b.msgs()); got != 1 {
		t.Errorf("parked %d, want 1: the failure after the outage is retried", got)
	}
}
