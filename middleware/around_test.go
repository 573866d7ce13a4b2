package middleware

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

// What the Retry sees of Watermill's middlewares around it (around.go); the matrix on
// the broker is internal/testsupport/gluetest's MiddlewareMatrix.

// addHandler is h as a transport's AddHandler wires it under mw (the Retry's
// middleware): expectHandler just inside, then the middlewares inside, then h telling
// that it ran, and how it failed.
func addHandler(mw message.HandlerMiddleware, h message.HandlerFunc, inside ...message.HandlerMiddleware) message.HandlerFunc {
	ran := func(msg *message.Message) ([]*message.Message, error) {
		c, _ := msg.Context().Value(chainKey()).(*chain)
		if c != nil {
			c.HandlerRan()
		}
		produced, err := h(msg)
		if err != nil && c != nil {
			c.HandlerFailed(err)
		}
		return produced, err
	}
	for i := len(inside) - 1; i >= 0; i-- {
		ran = inside[i](ran)
	}
	return mw(func(msg *message.Message) ([]*message.Message, error) {
		msg.Context().Value(chainKey()).(*chain).ExpectHandler()
		return ran(msg)
	})
}

// saidOnce returns the lines logged with said=once.
func saidOnce(logs *watermill.CaptureLoggerAdapter) []watermill.CapturedMessage {
	var out []watermill.CapturedMessage
	for _, lines := range logs.Captured() {
		for _, l := range lines {
			if l.Fields["said"] == "once" {
				out = append(out, l)
			}
		}
	}
	return out
}

// TestDuplicatorOutsideHandsOffOnce: a delivery that a middleware outside the Retry
// runs through it again (Watermill's Duplicator) after the Retry handed it off or
// poisoned it is not handed off or poisoned again; one that succeeded runs again.
func TestDuplicatorOutsideHandsOffOnce(t *testing.T) {
	b := &fakeBackend{}
	e, poison := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 2}}, b)
	runs := map[string]int{}
	h := wmiddleware.Duplicator(e.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs[msg.UUID]++
		switch msg.UUID {
		case "fails":
			return nil, errFlaky
		case "bad":
			return nil, amqpretry.Permanent(errFlaky)
		}
		return nil, nil
	}))
	for _, id := range []string{"fails", "bad", "ok"} {
		if _, err := h(message.NewMessage(id, nil)); err != nil {
			t.Fatal(err)
		}
	}
	if len(b.msgs()) != 1 || len(poison.got()) != 1 || runs["fails"] != 1 || runs["bad"] != 1 || runs["ok"] != 2 {
		t.Errorf("%d retries, %d poisoned, runs %v; want 1 retry, 1 poisoned, the failures run once, the success twice", len(b.msgs()), len(poison.got()), runs)
	}
	// The retry is another delivery: it runs (twice, it succeeds), with a chain of its
	// own (in process a copy keeps its context).
	if c := b.msgs()[0].Context().Value(chainKey()); c != nil {
		t.Fatal("the retry's copy carries the failed delivery's chain")
	}
	delete(runs, "fails")
	if _, err := wmiddleware.Duplicator(e.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		runs[msg.UUID]++
		return nil, nil
	}))(b.msgs()[0]); err != nil {
		t.Fatal(err)
	}
	if runs["fails"] != 2 {
		t.Errorf("the retry ran %d times, want 2", runs["fails"])
	}
}

