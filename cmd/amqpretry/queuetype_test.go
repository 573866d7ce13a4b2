package main

import (
	"strings"
	"testing"

	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
)

// TestClassicWorkQueueUnderDelayedRetry (issue 25 §3): status said "nothing flagged"
// and verify suggested apply, which fails with the same 406. Status flags the queue's
// type and both name only fixes that can work.
func TestClassicWorkQueueUnderDelayedRetry(t *testing.T) {
	e := newEnv(t, "orders")
	conn := brokertest.Dial(t)
	if v, _ := conn.Properties["version"].(string); !version.DelayedRetry(v) {
		t.Skipf("RabbitMQ %s has no delayed retry (4.3+)", v)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(e.queues[0], true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	dr := []string{"--backend", "delayed-retry"}
	// The poison queue exists: the work queue's type is the only problem.
	if code, out, errOut := e.run(append([]string{"topology", "apply"}, dr...)...); code != exitOK {
		t.Fatalf("apply without work queues exited %d:\n%s%s", code, out, errOut)
	}
	fix := `work queue "` + e.queues[0] + `" is a classic queue, and delayed retries (Backend delayed-retry or delay.HeldRetries) need a quorum queue`
	code, out, errOut := e.run(append(append([]string{"status", "--rabbitmqctl", "off"}, dr...), e.queueFlags()...)...)
	if code != exitFailed || !strings.Contains(out, "QUEUE-TYPE "+fix) || strings.Contains(out, "nothing flagged") {
		t.Errorf("status exited %d, want %d flagging the type:\n%s%s", code, exitFailed, out, errOut)
	}
	code, out, errOut = e.run(append(append([]string{"topology", "verify"}, dr...), e.queueFlags()...)...)
	if code != exitFailed || !strings.Contains(out, fix) || !strings.Contains(out, "move to a new quorum queue") || strings.Contains(out, "create what is missing with") {
		t.Errorf("verify exited %d, want %d with the fix and no apply:\n%s%s", code, exitFailed, out, errOut)
	}
}
