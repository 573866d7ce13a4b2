package ops_test

import (
	"context"
	"strings"
	"testing"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/ops"
)

// TestClassicWorkQueueUnderDelayedRetry (issue 25 §3): a work queue that exists as a
// classic queue where delayed retries need a quorum queue is flagged by Status with its
// type, and Verify's finding carries the fix that can work (a new quorum queue, or a
// copying backend), not apply, which fails with the same 406.
func TestClassicWorkQueueUnderDelayedRetry(t *testing.T) {
	r := newRigWith(t, amqpretry.Config{Backend: delay.DelayedRetry(0)}, "orders")
	queue := r.queues[0]
	if v, _ := brokertest.Dial(t).Properties["version"].(string); !version.DelayedRetry(v) {
		t.Skipf("RabbitMQ %s has no delayed retry (4.3+)", v)
	}
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	s, err := r.ops.Status(context.Background(), ops.StatusOptions{WorkQueues: r.queues})
	if err != nil {
		t.Fatal(err)
	}
	var flagged bool
	for _, f := range s.Flags {
		if f.Kind == ops.FlagQueueType && f.Name == queue && f.Role == "work" && f.QueueType == "classic" {
			flagged = true
		}
	}
	if !flagged {
		t.Errorf("status flags %+v, want %s on %s, type classic", s.Flags, ops.FlagQueueType, queue)
	}

	findings, err := r.ops.Verify(context.Background(), ops.VerifyOptions{}, r.queues...)
	if err != nil {
		t.Fatal(err)
	}
	var found bool
	for _, f := range findings {
		if f.Kind != "work queue" || f.Name != queue {
			continue
		}
		found = true
		if f.Status != ops.VerdictMismatch || f.Arg != "x-queue-type" ||
			!strings.Contains(f.Fix, `is a classic queue, and delayed retries`) || !strings.Contains(f.Fix, "move to a new quorum queue") ||
			!strings.Contains(f.Fix, "use a copying Backend") {
			t.Errorf("verify finding %+v, want a mismatch on x-queue-type with the fix", f)
		}
	}
	if !found {
		t.Errorf("verify findings %+v: none on %s", findings, queue)
	}
}
