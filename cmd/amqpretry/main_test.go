package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
)

// binary is the command built once for the tests that kill it.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "amqpretry-cmd")
	if err != nil {
		panic(err)
	}
	binary = filepath.Join(dir, "amqpretry")
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build amqpretry: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// env is a fresh prefix, its tier flags and work queues, cleaned up at the end.
type env struct {
	t      *testing.T
	prefix string
	queues []string
	h      *delay.Handoff
}

func newEnv(t *testing.T, queues ...string) *env {
	t.Helper()
	brokertest.Dial(t)
	e := &env{t: t, prefix: brokertest.Prefix(t)}
	for _, q := range queues {
		e.queues = append(e.queues, e.prefix+"."+q)
	}
	p, err := ops.PlanTopology(ops.Config{Delay: delay.Config{Prefix: e.prefix, Tiers: []time.Duration{time.Second, 2 * time.Second}}}, e.queues...)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p.Topology)
	brokertest.Cleanup(t, e.queues, nil)
	h, err := delay.Dial(delay.HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	e.h = h
	return e
}

// flags are the common flags of this env.
func (e *env) flags() []string { return []string{"--prefix", e.prefix, "--tiers", "1s,2s"} }

// run runs the command in-process and returns its exit status and output.
func (e *env) run(args ...string) (int, string, string) {
	e.t.Helper()
	var stdout, stderr bytes.Buffer
	args = append(args[:len(args):len(args)], e.flags()...)
	code := run(context.Background(), args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

func (e *env) queueFlags() []string {
	var out []string
	for _, q := range e.queues {
		out = append(out, "--queue", q)
	}
	return out
}

// poison publishes n poisoned messages, message i failing on queue i % len(queues).
func (e *env) poison(n int) {
	e.t.Helper()
	for i := range n {
		q := e.queues[i%len(e.queues)]
		msg := message.NewMessage(fmt.Sprintf("m%04d", i), []byte("order "+strconv.Itoa(i)))
		md := msg.Metadata
		md.Set(middleware.QueueKey, q)
		md.Set(middleware.HandlerKey, "h")
		md.Set(middleware.PoisonReasonKey, middleware.PoisonMaxAttempts)
		md.Set(middleware.ErrorKey, "warehouse offline")
		md.Set(middleware.ErrorTypesKey, "*errors.errorString")
		md.Set(middleware.AttemptKey, "5")
		md.Set(middleware.MaxAttemptsKey, "5")
		md.Set(middleware.LastFailureKey, time.Now().UTC().Format(time.RFC3339Nano))
		if err := e.h.PublishMessage(context.Background(), "", e.prefix+".poison", msg, nil); err != nil {
			e.t.Fatal(err)
		}
	}
}

func TestTopologyVerifyFailsThenPassesAfterApply(t *testing.T) {
	e := newEnv(t, "orders")
	args := append([]string{"topology", "verify"}, e.queueFlags()...)
	code, out, _ := e.run(args...)
	if code != exitFlagged {
		t.Fatalf("verify on a fresh prefix exited %d:\n%s", code, out)
	}
	for _, want := range []string{`queue "` + e.prefix + `.delay.1s": missing`, `exchange "` + e.prefix + `.deliver": missing`,
		`work queue "` + e.queues[0] + `": missing`, "amqpretry topology apply --backend ttl-tiers --prefix " + e.prefix + " --tiers 1s,2s --queue " + e.queues[0]} {
		if !strings.Contains(out, want) {
			t.Errorf("verify output lacks %q:\n%s", want, out)
		}
	}
	if code, out, errOut := e.run(append([]string{"topology", "apply"}, e.queueFlags()...)...); code != exitOK {
		t.Fatalf("apply exited %d:\n%s%s", code, out, errOut)
	}
	code, out, _ = e.run(append(args, "--bind")...)
	if code != exitOK {
		t.Fatalf("verify after apply exited %d:\n%s", code, out)
	}
	code, out, _ = e.run(append(args, "--json")...)
	var v struct {
		OK       bool `json:"ok"`
		Findings []struct{ Status string }
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil || code != exitOK || !v.OK || len(v.Findings) == 0 {
		t.Fatalf("verify --json: %d %v %s", code, err, out)
	}
	code, out, _ = e.run("topology", "plan", "--json", "--queue", e.queues[0])
	var p ops.Plan
	if err := json.Unmarshal([]byte(out), &p); err != nil || code != exitOK || len(p.Topology.Queues) != 4 {
		t.Fatalf("plan --json: %d %v %s", code, err, out)
	}
}

func TestPoisonListShowDryRun(t *testing.T) {
	e := newEnv(t, "orders", "billing")
	if code, out, errOut := e.run(append([]string{"topology", "apply"}, e.queueFlags()...)...); code != exitOK {
		t.Fatalf("apply: %s%s", out, errOut)
	}
	e.poison(4)
	code, out, _ := e.run("poison", "list", "--queue", e.queues[1])
	if code != exitOK || !strings.Contains(out, "m0001") || !strings.Contains(out, "m0003") || strings.Contains(out, "m0000") || !strings.Contains(out, "max-attempts") {
		t.Errorf("poison list --queue billing (%d):\n%s", code, out)
	}
	code, out, _ = e.run("poison", "show", "m0002")
	for _, want := range []string{"message m0002", "queue:", e.queues[0], "reason:", "max-attempts", "error:", "warehouse offline", "attempts:", "5 of 5", "last failure:", "handler:"} {
		if code != exitOK || !strings.Contains(out, want) {
			t.Errorf("poison show lacks %q (%d):\n%s", want, code, out)
		}
	}
	code, out, _ = e.run("poison", "redrive", "--dry-run")
	if code != exitOK || !strings.Contains(out, "dry run: would have redriven 4 of 4") {
		t.Errorf("dry run (%d):\n%s", code, out)
	}
	if n := brokertest.QueueLength(t, e.prefix+".poison"); n != 4 {
		t.Errorf("poison queue holds %d after a dry run, want 4", n)
	}
	for _, q := range e.queues {
		if n := brokertest.QueueLength(t, q); n != 0 {
			t.Errorf("%s got %d from a dry run", q, n)
		}
	}
	code, out, _ = e.run("poison", "list", "--json")
	var l ops.ListResult
	if err := json.Unmarshal([]byte(out), &l); err != nil || code != exitOK || len(l.Messages) != 4 || l.Messages[0].UUID != "m0000" || l.Messages[3].UUID != "m0003" {
		t.Errorf("list --json after dry run: %v\n%s", err, out)
	}
}

// TestRedriveKilledMidRun: 1,000 poisoned messages redriven at a rate limit, the
// command killed with SIGKILL mid-run: none lost, each redriven one on its own queue,
// the rest still in the poison queue. A message whose confirm arrived just before the
// kill may be in both places (at-least-once): at most one.
func TestRedriveKilledMidRun(t *testing.T) {
	const total = 1000
	e := newEnv(t, "orders", "billing", "shipping", "email")
	if code, out, errOut := e.run(append([]string{"topology", "apply"}, e.queueFlags()...)...); code != exitOK {
		t.Fatalf("apply: %s%s", out, errOut)
	}
	e.poison(total)

	cmd := exec.Command(binary, append([]string{"poison", "redrive", "--rate", "200/s"}, e.flags()...)...)
	cmd.Env = append(os.Environ(), "AMQP_URI="+brokertest.URI())
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	t.Logf("killed command's stderr:\n%s", stderr.String())
	if !strings.Contains(stderr.String(), "progress:") {
		t.Errorf("no progress counts on a non-TTY stderr")
	}

	// The broker requeues what the dead connection held: wait until it is back.
	poison := e.prefix + ".poison"
	seen := map[string]int{}
	redriven := 0
	for _, q := range e.queues {
		for _, msg := range brokertest.Drain(t, q) {
			seen[msg.UUID]++
			redriven++
			if got := msg.Metadata.Get(middleware.QueueKey); got != q {
				t.Errorf("message %s failed on %s but was redriven to %s", msg.UUID, got, q)
			}
		}
	}
	var left []*message.Message
	deadline := time.Now().Add(10 * time.Second)
	for {
		left = brokertest.Drain(t, poison)
		if redriven+len(left) >= total || time.Now().After(deadline) {
			break
		}
		// Not yet requeued: put them back and look again.
		for _, msg := range left {
			if err := e.h.PublishMessage(context.Background(), "", poison, msg, nil); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	for _, msg := range left {
		seen[msg.UUID]++
	}
	dups := 0
	for i := range total {
		switch n := seen[fmt.Sprintf("m%04d", i)]; {
		case n == 0:
			t.Errorf("message m%04d lost", i)
		case n > 1:
			dups++
		}
	}
	t.Logf("redriven before the kill: %d; left in the poison queue: %d; in both: %d", redriven, len(left), dups)
	if redriven == 0 || len(left) == 0 {
		t.Errorf("the kill did not land mid-run: %d redriven, %d left", redriven, len(left))
	}
	if redriven > 2*200+50 {
		t.Errorf("%d redriven in 2 s at 200/s: the rate limit does not hold", redriven)
	}
	if dups > 1 {
		t.Errorf("%d messages in both places, want at most 1", dups)
	}
}

func TestCredentialsNeverPrinted(t *testing.T) {
	const secret = "s3cret-Pa55"
	t.Setenv(uriEnv, "amqp://guest:"+secret+"@127.0.0.1:5672/")
	for _, args := range [][]string{{"status"}, {"status", "--json"}, {"poison", "list"}, {"topology", "verify"}} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), args, &stdout, &stderr)
		if code == exitOK {
			t.Errorf("%v with a wrong password exited 0", args)
		}
		if out := stdout.String() + stderr.String(); strings.Contains(out, secret) || out == "" {
			t.Errorf("%v printed the password or nothing:\n%s", args, out)
		}
	}
}

func TestUsage(t *testing.T) {
	for _, args := range [][]string{{}, {"bogus"}, {"poison"}, {"poison", "bogus"}, {"status", "--bogus"}, {"poison", "redrive", "--rate", "x"}} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), args, &stdout, &stderr); code != exitUsage {
			t.Errorf("%v exited %d, want %d\n%s", args, code, exitUsage, stderr.String())
		}
	}
}

