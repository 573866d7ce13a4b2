package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

// TestRabbitmqctlAutoChecksTheNodeFirst (issue 25): --rabbitmqctl auto runs the
// rabbitmqctl on PATH, which may serve another broker of this host than the URI's. It
// first asks the node it reaches for its name and AMQP ports, and reads nothing there
// (no status, no list_queues) unless the node listens on the URI's port; it says which
// node it reached either way. Run against the ctlPath brokers: the machine's (rabbitmqctl
// on PATH) and the RabbitMQ 4.3 node of scripts/rabbitmq4.sh, on another port.
func TestRabbitmqctlAutoChecksTheNodeFirst(t *testing.T) {
	ctlPath, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		skipOrFail(t, "needs rabbitmqctl on PATH")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	node, ports, err := ctlNode(ctx, []string{ctlPath}, time.Minute)
	if err != nil || len(ports) == 0 {
		skipOrFail(t, fmt.Sprintf("rabbitmqctl on PATH reaches no broker: %v", err))
	}
	// The other node is the RabbitMQ 4.3 one, named as for the metrics module's 4.3 test:
	// scripts/test.sh sets AMQP_URI_43 in its 4.3 section, once that node runs.
	other := os.Getenv("AMQP_URI_43")
	if other == "" {
		t.Skip("AMQP_URI_43 unset: no second node to point the URI at (scripts/test.sh runs this in its RabbitMQ 4.3 section; by hand: scripts/rabbitmq4.sh 4.3 start; AMQP_URI_43=$(scripts/rabbitmq4.sh 4.3 uri))")
	}
	u, err := amqp.ParseURI(other)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ports {
		if p == u.Port {
			t.Skipf("rabbitmqctl on PATH serves the 4.3 node (%s, port %d): no other node to refuse", node, p)
		}
	}
	if c, err := amqp.Dial(other); err != nil {
		t.Fatalf("AMQP_URI_43: no RabbitMQ 4.3 node at %s (scripts/rabbitmq4.sh 4.3 start): %v", brokertest.Redact(other), err)
	} else {
		_ = c.Close()
	}

	// A rabbitmqctl on PATH that records how it is called, then runs the ctlPath one.
	dir := t.TempDir()
	calls := filepath.Join(dir, "calls")
	shim := fmt.Sprintf("#!/bin/sh\necho \"$*\" >> %q\nexec %q \"$@\"\n", calls, ctlPath)
	if err := os.WriteFile(filepath.Join(dir, "rabbitmqctl"), []byte(shim), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	prefix := brokertest.Prefix(t)
	readCalls := func() []string {
		b, _ := os.ReadFile(calls)
		_ = os.Remove(calls)
		return strings.Split(strings.TrimSpace(string(b)), "\n")
	}

	// The 4.3 node's URI: the rabbitmqctl on PATH reaches another node. Refused after
	// the one question, and said.
	t.Setenv(uriEnv, other)
	code, stdout, stderr := runArgs("status", "--prefix", prefix, "--tiers", "1s")
	got := readCalls()
	if len(got) != 1 || !strings.HasPrefix(got[0], "-q eval ") {
		t.Errorf("rabbitmqctl ran %q against another node than the URI's; want only the question of which node it is (eval)", got)
	}
	want := fmt.Sprintf("reaches node %s, which listens for AMQP on %v, not on %d of AMQP_URI: nothing was read there", node, ports, u.Port)
	if code != exitFailed || !strings.Contains(stdout, want) || !strings.Contains(stdout, "--rabbitmqctl CMD") {
		t.Errorf("status on the 4.3 node with --rabbitmqctl auto exited %d, want %d and a note %q:\n%s%s", code, exitFailed, want, stdout, stderr)
	}

	// The URI of the node rabbitmqctl serves: checked first, then read, and said.
	t.Setenv(uriEnv, fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", ports[0]))
	_, stdout, stderr = runArgs("status", "--prefix", prefix, "--tiers", "1s")
	got = readCalls()
	if len(got) < 3 || !strings.HasPrefix(got[0], "-q eval ") || !strings.HasPrefix(got[1], "-q status") || !strings.HasPrefix(got[2], "-q list_queues") {
		t.Errorf("rabbitmqctl calls %q, want eval (which node), then status and list_queues", got)
	}
	if want := fmt.Sprintf("broker counts: rabbitmqctl reaches node %s, which listens for AMQP on %d of AMQP_URI", node, ports[0]); !strings.Contains(stdout, want) {
		t.Errorf("status on the node rabbitmqctl serves does not say %q:\n%s%s", want, stdout, stderr)
	}
}

// skipOrFail skips t, or fails it under CI=true, where a missing broker or tool fails.
func skipOrFail(t *testing.T, msg string) {
	t.Helper()
	if brokertest.CI() {
		t.Fatal(msg)
	}
	t.Skip(msg)
}
