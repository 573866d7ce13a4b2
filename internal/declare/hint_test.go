package declare_test

import (
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/topology"
)

// TestHintNamesThePoisonQueue: a subscriber config that declares the poison queue
// without its arguments is told it is the poison queue and how to read it, not that a
// work queue needs other arguments.
func TestHintNamesThePoisonQueue(t *testing.T) {
	clash := &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'app.poison' in vhost '/': received none but current is the value 'quorum' of type 'longstr'"}
	f := declare.Fix{Mode: topology.ModeDeclare, PoisonQueue: "app.poison", Apply: func(...string) string { return "amqpretry topology apply" }}
	got := f.Hint(clash, "app.poison").Error()
	for _, want := range []string{`poison queue "app.poison"`, "PoisonSubscriberConfig()", "x-queue-type"} {
		if !strings.Contains(got, want) {
			t.Errorf("hint %q does not say %s", got, want)
		}
	}
	if strings.Contains(got, `work queue "app.poison"`) {
		t.Errorf("hint %q calls the poison queue a work queue", got)
	}
	if work := f.Hint(clash, "app.orders").Error(); !strings.Contains(work, `work queue "app.orders"`) {
		t.Errorf("hint for a work queue %q", work)
	}
}