// TestRedriveInterrupted: SIGINT stops a redrive between two messages: exit status
// 130, and every message is in exactly one place.
func TestRedriveInterrupted(t *testing.T) {
	const total = 300
	e := newEnv(t, "orders", "billing")
	if code, out, errOut := e.run(append([]string{"topology", "apply"}, e.queueFlags()...)...); code != exitOK {
		t.Fatalf("apply: %s%s", out, errOut)
	}
	e.poison(total)
	cmd := exec.Command(binary, append([]string{"poison", "redrive", "--rate", "100/s"}, e.flags()...)...)
	cmd.Env = append(os.Environ(), "AMQP_URI="+brokertest.URI())
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	err := cmd.Wait()
	if code := cmd.ProcessState.ExitCode(); code != exitInterrupted {
		t.Fatalf("exit status %d (%v), want %d\n%s%s", code, err, exitInterrupted, stdout.String(), stderr.String())
	}
	if !strings.Contains(stdout.String(), "interrupted: stopped between two messages") {
		t.Errorf("output:\n%s", stdout.String())
	}
	seen := map[string]int{}
	for _, q := range append([]string{e.prefix + ".poison"}, e.queues...) {
		for _, msg := range brokertest.Drain(t, q) {
			seen[msg.UUID]++
		}
	}
	for i := range total {
		if n := seen[fmt.Sprintf("m%04d", i)]; n != 1 {
			t.Errorf("message m%04d found %d times, want exactly once after a clean stop", i, n)
		}
	}
	t.Logf("%s", stdout.String())
}

// TestWindowKeepsOrder: with a window smaller than the run, the run stops when the
// window is full, and what it held is back in place, in order.
func TestWindowKeepsOrder(t *testing.T) {
	e := newEnv(t, "orders", "billing")
	if code, out, errOut := e.run(append([]string{"topology", "apply"}, e.queueFlags()...)...); code != exitOK {
		t.Fatalf("apply: %s%s", out, errOut)
	}
	e.poison(10) // even: orders, odd: billing
	code, out, _ := e.run("poison", "redrive", "--queue", e.queues[1], "--window", "3")
	if code != exitOK || !strings.Contains(out, "stopped: 3 messages held (--window)") {
		t.Fatalf("redrive with a small window (%d):\n%s", code, out)
	}
	var got []string
	for _, msg := range brokertest.Drain(t, e.prefix+".poison") {
		got = append(got, msg.UUID)
	}
	// m0000, m0002, m0004 were held (not matching); m0001, m0003 redriven before the
	// window filled; the rest was never looked at.
	want := []string{"m0000", "m0002", "m0004", "m0005", "m0006", "m0007", "m0008", "m0009"}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("poison queue after the run: %v, want %v", got, want)
	}
}
