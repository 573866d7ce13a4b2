package middleware

import (
	"errors"
	"slices"
	"strings"
	"testing"

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
	// subscriber, is nobody's to route: it fails loudly, once, naming the fix.
	for _, owner := range []string{"elsewhere", ""} {
		h := engines["billing"].Middleware(engines["shipping"].Middleware(failing(errFlaky)))
		_, err := h(stamped(owner))
		if !errors.Is(err, amqpretry.ErrNotWired) || !errors.Is(err, amqpretry.ErrHandoff) || !errors.Is(err, errFlaky) || strings.Count(err.Error(), amqpretry.ErrNotWired.Error()) != 1 {
			t.Errorf("owner %q: %v, want one ErrNotWired joined with the handler's error", owner, err)
		}
		if !strings.Contains(err.Error(), "AddHandler") {
			t.Errorf("owner %q: %v does not name the fix", owner, err)
		}
	}
}

func TestNotWiredIsPoisonedAfterHandoffAttempts(t *testing.T) {
	var events []amqpretry.Event
	e, b, poison := wired(t, "billing", amqpretry.Config{HandoffAttempts: 2, Observe: func(ev amqpretry.Event) { events = append(events, ev) }})
	h := e.Middleware(failing(errFlaky))
	if _, err := h(stamped("elsewhere")); !errors.Is(err, amqpretry.ErrNotWired) {
		t.Fatalf("first: %v", err)
	}
	if _, err := h(stamped("elsewhere")); err != nil {
		t.Fatalf("second: %v, want poisoned", err)
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
	if !slices.Equal(causes, []string{"not-wired", "not-wired"}) {
		t.Errorf("causes %v", causes)
	}
	// A delivery that is not this Retry's is not observed as its own.
	for _, ev := range events {
		if ev.Kind == amqpretry.EventDelivered {
			t.Errorf("observed another subscriber's delivery: %+v", ev)
		}
	}
}

func TestUnboundQueueIsNotWired(t *testing.T) {
	e, b, _ := wired(t, "billing", amqpretry.Config{})
	bound := map[string]bool{}
	e.wiring.Bound = &queueSet{m: bound}
	_, err := e.Middleware(failing(errFlaky))(stamped("billing"))
	if !errors.Is(err, amqpretry.ErrNotWired) || !strings.Contains(err.Error(), `queue "q-billing" was never bound`) {
		t.Fatalf("unbound queue: %v", err)
	}
	bound["q-billing"] = true
	if _, err := e.Middleware(failing(errFlaky))(stamped("billing")); err != nil || len(b.parked) != 1 {
		t.Fatalf("bound queue: %v, %d parked", err, len(b.parked))
	}
}
