package gluetest

import (
	"context"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
)

// Watermill apps as they are written (issue 42): Watermill's Recoverer added to the
// router before the retry middleware, a CQRS event processor whose handlers get a
// context and whose JSON errors come before the handler runs.

// PanicUnderRecovererIsRetriedThenPoisonedWithItsStack: Watermill's Recoverer is added
// to the router first, so it runs outside the retry middleware, which recovers the
// handler's panic itself: the panicking message runs once per attempt, exactly
// MaxAttempts times, and is poisoned with its stack; a message published behind it is
// handled. (Before, the panic went through the middleware to Recoverer, whose error
// the router nacked with requeue: redelivered at wire speed, the queue blocked.)
func PanicUnderRecovererIsRetriedThenPoisonedWithItsStack(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{time.Millisecond}, Jitter: -1}
	logs := &logCapture{}
	s.cfg.Logger = logs
	r := newRetry(t, m, s.sub, s.cfg)
	var badRuns atomic.Int64
	rec := newRecorder(func(msg *message.Message) error {
		// Past 10 runs it stops panicking, so that code that loops stops loading the
		// shared broker (the runs are counted below).
		if msg.UUID == "bad" && badRuns.Add(1) <= 10 {
			explode(msg)
		}
		return nil
	})
	sub := m.Subscriber(t, r)
	newRouter(t, func(router *message.Router) {
		router.AddConsumerHandler("handler-"+s.topic, s.topic, sub, rec.handle).AddMiddleware(r.Middleware)
	}, wmiddleware.Recoverer)
	publish(t, m, s.topic, "bad")
	publish(t, m, s.topic, "good")

	msg := poisoned(t, s.prefix+".poison", 30*time.Second)
	env := middleware.ReadEnvelope(msg.Metadata)
	if env.Reason != amqpretry.ReasonMaxAttempts || env.Attempt != 3 || env.Error != "handler panicked: inventory gone" {
		t.Errorf("poisoned with reason %q at attempt %d, error %q; want max-attempts at 3, handler panicked: inventory gone", env.Reason, env.Attempt, env.Error)
	}
	if !strings.HasPrefix(env.Stack, "github.com/amqpretry/amqpretry/internal/testsupport/gluetest.explode(") {
		t.Errorf("the envelope's stack does not start at the function that panicked:\n%s", env.Stack)
	}
	calls := rec.waitCalls(t, 4, 10*time.Second)
	if n := badRuns.Load(); n != 3 {
		t.Errorf("the panicking message ran %d times, want once per attempt (3)", n)
	}
	if !slices.ContainsFunc(calls, func(c delivery) bool { return c.msg.UUID == "good" }) {
		t.Error("the message published behind the panicking one was not handled")
	}
	wantStats(t, r, 2, 1)
	var panics []watermill.CapturedMessage
	for _, l := range logs.at(watermill.ErrorLogLevel) {
		if strings.HasPrefix(l.Msg, "Handler panicked") {
			panics = append(panics, l)
		}
	}
	if len(panics) != 3 {
		t.Fatalf("%d ERROR lines for the panics, want one per attempt (3)", len(panics))
	}
	if st, _ := panics[0].Fields["stack"].(string); !strings.Contains(st, "gluetest.explode(") {
		t.Errorf("the panic's log line has no stack: %v", panics[0].Fields)
	}
}

// explode panics, as a handler's bug does.
func explode(*message.Message) { panic("inventory gone") }

// orderPlaced is the CQRS event of CQRSEventsUndecodableAtOnceAttemptFromContext.
type orderPlaced struct {
	ID     string `json:"id"`
	Amount int    `json:"amount"`
}

// CQRSEventsUndecodableAtOnceAttemptFromContext: a CQRS event processor (JSON
// marshaler) behind Recoverer and the retry middleware, router-wide, as Watermill's
// CQRS example has them. A malformed event fails in the processor before the handler
// runs, with encoding/json's error: poisoned at attempt 1, no Classify; a well-formed
// one that fails once is handled again, and its handler, which gets a context and not
// the message, reads each attempt from it (amqpretry.AttemptFromContext).
func CQRSEventsUndecodableAtOnceAttemptFromContext(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{time.Millisecond}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)
	var mu sync.Mutex
	attempts := map[string][]int{}
	done := make(chan struct{})
	handler := cqrs.NewEventHandler("on-order-placed", func(ctx context.Context, e *orderPlaced) error {
		mu.Lock()
		defer mu.Unlock()
		attempts[e.ID] = append(attempts[e.ID], amqpretry.AttemptFromContext(ctx))
		switch len(attempts[e.ID]) {
		case 1:
			return errFlaky
		case 2:
			close(done)
		}
		return nil
	})
	newRouter(t, func(router *message.Router) {
		ep, err := cqrs.NewEventProcessorWithConfig(router, cqrs.EventProcessorConfig{
			GenerateSubscribeTopic: func(cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) { return s.topic, nil },
			SubscriberConstructor: func(cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
				return m.Subscriber(t, r), nil
			},
			Marshaler: cqrs.JSONMarshaler{},
			Logger:    Logger(),
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := ep.AddHandlers(handler); err != nil {
			t.Fatal(err)
		}
	}, wmiddleware.Recoverer, r.Middleware)

	pub := m.Publisher(t, s.sub)
	for _, payload := range []string{`{"id": "o-1", "amount": `, `{"id": "o-2", "amount": "ten"}`, `{"id": "o-3", "amount": 10}`} {
		msg, err := cqrs.JSONMarshaler{}.Marshal(&orderPlaced{})
		if err != nil {
			t.Fatal(err)
		}
		msg.Payload = []byte(payload)
		if err := pub.Publish(s.topic, msg); err != nil {
			t.Fatal(err)
		}
	}
	for _, want := range []string{"unexpected end of JSON input", "json: cannot unmarshal string into Go struct field orderPlaced.amount of type int"} {
		env := middleware.ReadEnvelope(poisoned(t, s.prefix+".poison", 30*time.Second).Metadata)
		if env.Reason != amqpretry.ReasonPermanent || env.Attempt != 1 || env.Error != "undecodable payload, not retried: "+want {
			t.Errorf("poisoned with reason %q at attempt %d, error %q; want permanent at 1, undecodable payload, not retried: %s", env.Reason, env.Attempt, env.Error, want)
		}
	}
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the event that failed once was not handled again within 30 s")
	}
	mu.Lock()
	defer mu.Unlock()
	if got := attempts["o-3"]; !slices.Equal(got, []int{1, 2}) {
		t.Errorf("the handler read attempts %v from its context, want [1 2]", got)
	}
	if len(attempts) != 1 {
		t.Errorf("the handler ran for %v: a malformed event reached it", attempts)
	}
	wantStats(t, r, 1, 2)
}
