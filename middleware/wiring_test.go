package middleware

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// stamped returns a message delivered by the subscriber of the Retry named owner ("":
// by no Retry's subscriber).
func stamped(owner string) *message.Message {
	msg := hurried("m-" + owner)
	if owner != "" {
		msg.Metadata.Set(keys.Subscriber, owner)
	}
	return msg
}

// wired returns an engine with Retry id, its queues named after it.
func wired(t *testing.T, id string, cfg amqpretry.Config) (*engine, *fakeBackend, *poisonQueue) {
	t.Helper()
	b := &fakeBackend{}
	e, poison := newEngine(t, cfg, b)
	e.wiring = wiring{ID: id, Queue: func(string) string { return "q-" + id }}
	return e, b, poison
}

func TestEachRetryActsOnlyOnItsOwnSubscribersMessages(t *testing.T) {
	backends := map[string]*fakeBackend{}
	engines := map[string]*engine{}
	for _, id := range []string{"billing", "shipping"} {
		engines[id], backends[id], _ = wired(t, id, amqpretry.Config{})
	}
	for _, order := range [][]string{{"billing", "shipping"}, {"shipping", "billing"}} {
		for _, owner := range []string{"billing", "shipping"} {
			h := message.HandlerFunc(failing(errFlaky))
			for _, id := range slices.Backward(order) { // order[0] outermost
				h = engines[id].Middleware(h)
			}
			backends["billing"].parked, backends["shipping"].parked = nil, nil
			if _, err := h(stamped(owner)); err != nil {
				t.Fatalf("order %v, owner %s: %v", order, owner, err)
			}
			for id, b := range backends {
				want := map[bool]int{true: 1, false: 0}[id == owner]
				if len(b.parked) != want {
					t.Errorf("order %v, owner %s: %s's Retry handed off %d, want %d", order, owner, id, len(b.parked), want)
				}
				if want == 1 && b.parked[0].queue != "q-"+owner {
					t.Errorf("order %v: retry went to %s", order, b.parked[0].queue)
				}
			}
		}
	}

	// A message of a subscriber whose Retry is not on the handler, or of no Retry's
	// subscriber, is nobody's to route: it is poisoned at its first failure, once (by
	// the Retry nearest the handler), naming the fix.
	for _, owner := range []string{"elsewhere", ""} {
		poisons := map[string]*poisonQueue{}
		h := message.HandlerFunc(failing(errFlaky))
		for _, id := range []string{"shipping", "billing"} { // billing outermost
			var e *engine
			e, _, poisons[id] = wired(t, id, amqpretry.Config{})
			h = e.Middleware(h)
		}
		if _, err := h(stamped(owner)); err != nil {
			t.Errorf("owner %q: %v, want poisoned", owner, err)
		}
		if n := len(poisons["billing"].got()); n != 0 {
			t.Errorf("owner %q: the outer Retry poisoned %d, want 0", owner, n)
		}
		got := poisons["shipping"].got()
		if len(got) != 1 {
			t.Fatalf("owner %q: poisoned %d times by the Retry nearest the handler, want once", owner, len(got))
		}
		env := ReadEnvelope(got[0].Metadata)
		if env.Reason != amqpretry.ReasonHandoffFailed || env.Attempt != 1 || strings.Count(env.Error, amqpretry.ErrNotWired.Error()) != 1 ||
			!strings.Contains(env.Error, errFlaky.Error()) || !strings.Contains(env.Error, "AddHandler") {
			t.Errorf("owner %q: poisoned with %+v, want handoff-failed at attempt 1, ErrNotWired once, the handler's error and the fix", owner, env)
		}
	}
}

// TestNotWiredIsPoisonedAtItsFirstFailure: a message the Retry cannot route back is
// poisoned at its first failure, not nacked again and again (issue 51), counted and
// observed as a failed hand-off of cause not-wired, and logged once, at ERROR without
// a Warn level.
func TestNotWiredIsPoisonedAtItsFirstFailure(t *testing.T) {
	var events []amqpretry.Event
	logs := &errLines{}
	e, b, poison := wired(t, "billing", amqpretry.Config{Logger: logs, Observe: func(ev amqpretry.Event) { events = append(events, ev) }})
	h := e.Middleware(failing(errFlaky))
	if _, err := h(stamped("elsewhere")); err != nil {
		t.Fatalf("first failure: %v, want poisoned", err)
	}
	if len(b.parked) != 0 || len(poison.got()) != 1 || poison.got()[0].Metadata.Get(keys.PoisonReason) != "handoff-failed" {
		t.Fatalf("parked %d, poisoned %v", len(b.parked), poison.got())
	}
	var causes []string
	for _, ev := range events {
		if ev.Kind == amqpretry.EventHandoffFailed {
			causes = append(causes, ev.Cause)
		}
	}
	if !slices.Equal(causes, []string{"not-wired"}) {
		t.Errorf("causes %v", causes)
	}
	if st := e.Stats(); st.HandoffFailures != 1 || st.Poisoned != 1 {
		t.Errorf("stats %+v, want 1 failed hand-off, 1 poisoned", st)
	}
	if len(logs.errs) != 1 || !errors.Is(logs.errs[0], amqpretry.ErrNotWired) || !errors.Is(logs.errs[0], errFlaky) {
		t.Errorf("ERROR lines %v, want one with ErrNotWired and the handler's error", logs.errs)
	}
	// A delivery that is not this Retry's is not observed as its own.
	for _, ev := range events {
		if ev.Kind == amqpretry.EventDelivered {
			t.Errorf("observed another subscriber's delivery: %+v", ev)
		}
	}
}

// errLines keeps the errors of the lines logged at ERROR.
type errLines struct {
	watermill.NopLogger
	errs []error
}

func (l *errLines) Error(_ string, err error, _ watermill.LogFields) { l.errs = append(l.errs, err) }

func TestUnboundQueueIsNotWired(t *testing.T) {
	e, b, _ := wired(t, "billing", amqpretry.Config{})
	bound := map[string]bool{}
	e.wiring.Bound = &queueSet{m: bound}
	_, poison := newEngine(t, amqpretry.Config{}, b)
	e.poisonQ = poison.send
	if _, err := e.Middleware(failing(errFlaky))(stamped("billing")); err != nil || len(poison.got()) != 1 {
		t.Fatalf("unbound queue: %v, poisoned %d, want poisoned", err, len(poison.got()))
	}
	if env := ReadEnvelope(poison.got()[0].Metadata); !strings.Contains(env.Error, amqpretry.ErrNotWired.Error()) || !strings.Contains(env.Error, `queue "q-billing" was never bound`) {
		t.Fatalf("unbound queue poisoned with %q", env.Error)
	}
	bound["q-billing"] = true
	if _, err := e.Middleware(failing(errFlaky))(stamped("billing")); err != nil || len(b.parked) != 1 {
		t.Fatalf("bound queue: %v, %d parked", err, len(b.parked))
	}
}
