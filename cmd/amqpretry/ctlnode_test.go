package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
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
	// Issue 51: it may then look for the node of this host that listens on the URI's
	// port (with -n): only the same question runs there.
	if len(got) == 0 || len(got) > 1+maxNodeTries || slices.ContainsFunc(got, func(c string) bool { return !strings.Contains(c, "-q eval "+nodeQuery) }) {
		t.Errorf("rabbitmqctl ran %q against another node than the URI's; want only the question of which node it is (eval)", got)
	}
	want := fmt.Sprintf("reaches node %s, which listens for AMQP on %v, not on %d of AMQP_URI: nothing was read there", node, ports, u.Port)
	if code != exitFailed || !strings.Contains(stdout, want) || !strings.Contains(stdout, "--rabbitmqctl 'rabbitmqctl -n NODE'") {
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

// TestRabbitmqctlAutoFindsTheNodeOfTheURI (issue 51): on a host with two brokers, the
// CLI pointed at the second one's URI ran its own rabbitmqctl, which reached the first,
// and refused, naming --rabbitmqctl. It finds the node of this host that listens on the
// URI's port (the broker names itself, this host's epmd lists its nodes) and runs
// rabbitmqctl -n that node; the other node is asked only which node it is. Run with
// AMQP_URI on a second node of this host (a helper's, `rabbitmqctl -n h2@localhost`)
// while the rabbitmqctl on PATH serves the machine's broker.
func TestRabbitmqctlAutoFindsTheNodeOfTheURI(t *testing.T) {
	ctlPath, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		skipOrFail(t, "needs rabbitmqctl on PATH")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	uri := brokertest.URI()
	u, err := amqp.ParseURI(uri)
	if err != nil {
		t.Fatal(err)
	}
	first, firstPorts, err := ctlNode(ctx, []string{ctlPath}, time.Minute)
	if err != nil || slices.Contains(firstPorts, u.Port) {
		t.Skipf("rabbitmqctl on PATH reaches %s (%v, %v): the URI's broker, or none; this test needs it to serve another node than AMQP_URI's", first, firstPorts, err)
	}
	// The URI's node, as the tests' own rabbitmqctl (AMQPRETRY_RABBITMQCTL) reaches it.
	node, ports, err := ctlNode(ctx, brokertest.CtlCommand(), time.Minute)
	if err != nil || !slices.Contains(ports, u.Port) {
		t.Skipf("AMQPRETRY_RABBITMQCTL does not reach the node of AMQP_URI: %s %v %v", node, ports, err)
	}
	name, _, _ := strings.Cut(node, "@")
	if names, err := epmdNames(ctx, u.Host); err != nil || !slices.Contains(names, name) {
		t.Skipf("node %s is not registered with this host's epmd (%v %v): a node with an epmd of its own (a chroot) cannot be found", node, names, err)
	}
	brokertest.Dial(t)
	t.Setenv(uriEnv, uri)

	// A rabbitmqctl on PATH that records how it is called (a call a line), then runs
	// the real one.
	dir := t.TempDir()
	calls := filepath.Join(dir, "calls")
	shim := fmt.Sprintf("#!/bin/sh\necho \"$*\" | tr '\\n' ' ' >> %[1]q\necho >> %[1]q\nexec %[2]q \"$@\"\n", calls, ctlPath)
	if err := os.WriteFile(filepath.Join(dir, "rabbitmqctl"), []byte(shim), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	readCalls := func() []string {
		b, _ := os.ReadFile(calls)
		_ = os.Remove(calls)
		got := strings.Split(strings.TrimSpace(string(b)), "\n")
		for i := range got {
			got[i] = strings.TrimSpace(got[i])
		}
		return got
	}
	// Only the first call, which node the bare command reaches, runs without -n node.
	talksToNodeOnly := func(what string, got []string, want ...string) {
		t.Helper()
		if len(got) < 2 || got[0] != "-q eval "+nodeQuery {
			t.Errorf("%s: rabbitmqctl calls %q, want first the question of which node it reaches", what, got)
			return
		}
		for _, c := range got[1:] {
			if !strings.HasPrefix(c, "-n "+node+" -q ") {
				t.Errorf("%s: rabbitmqctl ran %q, not on node %s (-n)", what, c, node)
			}
		}
		for _, w := range want {
			if !slices.ContainsFunc(got[1:], func(c string) bool { return strings.HasPrefix(c, "-n "+node+" -q "+w) }) {
				t.Errorf("%s: rabbitmqctl never ran %q on node %s: %q", what, w, node, got)
			}
		}
	}
	prefix := brokertest.Prefix(t)
	reached := fmt.Sprintf("rabbitmqctl -n %s reaches node %s, which listens for AMQP on %d of AMQP_URI (rabbitmqctl alone reaches node %s, on %v: the node was found by the URI's port)", node, node, u.Port, first, firstPorts)

	// status, --rabbitmqctl auto (the default): the broker's counts, from that node.
	_, stdout, stderr := runArgs("status", "--prefix", prefix, "--tiers", "1s")
	talksToNodeOnly("status", readCalls(), "status", "list_queues")
	if !strings.Contains(stdout, "broker counts: "+reached) || strings.Contains(stdout, "not on ") {
		t.Errorf("status does not say it read node %s:\n%s%s", node, stdout, stderr)
	}
	// waiting list (rabbitmqctl eval, through ops), the command given as plain
	// rabbitmqctl, which names no node: the same.
	if code, stdout, stderr := runArgs("waiting", "list", "--prefix", prefix, "--tiers", "1s", "--rabbitmqctl", "rabbitmqctl"); code != exitOK {
		t.Errorf("waiting list (%d):\n%s%s", code, stdout, stderr)
	}
	talksToNodeOnly("waiting list", readCalls(), "eval")
	// A command naming its node is taken as given: refused, nothing read there.
	code, stdout, stderr := runArgs("status", "--prefix", prefix, "--tiers", "1s", "--rabbitmqctl", "rabbitmqctl -n "+first)
	if got := readCalls(); code != exitFailed || len(got) != 1 || !strings.Contains(stdout, "not on "+fmt.Sprint(u.Port)+" of AMQP_URI: nothing was read there") {
		t.Errorf("status --rabbitmqctl 'rabbitmqctl -n %s' (%d), calls %q:\n%s%s", first, code, got, stdout, stderr)
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