// TestInstantAckIsSaidOnceAndAFailedHandoffPoisons: a message acked before the Retry
// could settle it (Watermill's InstantAck, outside or inside) is said once at ERROR;
// its failed hand-off, which a nack could no longer undo, poisons it at once instead
// of losing it.
func TestInstantAckIsSaidOnceAndAFailedHandoffPoisons(t *testing.T) {
	for _, where := range []string{"outside", "inside"} {
		t.Run(where, func(t *testing.T) {
			logs := watermill.NewCaptureLogger()
			refuse := true
			b := &fakeBackend{park: func(*message.Message) error {
				if refuse {
					return errors.New("not confirmed")
				}
				return nil
			}}
			e, poison := newEngine(t, amqpretry.Config{Logger: logs}, b)
			h := wmiddleware.InstantAck(e.Middleware(failing(errFlaky)))
			if where == "inside" {
				h = e.Middleware(wmiddleware.InstantAck(failing(errFlaky)))
			}
			if _, err := h(hurried("a")); err != nil {
				t.Fatalf("the failed hand-off of an acked message returned %v, want it poisoned", err)
			}
			refuse = false
			if _, err := h(hurried("b")); err != nil {
				t.Fatal(err)
			}
			if got := poison.got(); len(got) != 1 || got[0].UUID != "a" || ReadEnvelope(got[0].Metadata).Reason != amqpretry.ReasonHandoffFailed {
				t.Errorf("poisoned %v, want a, handoff-failed", got)
			}
			if len(b.msgs()) != 1 {
				t.Errorf("%d retries, want b's", len(b.msgs()))
			}
			said := saidOnce(logs)
			if len(said) != 1 || !errors.Is(said[0].Err, errAckedEarly) || !strings.HasPrefix(said[0].Fields["middleware"].(string), where) {
				t.Errorf("said %v, want once that it was acked early, %s the Retry", said, where)
			}
		})
	}
	// Without it, a failed hand-off gives the message back (nacked), as ever.
	b := &fakeBackend{park: func(*message.Message) error { return errors.New("not confirmed") }}
	e, poison := newEngine(t, amqpretry.Config{}, b)
	if _, err := e.Middleware(failing(errFlaky))(hurried("c")); !errors.Is(err, amqpretry.ErrHandoff) || len(poison.got()) != 0 {
		t.Errorf("returned %v, poisoned %d; want ErrHandoff, nothing poisoned", err, len(poison.got()))
	}
}

// TestPoisonQueueInsideIsSaidOnce: Watermill's PoisonQueue inside the Retry takes a
// failure and returns success: said once at ERROR. IgnoreErrors, which does the same
// for the errors it is given, is not.
func TestPoisonQueueInsideIsSaidOnce(t *testing.T) {
	if reasonPoisoned != wmiddleware.ReasonForPoisonedKey {
		t.Fatalf("reasonPoisoned is %q, Watermill's key %q", reasonPoisoned, wmiddleware.ReasonForPoisonedKey)
	}
	logs := watermill.NewCaptureLogger()
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Logger: logs}, b)
	ignore := wmiddleware.NewIgnoreErrors([]error{errFlaky}).Middleware
	h := addHandler(e.Middleware, failing(errFlaky), ignore)
	if _, err := h(message.NewMessage("ignored", nil)); err != nil {
		t.Fatal(err)
	}
	if said := saidOnce(logs); len(said) != 0 {
		t.Fatalf("IgnoreErrors: said %v", said)
	}
	rec := brokertest.NewRecorder(10)
	pq, err := wmiddleware.PoisonQueue(rec, "their-poison")
	if err != nil {
		t.Fatal(err)
	}
	h = addHandler(e.Middleware, failing(errFlaky), pq)
	for _, id := range []string{"a", "b"} {
		if _, err := h(message.NewMessage(id, nil)); err != nil {
			t.Fatal(err)
		}
	}
	said := saidOnce(logs)
	if len(said) != 1 || !strings.Contains(said[0].Msg, "PoisonQueue") || !strings.Contains(said[0].Err.Error(), `"poison"`) {
		t.Errorf("said %v, want once that PoisonQueue took a failure, naming the Retry's poison queue", said)
	}
	if len(b.msgs()) != 0 {
		t.Errorf("%d retries: the Retry saw a failure", len(b.msgs()))
	}
}

