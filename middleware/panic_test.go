package middleware

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// explode is a handler with a bug: it panics.
func explode(*message.Message) ([]*message.Message, error) { panic("inventory gone") }

// TestPanicIsAFailureOfItsAttempt: the middleware recovers a handler's panic, under
// Watermill's Recoverer as well (outside it: it never sees the panic), and deals with it
// as a failure: retried with its stack in the envelope, then, at the last attempt,
// poisoned with it; logged at ERROR with its stack.
func TestPanicIsAFailureOfItsAttempt(t *testing.T) {
	b := &fakeBackend{}
	logs := watermill.NewCaptureLogger()
	var classified []error
	e, poison := newEngine(t, amqpretry.Config{
		Policy: amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{time.Second}},
		Logger: logs,
		Classify: func(p amqpretry.ClassifyParams) amqpretry.Decision {
			classified = append(classified, p.Err)
			return p.Default
		},
	}, b)
	h := wmiddleware.Recoverer(e.Middleware(explode))

	if _, err := h(message.NewMessage("bad", nil)); err != nil {
		t.Fatalf("a recovered panic handed off must let the router ack, got %v", err)
	}
	if len(b.parked) != 1 || len(poison.got()) != 0 {
		t.Fatalf("parked %d, poisoned %d; want 1 and 0", len(b.parked), len(poison.got()))
	}
	env := ReadEnvelope(b.parked[0].msg.Metadata)
	if env.Attempt != 2 || env.Error != "handler panicked: inventory gone" || !strings.HasPrefix(env.Stack, "github.com/amqpretry/amqpretry/middleware.explode(") {
		t.Errorf("retry: attempt %d, error %q, stack:\n%s\nwant 2, handler panicked: inventory gone, from explode", env.Attempt, env.Error, env.Stack)
	}
	if len(classified) != 1 || !errors.Is(classified[0], amqpretry.ErrPanicked) {
		t.Errorf("Classify was given %v, want an error wrapping ErrPanicked", classified)
	}
	lines := logs.Captured()[watermill.ErrorLogLevel]
	if len(lines) != 1 || !strings.HasPrefix(lines[0].Msg, "Handler panicked") || !strings.Contains(lines[0].Fields["stack"].(string), "middleware.explode(") {
		t.Errorf("ERROR lines %+v, want one for the panic, with its stack", lines)
	}

	if _, err := h(b.parked[0].msg); err != nil {
		t.Fatal(err)
	}
	if len(poison.got()) != 1 {
		t.Fatalf("poisoned %d, want the last attempt's panic poisoned", len(poison.got()))
	}
	env = ReadEnvelope(poison.got()[0].Metadata)
	if env.Reason != amqpretry.ReasonMaxAttempts || env.Attempt != 2 || !strings.HasPrefix(env.Stack, "github.com/amqpretry/amqpretry/middleware.explode(") {
		t.Errorf("poisoned: reason %q, attempt %d, stack:\n%s", env.Reason, env.Attempt, env.Stack)
	}
	if !strings.HasPrefix(env.ErrorTypes[0], "*middleware.panicked") {
		t.Errorf("error types %v", env.ErrorTypes)
	}
}

// TestPanicOfAnErrorKeepsItsMarks: a panic whose value is an error is classified by
// that error too: panic(Permanent(err)) poisons at once.
func TestPanicOfAnErrorKeepsItsMarks(t *testing.T) {
	b := &fakeBackend{}
	e, poison := newEngine(t, amqpretry.Config{}, b)
	h := e.Middleware(func(*message.Message) ([]*message.Message, error) {
		panic(amqpretry.Permanent(errors.New("malformed")))
	})
	if _, err := h(message.NewMessage("bad", nil)); err != nil {
		t.Fatal(err)
	}
	if len(poison.got()) != 1 || len(b.parked) != 0 {
		t.Fatalf("poisoned %d, parked %d; want 1, 0", len(poison.got()), len(b.parked))
	}
	if env := ReadEnvelope(poison.got()[0].Metadata); env.Reason != amqpretry.ReasonPermanent || env.Attempt != 1 || env.Stack == "" {
		t.Errorf("poisoned: reason %q at attempt %d, stack %q", env.Reason, env.Attempt, env.Stack)
	}
}

// TestImmediateRetriesRecoverEachPanicAndCarryTheAttempt: Policy.Immediate's re-runs
// are each recovered, and each runs with its attempt in its message's context.
func TestImmediateRetriesRecoverEachPanicAndCarryTheAttempt(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 5, Immediate: 2, Delays: []time.Duration{time.Second}}}, b)
	var fromCtx, fromMsg []int
	h := e.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		fromCtx = append(fromCtx, amqpretry.AttemptFromContext(msg.Context()))
		fromMsg = append(fromMsg, amqpretry.Attempt(msg))
		panic("boom")
	})
	if _, err := h(message.NewMessage("bad", nil)); err != nil {
		t.Fatal(err)
	}
	if want := []int{1, 2, 3}; !slices.Equal(fromCtx, want) || !slices.Equal(fromMsg, want) {
		t.Errorf("attempts from the context %v, from the message %v; want %v", fromCtx, fromMsg, want)
	}
	if len(b.parked) != 1 || ReadEnvelope(b.parked[0].msg.Metadata).Attempt != 4 || ReadEnvelope(b.parked[0].msg.Metadata).Stack == "" {
		t.Fatalf("parked %d, want one retry for attempt 4 with the stack", len(b.parked))
	}
}

