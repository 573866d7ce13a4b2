package delay_test

import (
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/delay"
)

// TestUnroutableRetryIsParkedNotStuck: a retry whose queue is gone when it comes due is
// kept in the parking queue, and does not block the retries behind it.
func TestUnroutableRetryIsParkedNotStuck(t *testing.T) {
	forEachBackend(t, func(t *testing.T, bc backendCase) {
		switch bc.name {
		case delay.BackendMemory:
			t.Skip("the memory backend publishes straight to the topic; there is nothing to park")
		case delay.BackendDelayedExchange:
			t.Skip("the delayed-exchange backend refuses a queue that does not exist before it publishes (TestDelayedExchangeRefusesMissingQueue)")
		}
		r := newRig(t, bc)
		r.schedule(r.prefix+".gone", "orphan", time.Second)
		r.schedule(r.queue, "behind", time.Second)
		if got := collect(t, r.queue, 1, 30*time.Second); got[0].msg.UUID != "behind" {
			t.Fatalf("got %s, want the retry behind the orphan", got[0].msg.UUID)
		}
		parked := collect(t, r.prefix+".parking", 1, 30*time.Second)
		if parked[0].msg.UUID != "orphan" {
			t.Errorf("parked %s, want orphan", parked[0].msg.UUID)
		}
	})
}