// TestRerunAfterPermanentIsSaidOnce: Watermill's Retry inside the Retry, without
// ShouldRetry, runs the handler again after a Permanent error: said once at WARN (here
// at ERROR: the logger has no WARN). Outside, it runs the Retry again after a failed
// hand-off, which is not said.
func TestRerunAfterPermanentIsSaidOnce(t *testing.T) {
	for _, tt := range []struct {
		name  string
		wire  func(e *engine, h message.HandlerFunc) message.HandlerFunc
		park  error
		ids   []string
		wantN int
	}{
		{"inside", func(e *engine, h message.HandlerFunc) message.HandlerFunc {
			return addHandler(e.Middleware, h, wmiddleware.Retry{MaxRetries: 2}.Middleware)
		}, nil, []string{"bad", "slow", "bad2"}, 1},
		{"outside, a failed hand-off", func(e *engine, h message.HandlerFunc) message.HandlerFunc {
			return wmiddleware.Retry{MaxRetries: 2}.Middleware(addHandler(e.Middleware, h))
		}, errors.New("not confirmed"), []string{"slow"}, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			logs := watermill.NewCaptureLogger()
			b := &fakeBackend{park: func(*message.Message) error { return tt.park }}
			e, _ := newEngine(t, amqpretry.Config{Logger: logs}, b)
			h := tt.wire(e, func(msg *message.Message) ([]*message.Message, error) {
				if msg.UUID == "slow" {
					return nil, amqpretry.RetryAfter(errFlaky, time.Minute)
				}
				return nil, amqpretry.Permanent(errFlaky)
			})
			// Not hurried: Watermill's Retry runs nothing again once the context is done.
			for _, id := range tt.ids {
				_, _ = h(message.NewMessage(id, nil))
			}
			if said := saidOnce(logs); len(said) != tt.wantN || tt.wantN == 1 && !strings.Contains(said[0].Err.Error(), "Policy.Immediate") {
				t.Errorf("said %v, want %d line naming Policy.Immediate", said, tt.wantN)
			}
		})
	}
}

// TestTimeoutInsideLeavesTheDeliverysContext: after the handler, the Retry goes on
// with the delivery's context, not the one a middleware inside set and canceled
// (Watermill's Timeout), so that the pause after a failed hand-off is not cut short.
func TestTimeoutInsideLeavesTheDeliverysContext(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{}, b)
	h := e.Middleware(wmiddleware.Timeout(time.Millisecond)(func(msg *message.Message) ([]*message.Message, error) {
		<-msg.Context().Done()
		return nil, msg.Context().Err()
	}))
	msg := message.NewMessage("m", nil)
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	if err := msg.Context().Err(); err != nil {
		t.Errorf("after the Retry, the message's context is done (%v): the Timeout's, not the delivery's", err)
	}
	if len(b.msgs()) != 1 {
		t.Errorf("%d retries, want 1", len(b.msgs()))
	}
}

// TestDroppedRetryWithInstantAckOutsideIsToldAtClose: where messages are acked before
// they reach the Retry (InstantAck outside it), a retry acked that has not reached it
// yet may be on its way: it is told at Close, not at the next delivery.
func TestDroppedRetryWithInstantAckOutsideIsToldAtClose(t *testing.T) {
	logs := watermill.NewCaptureLogger()
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Logger: logs}, b)
	e.wiring.ID, e.wiring.Bound = "r1", nil
	h := wmiddleware.InstantAck(e.Middleware(failing(errFlaky)))
	msg := message.NewMessage("u", nil)
	msg.Metadata.Set("amqpretry-subscriber", "r1")
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	retry := b.msgs()[0].Copy()
	e.arrive(retry, true)
	retry.Ack() // InstantAck, before the Retry runs
	e.sweep(false)
	for _, l := range saidOnce(logs) {
		if errors.Is(l.Err, errRetryDropped) {
			t.Fatal("a retry acked by InstantAck on its way to the Retry was said dropped")
		}
	}
	e.sweep(true)
	n := 0
	for _, l := range saidOnce(logs) {
		if errors.Is(l.Err, errRetryDropped) {
			n++
		}
	}
	if n != 1 {
		t.Errorf("said dropped %d times at Close, want once", n)
	}
}