// TestNestedRetriesTheInnermostRecovers: with two Retry middlewares on a handler, the
// one nearest the handler recovers the panic; for a message of the outer one's, it
// returns the panic's error, which the outer one hands off.
func TestNestedRetriesTheInnermostRecovers(t *testing.T) {
	outerB, innerB := &fakeBackend{}, &fakeBackend{}
	outer, _ := newEngine(t, amqpretry.Config{}, outerB)
	inner, _ := newEngine(t, amqpretry.Config{}, innerB)
	outer.wiring.ID, inner.wiring.ID = "outer", "inner"
	var innerLogs, outerLogs = watermill.NewCaptureLogger(), watermill.NewCaptureLogger()
	inner.cfg.Logger, outer.cfg.Logger = innerLogs, outerLogs
	h := outer.Middleware(inner.Middleware(explode))

	for _, tc := range []struct {
		owner string
		b     *fakeBackend
	}{{"inner", innerB}, {"outer", outerB}} {
		msg := message.NewMessage("bad-"+tc.owner, nil)
		msg.Metadata[keys.Subscriber] = tc.owner
		if _, err := h(msg); err != nil {
			t.Fatalf("%s's message: %v", tc.owner, err)
		}
		if len(tc.b.parked) != 1 || ReadEnvelope(tc.b.parked[0].msg.Metadata).Stack == "" {
			t.Errorf("%s's message: %d parked by %s, want 1 with the stack", tc.owner, len(tc.b.parked), tc.owner)
		}
	}
	if n, m := len(innerLogs.Captured()[watermill.ErrorLogLevel]), len(outerLogs.Captured()[watermill.ErrorLogLevel]); n != 2 || m != 0 {
		t.Errorf("panics logged %d times by the inner Retry, %d by the outer; want 2, 0", n, m)
	}
}

// TestAttemptFromContext: the handler reads the attempt of the delivery from its
// message's context; a context no Retry ran a handler with has none.
func TestAttemptFromContext(t *testing.T) {
	if n := amqpretry.AttemptFromContext(context.Background()); n != 0 {
		t.Errorf("AttemptFromContext of a bare context = %d, want 0", n)
	}
	e, _ := newEngine(t, amqpretry.Config{}, &fakeBackend{})
	var got int
	h := e.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		// As a CQRS processor does: a context derived from the message's.
		got = amqpretry.AttemptFromContext(context.WithValue(msg.Context(), processorKey{}, 1))
		return nil, nil
	})
	msg := message.NewMessage("m", nil)
	msg.Metadata[keys.Attempt] = "3"
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	if got != 3 {
		t.Errorf("AttemptFromContext = %d, want 3", got)
	}
}

type processorKey struct{}

type orderEvent struct {
	Amount int `json:"amount"`
}

// decoding is a handler that decodes its payload, as a CQRS processor does before the
// handler runs.
func decoding(msg *message.Message) ([]*message.Message, error) {
	var o orderEvent
	if err := json.Unmarshal(msg.Payload, &o); err != nil {
		return nil, errors.Join(errors.New("order event"), err)
	}
	return nil, nil
}

// TestUndecodablePayloadIsPoisonedAtOnce: encoding/json's errors are permanent with no
// Classify: poisoned at attempt 1, the envelope saying why; a Classify may retry them.
func TestUndecodablePayloadIsPoisonedAtOnce(t *testing.T) {
	for _, payload := range []string{`{"amount": `, `{"amount": "ten"}`} {
		b := &fakeBackend{}
		e, poison := newEngine(t, amqpretry.Config{}, b)
		if _, err := e.Middleware(decoding)(message.NewMessage("bad", []byte(payload))); err != nil {
			t.Fatal(err)
		}
		if len(poison.got()) != 1 || len(b.parked) != 0 {
			t.Fatalf("%s: poisoned %d, parked %d; want 1, 0", payload, len(poison.got()), len(b.parked))
		}
		env := ReadEnvelope(poison.got()[0].Metadata)
		if env.Reason != amqpretry.ReasonPermanent || env.Attempt != 1 || !strings.HasPrefix(env.Error, "undecodable payload, not retried: order event\n") {
			t.Errorf("%s: poisoned for %q at attempt %d, error %q", payload, env.Reason, env.Attempt, env.Error)
		}
	}

	// A Classify that retries them: the default it is given says permanent.
	var defaults []amqpretry.Decision
	b := &fakeBackend{}
	e, poison := newEngine(t, amqpretry.Config{Classify: func(p amqpretry.ClassifyParams) amqpretry.Decision {
		defaults = append(defaults, p.Default)
		var syntax *json.SyntaxError
		if errors.As(p.Err, &syntax) {
			p.Default.Permanent = false
		}
		return p.Default
	}}, b)
	if _, err := e.Middleware(decoding)(message.NewMessage("bad", []byte(`{"amount": `))); err != nil {
		t.Fatal(err)
	}
	if len(b.parked) != 1 || len(poison.got()) != 0 {
		t.Errorf("with a Classify that retries it: parked %d, poisoned %d; want 1, 0", len(b.parked), len(poison.got()))
	}
	if len(defaults) != 1 || !defaults[0].Permanent {
		t.Errorf("Classify was given defaults %+v, want Permanent", defaults)
	}
}
