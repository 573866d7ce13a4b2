package main

import (
	"regexp"
	"strings"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/derived"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
)

// TestWaitingAndTeardown: three retries wait 10 minutes in a ttl-tiers tier queue.
// waiting list shows them in due order with a histogram, status counts them for their
// work queue (next and last due); purge --dry-run counts without removing; retry-now
// brings one back by id; teardown (no --backend needed) refuses while two wait, then,
// once they are back, a dry run lists the storage and the teardown removes it.
func TestWaitingAndTeardown(t *testing.T) {
	t.Parallel()
	if _, err := brokertest.Ctl(t.Context(), "-q", "list_queues", "name"); err != nil {
		t.Skipf("needs rabbitmqctl: %v", err)
	}
	e := newEnv(t, "orders")
	cfg := amqpretry.Config{Prefix: e.prefix, Backend: delay.TTLTiers(10 * time.Minute)}
	p, err := cfg.Plan(e.queues...)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p)
	queue := e.queues[0]
	flags := []string{"--prefix", e.prefix, "--tiers", "10m"}
	// The broker's own rabbitmqctl: on RabbitMQ 4.x the one on PATH serves another node.
	ctl := []string{"--rabbitmqctl", strings.Join(brokertest.CtlCommand(), " ")}
	run := func(args ...string) (int, string, string) {
		t.Helper()
		args = append(args, flags...)
		if args[0] != "topology" {
			args = append(args, ctl...)
		}
		return runArgs(args...)
	}
	if code, out, errOut := run("topology", "apply", "--queue", queue); code != exitOK {
		t.Fatalf("apply: %d %s%s", code, out, errOut)
	}
	c := cfg.WithDefaults()
	b, err := derived.Of(c).Open(backend.Env{Handoff: e.h})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"w-a", "w-b", "w-c"} {
		msg := message.NewMessage(id, []byte(id))
		middleware.Envelope{Queue: queue, Attempt: 2, Due: time.Now().Add(10 * time.Minute), LastFailure: time.Now()}.Write(msg.Metadata)
		wdelay.Message(msg, wdelay.For(10*time.Minute))
		if err := (backend.Scheduler{Backend: b}).Publish(queue, msg); err != nil {
			t.Fatal(err)
		}
	}
	var out string
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out, "3 of 3 waiting retries shown") {
		if time.Now().After(deadline) {
			t.Fatalf("waiting list never showed 3:\n%s", out)
		}
		var code int
		var errOut string
		code, out, errOut = run("waiting", "list", "--queue", queue)
		if code != exitOK {
			t.Fatalf("waiting list: %d %s%s", code, out, errOut)
		}
	}
	if !regexp.MustCompile(`(?s)w-a.*w-b.*w-c`).MatchString(out) || !regexp.MustCompile(`< 10m\s+3 #`).MatchString(out) {
		t.Errorf("waiting list:\n%s", out)
	}
	code, out, errOut := run("status", "--queue", queue)
	if code != exitOK || !regexp.MustCompile(regexp.QuoteMeta(queue)+`\s+3\s+0\s+20\d\d-`).MatchString(out) {
		t.Errorf("status (%d):\n%s%s", code, out, errOut)
	}
	tier := e.prefix + ".delay.10m"
	// Issue 33: each line names where the retries wait and the work queue they come
	// back to; retry-now's words are its own (it said "would redrive ... in <work queue>").
	if code, out, _ := run("waiting", "purge", "--id", "w-c", "--dry-run"); code != exitOK ||
		!strings.Contains(out, "dry run: would purge 1 of 3 retries waiting in "+tier+", due back to their work queues") ||
		!strings.Contains(out, "  w-c in "+tier+", due back to "+queue+" (attempt 2") {
		t.Errorf("purge dry run (%d):\n%s", code, out)
	}
	if code, out, _ := run("waiting", "retry-now", "--queue", queue, "--id", "w-b", "--dry-run"); code != exitOK || strings.Contains(out, "redrive") ||
		!strings.Contains(out, "dry run: would retry now 1 of 3 retries waiting in "+tier+", back to work queue "+queue+" (3 scanned, 2 not matching, 0 unroutable); nothing changed") ||
		!strings.Contains(out, "  w-b in "+tier+" -> "+queue+" (attempt 2") {
		t.Errorf("retry-now dry run (%d):\n%s", code, out)
	}
	if code, _, errOut := run("waiting", "retry-now"); code != exitUsage || !strings.Contains(errOut, "--queue is required") {
		t.Errorf("retry-now without --queue (%d): %s", code, errOut)
	}
	if code, out, errOut := run("waiting", "retry-now", "--queue", queue, "--id", "w-b"); code != exitOK || !strings.Contains(out, "retried now 1 of 3 retries waiting in "+tier+", back to work queue "+queue) {
		t.Errorf("retry-now w-b (%d):\n%s%s", code, out, errOut)
	}
	if got := brokertest.Drain(t, queue); len(got) != 1 || got[0].UUID != "w-b" {
		t.Fatalf("work queue got %v", got)
	}
	// Refused every time; the count it names comes from the broker's stats, which lag
	// (list_queues may still count w-b for a few seconds): it reaches 2.
	deadline = time.Now().Add(30 * time.Second)
	for {
		code, out, errOut = run("teardown", "--yes")
		if code != exitFailed || !strings.Contains(errOut, "teardown refused") {
			t.Fatalf("teardown while 2 wait (%d):\n%s%s", code, out, errOut)
		}
		if strings.Contains(out, "2 messages waiting, in "+tier+": 2") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("teardown never counted the 2 left waiting (%d):\n%s%s", code, out, errOut)
		}
	}
	if code, out, errOut := run("waiting", "retry-now", "--queue", queue); code != exitOK || !strings.Contains(out, "retried now 2 of 2") {
		t.Errorf("retry-now all (%d):\n%s%s", code, out, errOut)
	}
	// The broker's counts (list_queues) lag its stats interval: teardown refuses until
	// they show the queue empty.
	deadline = time.Now().Add(30 * time.Second)
	for {
		code, out, errOut := run("teardown", "--backend", "ttl-tiers", "--dry-run")
		if code == exitOK && strings.Contains(out, "dry run: would remove 1 queues, 2 exchanges") && strings.Contains(out, tier) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("teardown dry run (%d):\n%s%s", code, out, errOut)
		}
	}
	if code, out, errOut := run("teardown", "--backend", "ttl-tiers", "--yes"); code != exitOK || !strings.Contains(out, "removed 1 queues, 2 exchanges") {
		t.Errorf("teardown (%d):\n%s%s", code, out, errOut)
	}
	if code, out, _ := run("status", "--queue", queue); code != exitFailed || !strings.Contains(out, "MISSING delay queue "+tier) {
		t.Errorf("status after teardown (%d):\n%s", code, out)
	}
}
