package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
)

// binary is the command, built once for the tests that run it as a process.
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
	// The command reads the broker's URI from the environment: set once, for the tests
	// that run in parallel (t.Setenv cannot be used there); a test that sets another
	// one runs alone.
	if os.Getenv(uriEnv) == "" {
		_ = os.Setenv(uriEnv, brokertest.URI())
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
	h      backend.Handoff
}

var testTiers = []time.Duration{time.Second, 2 * time.Second}

func newEnv(t *testing.T, queues ...string) *env {
	t.Helper()
	brokertest.Dial(t)
	e := &env{t: t, prefix: brokertest.Prefix(t)}
	for _, q := range queues {
		e.queues = append(e.queues, e.prefix+"."+q)
	}
	p, err := amqpretry.Config{Prefix: e.prefix, Backend: delay.TTLTiers(testTiers...)}.Plan(e.queues...)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p)
	brokertest.Cleanup(t, e.queues, nil)
	h, err := handoff.Dial(backend.HandoffConfig{URI: brokertest.URI()})
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
	return runArgs(append(slices.Clone(args), e.flags()...)...)
}

// runArgs runs the command with stdin not a terminal, as in a script.
func runArgs(args ...string) (int, string, string) {
	return runInput(false, "", args...)
}

// runInput runs the command with stdin reading input, a terminal or not.
func runInput(terminal bool, input string, args ...string) (int, string, string) {
	var stdout, stderr bytes.Buffer
	code := runWith(context.Background(), args, strings.NewReader(input), terminal, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

func (e *env) queueFlags() []string {
	var out []string
	for _, q := range e.queues {
		out = append(out, "--queue", q)
	}
	return out
}

func (e *env) apply() {
	e.t.Helper()
	if code, out, errOut := e.run(append([]string{"topology", "apply"}, e.queueFlags()...)...); code != exitOK {
		e.t.Fatalf("apply exited %d:\n%s%s", code, out, errOut)
	}
}

// poison publishes n poisoned messages, message i failing on queue i % len(queues).
func (e *env) poison(n int) {
	e.t.Helper()
	for i := range n {
		q := e.queues[i%len(e.queues)]
		msg := message.NewMessage(fmt.Sprintf("m%04d", i), []byte(fmt.Sprintf("order %d", i)))
		middleware.Envelope{
			Queue: q, Topic: q, Handler: "h", Reason: amqpretry.ReasonMaxAttempts, Error: "warehouse offline",
			ErrorTypes: []string{"*errors.errorString"}, Attempt: 5, MaxAttempts: 5, LastFailure: time.Now(),
		}.Write(msg.Metadata)
		if err := e.h.ToQueue(context.Background(), e.prefix+".poison", msg); err != nil {
			e.t.Fatal(err)
		}
	}
}

func TestTopologyVerifyFailsThenPassesAfterApply(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "orders", "billing")
	args := append([]string{"topology", "verify"}, e.queueFlags()...)
	code, out, _ := e.run(args...)
	if code != exitFailed {
		t.Fatalf("verify on a fresh prefix exited %d:\n%s", code, out)
	}
	// The fix names every --queue (issue 19: it named none).
	fix := "amqpretry topology apply --backend ttl-tiers --prefix " + e.prefix + " --tiers 1s,2s --queue " + e.queues[0] + " --queue " + e.queues[1]
	for _, want := range []string{`queue "` + e.prefix + `.delay.1s": missing`, `exchange "` + e.prefix + `.deliver": missing`,
		`work queue "` + e.queues[0] + `": missing`, "create what is missing with: " + fix + "\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("verify output lacks %q:\n%s", want, out)
		}
	}
	e.apply()
	code, out, _ = e.run(append(args, "--bind")...)
	if code != exitOK || !strings.HasPrefix(out, "14 ok, 0 missing, 0 mismatched, 0 errors, 0 unchecked\n") {
		t.Fatalf("verify --bind after apply exited %d:\n%s", code, out)
	}
	code, out, _ = e.run(append(args, "--json")...)
	var v struct {
		OK       bool `json:"ok"`
		Findings []struct {
			Status string `json:"status"`
		} `json:"findings"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil || code != exitOK || !v.OK || len(v.Findings) == 0 {
		t.Fatalf("verify --json: %d %v %s", code, err, out)
	}
}

// TestVerifyUncheckedIsNotOK (issue 19): as a user without configure permission, a
// queue whose arguments differ was called ok ("1 ok"). Arguments not compared show as
// unchecked, in the lines and in the summary.
func TestVerifyUncheckedIsNotOK(t *testing.T) {
	e := newEnv(t, "orders")
	e.apply()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	tier := e.prefix + ".delay.2s"
	if _, err := ch.QueueDelete(tier, false, false, false); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(tier, true, false, false, false, amqp.Table{"x-queue-type": "quorum", "x-message-ttl": int64(9000)}); err != nil {
		t.Fatal(err)
	}
	t.Setenv(uriEnv, brokertest.RestrictedUser(t))
	code, out, errOut := e.run(append([]string{"topology", "verify"}, e.queueFlags()...)...)
	if !strings.Contains(out, `queue "`+tier+`": unchecked, exists but its arguments were not compared`) {
		t.Errorf("the mismatched queue is not reported unchecked (%d):\n%s%s", code, out, errOut)
	}
	// Nothing whose arguments could not be compared counts as ok: 2 delay queues, the
	// parking and poison queues, 3 exchanges, and the 4 bindings not asserted; the work
	// queue is only checked to exist.
	if !strings.Contains(out, "1 ok, 0 missing, 0 mismatched, 0 errors, 11 unchecked\n") ||
		!strings.Contains(out, "7 exchanges or queues exist but their arguments were not compared") {
		t.Errorf("summary (%d):\n%s", code, out)
	}
}

// TestPoisonShowEveryMessageWithTheID (issue 51): poison show of an ID that two
// messages share (a copy published twice, a message poisoned again after a redrive)
// showed the first. It shows each, numbered, as --json does, and changes nothing.
func TestPoisonShowEveryMessageWithTheID(t *testing.T) {
	e := newEnv(t, "orders")
	e.apply()
	e.poison(3) // m0000, m0001, m0002
	again := message.NewMessage("m0001", []byte("order 1, again"))
	middleware.Envelope{Queue: e.queues[0], Topic: e.queues[0], Handler: "h", Reason: amqpretry.ReasonPermanent, Error: "poisoned again",
		Attempt: 1, MaxAttempts: 5, LastFailure: time.Now()}.Write(again.Metadata)
	if err := e.h.ToQueue(context.Background(), e.prefix+".poison", again); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := e.run("poison", "show", "m0001")
	first, second := strings.Index(out, "message m0001 (1 of 2 with this id)\n"), strings.Index(out, "message m0001 (2 of 2 with this id)\n")
	if code != exitOK || first < 0 || second < first || !strings.Contains(out[first:second], "warehouse offline") || !strings.Contains(out[second:], "poisoned again") ||
		strings.Contains(out, "m0000") || strings.Contains(out, "m0002") {
		t.Errorf("poison show m0001 (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut = e.run("poison", "show", "m0001", "m0002", "--json")
	var msgs []struct {
		UUID  string `json:"uuid"`
		Error string `json:"error"`
	}
	if err := json.Unmarshal([]byte(out), &msgs); err != nil || code != exitOK || len(msgs) != 3 || msgs[0].UUID != "m0001" || msgs[1].UUID != "m0002" || msgs[2].Error != "poisoned again" {
		t.Errorf("poison show m0001 m0002 --json (%d): %v %+v\n%s%s", code, err, msgs, out, errOut)
	}
	if n := brokertest.QueueLength(t, e.prefix+".poison"); n != 4 {
		t.Errorf("the poison queue holds %d after show, want 4", n)
	}
}

func TestPoisonListShowDryRun(t *testing.T) {
	e := newEnv(t, "orders", "billing")
	e.apply()
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
	if code != exitOK || !strings.Contains(out, "dry run: would redrive 4 of 4") || !strings.Contains(out, "m0000 -> "+e.queues[0]+" (max-attempts: warehouse offline)") {
		t.Errorf("redrive dry run (%d):\n%s", code, out)
	}
	// A purge dry run names what it would delete, without an arrow as if it moved it.
	code, out, _ = e.run("poison", "purge", "--dry-run", "--queue", e.queues[0])
	if code != exitOK || !strings.Contains(out, "dry run: would purge 2 of 4") || strings.Contains(out, "->") || !strings.Contains(out, "  m0000 (max-attempts: warehouse offline)") {
		t.Errorf("purge dry run (%d):\n%s", code, out)
	}
	if n := brokertest.QueueLength(t, e.prefix+".poison"); n != 4 {
		t.Errorf("poison queue has %d after dry runs, want 4", n)
	}
	for _, q := range e.queues {
		if n := brokertest.QueueLength(t, q); n != 0 {
			t.Errorf("%s got %d from a dry run", q, n)
		}
	}
	code, out, _ = e.run("poison", "list", "--json")
	var l struct { // the keys a script reads: snake_case throughout
		Messages []struct {
			UUID   string `json:"uuid"`
			Reason string `json:"reason"`
		} `json:"messages"`
	}
	if err := json.Unmarshal([]byte(out), &l); err != nil || code != exitOK || len(l.Messages) != 4 || l.Messages[0].UUID != "m0000" || l.Messages[3].UUID != "m0003" || l.Messages[0].Reason != "max-attempts" {
		t.Errorf("list --json after dry runs: %v\n%s", err, out)
	}
	code, out, _ = e.run("poison", "purge", "--reason", "max-attempts", "--queue", e.queues[1], "--yes")
	if code != exitOK || !strings.Contains(out, "purged 2 of 4 messages") {
		t.Errorf("purge (%d):\n%s", code, out)
	}
}

// TestParkedOutput (issue 19): a parked retry scheduled by other code has no envelope:
// its attempt shows "-", not 0, and a dry run names its queue and no empty reason.
func TestParkedOutput(t *testing.T) {
	e := newEnv(t, "orders")
	e.apply()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	// What ttl-tiers parks: dead-lettered to the delivery exchange with the work queue
	// as routing key, with no queue bound under it.
	gone := e.prefix + ".gone"
	if err := ch.Publish(e.prefix+".deliver", gone, false, false, amqp.Publishing{Body: []byte("x"), MessageId: "scheduled-1"}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for brokertest.QueueLength(t, e.prefix+".parking") != 1 {
		if time.Now().After(deadline) {
			t.Fatal("nothing parked")
		}
		time.Sleep(100 * time.Millisecond)
	}
	code, out, _ := e.run("parking", "list")
	if code != exitOK || !regexp.MustCompile(`\s`+regexp.QuoteMeta(gone)+`\s+-\s+-\s+-\n`).MatchString(out) {
		t.Errorf("parking list (%d):\n%s", code, out)
	}
	// Issue 43: the dry run said it would redrive it; it checks the queue as the run
	// does (passively) and says the message would stay, exiting as the run does.
	for _, dry := range []string{"--dry-run", "--dry-run=false"} {
		code, out, _ = e.run("parking", "redrive", dry)
		if code != exitFailed || !strings.Contains(out, " of 1 messages in "+e.prefix+".parking (1 scanned, 0 not matching, 1 unroutable)") ||
			!strings.Contains(out, `  left in place, queue "`+gone+`" does not exist: scheduled-1`) {
			t.Errorf("parking redrive %s to a missing queue (%d):\n%s", dry, code, out)
		}
	}
	if !strings.Contains(out, "redriven 0 of 1") {
		t.Errorf("parking redrive to a missing queue:\n%s", out)
	}
	brokertest.Cleanup(t, []string{gone}, nil)
	if _, err := ch.QueueDeclare(gone, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	code, out, _ = e.run("parking", "redrive", "--dry-run")
	if code != exitOK || !strings.Contains(out, "dry run: would redrive 1 of 1 messages") || !strings.Contains(out, " -> "+gone+" (no failure envelope)") || strings.Contains(out, "(: )") {
		t.Errorf("parking redrive --dry-run (%d):\n%s", code, out)
	}
	if _, err := ch.QueueDelete(gone, false, false, false); err != nil {
		t.Fatal(err)
	}
	code, out, _ = e.run("status", "--rabbitmqctl", "off")
	if code != exitFailed || !strings.Contains(out, "PARKED 1 messages in "+e.prefix+".parking") {
		t.Errorf("status with a parked message (%d):\n%s", code, out)
	}
}

// TestStatus (issue 19): status exits 1 whenever something is flagged, with or without
// --check; a missing queue shows READY "-"; --check prints only the flags.
func TestStatus(t *testing.T) {
	e := newEnv(t, "orders")
	code, out, errOut := e.run("status", "--rabbitmqctl", "off", "--queue", e.queues[0])
	if code != exitFailed {
		t.Errorf("status on a fresh prefix exited %d:\n%s%s", code, out, errOut)
	}
	if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(e.prefix) + `\.poison\s+poison\s+-\s+-\s+-\s+-\s+-\s+-\s+-\s+MISSING$`).MatchString(out) {
		t.Errorf("a missing queue does not show READY -:\n%s", out)
	}
	fix := "`amqpretry topology apply --backend ttl-tiers --prefix " + e.prefix + " --tiers 1s,2s --queue " + e.queues[0] + "`"
	if !strings.Contains(out, "MISSING work queue "+e.queues[0]+": create it with "+fix) {
		t.Errorf("no fix for the missing work queue:\n%s", out)
	}
	code, out, _ = e.run("status", "--check", "--rabbitmqctl", "off")
	if code != exitFailed || !strings.HasPrefix(out, "  MISSING delay queue") || strings.Contains(out, "QUEUE") {
		t.Errorf("status --check (%d):\n%s", code, out)
	}
	e.apply()
	code, out, _ = e.run("status", "--rabbitmqctl", "off", "--queue", e.queues[0])
	if code != exitOK || !strings.Contains(out, "nothing flagged") {
		t.Errorf("status after apply (%d):\n%s", code, out)
	}
	if code, out, _ = e.run("status", "--check", "--rabbitmqctl", "off"); code != exitOK || out != "" {
		t.Errorf("status --check with nothing flagged (%d): %q", code, out)
	}
}

// TestStatusCounts: the broker's own counts through rabbitmqctl: the file descriptors
// and sockets (rabbitmqctl status on 3.x, /proc of the broker on 4.x), and each queue.
func TestStatusCounts(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "orders")
	e.apply()
	ctl := strings.Join(brokertest.CtlCommand(), " ")
	if _, err := exec.LookPath(brokertest.CtlCommand()[0]); err != nil {
		t.Skipf("needs %s", ctl)
	}
	code, out, errOut := e.run("status", "--json", "--rabbitmqctl", ctl, "--queue", e.queues[0])
	var s struct {
		Counted             bool   `json:"counted"`
		FileDescriptors     int    `json:"file_descriptors"`
		FileDescriptorLimit int    `json:"file_descriptor_limit"`
		CountsError         string `json:"counts_error"`
		Queues              []struct {
			Name    string `json:"name"`
			Role    string `json:"role"`
			Counted bool   `json:"counted"`
			Members int    `json:"members"`
			Online  int    `json:"members_online"`
		} `json:"queues"`
		Flags []struct {
			Kind  string `json:"kind"`
			Count int    `json:"count"`
			Limit int    `json:"limit"`
		} `json:"flags"`
	}
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatalf("status --json --rabbitmqctl (%d): %v\n%s%s", code, err, out, errOut)
	}
	// A shared broker may be near its limits for reasons of its own: that flag (and
	// its exit status) is the only one allowed here.
	nearLimit := false
	for _, f := range s.Flags {
		if f.Kind != "near-limit" {
			t.Errorf("flag %+v", f)
		}
		nearLimit = true
		t.Logf("the broker is near a limit: %+v", f)
	}
	if want := map[bool]int{false: exitOK, true: exitFailed}[nearLimit]; code != want {
		t.Errorf("status exited %d, want %d:\n%s%s", code, want, out, errOut)
	}
	if !s.Counted || s.FileDescriptors <= 0 || s.FileDescriptorLimit <= 0 || s.CountsError != "" {
		t.Errorf("broker counts: %+v", s)
	}
	for _, q := range s.Queues {
		if !q.Counted {
			t.Errorf("queue %s not counted", q.Name)
		}
		// The library's own queues are quorum queues: one member on one node, online.
		if q.Role != "work" && (q.Members != 1 || q.Online != 1) {
			t.Errorf("queue %s: %d of %d members online, want 1 of 1 (a quorum queue on one node)", q.Name, q.Online, q.Members)
		}
	}
	// A rabbitmqctl that reaches another node than the broker at the URI (a host may
	// run several: this one listens on another port) is refused, not believed.
	_, err := rabbitmqctlCounts(brokertest.CtlCommand(), "amqp://guest:guest@127.0.0.1:1/", time.Minute)(context.Background())
	if err == nil || !strings.Contains(err.Error(), "not on 1 of AMQP_URI") {
		t.Errorf("counts from another node: %v", err)
	}
	// A command that does not answer in time is killed, and the run says so.
	hung := filepath.Join(t.TempDir(), "hung-rabbitmqctl")
	if err := os.WriteFile(hung, []byte("#!/bin/sh\nsleep 60\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	code, out, errOut = e.run("status", "--rabbitmqctl", hung, "--ctl-timeout", "500ms")
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("a hung rabbitmqctl kept status waiting %s", took)
	}
	if code != exitFailed || !strings.Contains(out+errOut, "no answer within 500ms") {
		t.Errorf("hung rabbitmqctl (%d):\n%s%s", code, out, errOut)
	}
}

// TestJSONKeysSnakeCase (issue 19): every --json output uses snake_case keys only
// (topology apply mixed "Exchanges" with "work_queues").
func TestJSONKeysSnakeCase(t *testing.T) {
	e := newEnv(t, "orders")
	for _, args := range [][]string{
		append([]string{"topology", "apply", "--json"}, e.queueFlags()...),
		append([]string{"topology", "plan", "--json"}, e.queueFlags()...),
		append([]string{"topology", "verify", "--json"}, e.queueFlags()...),
		{"status", "--json", "--rabbitmqctl", "off"},
		{"poison", "list", "--json"},
		{"poison", "show", "--json", "m0000"},
		{"poison", "redrive", "--json", "--dry-run"},
		{"version", "--json"},
	} {
		if args[1] == "list" {
			e.poison(1)
		}
		code, out, errOut := e.run(args...)
		var v any
		if err := json.Unmarshal([]byte(out), &v); err != nil || code != exitOK {
			t.Errorf("%v (%d): %v\n%s%s", args, code, err, out, errOut)
			continue
		}
		if bad := badKeys(v, ""); len(bad) > 0 {
			t.Errorf("%v: keys not snake_case: %v", args, bad)
		}
	}
}

var snake = regexp.MustCompile(`^[a-z0-9_]+$`)

// badKeys returns the keys of v, recursively, that are not snake_case, leaving out the
// values of maps keyed by data (arguments, metadata).
func badKeys(v any, parent string) []string {
	var out []string
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			if !snake.MatchString(k) {
				out = append(out, parent+"."+k)
			}
			if k != "args" && k != "metadata" {
				out = append(out, badKeys(x, k)...)
			}
		}
	case []any:
		for _, x := range v {
			out = append(out, badKeys(x, parent)...)
		}
	}
	return out
}

// TestRedriveKilledMidRun: 1,000 poisoned messages redriven at a rate limit, the
// command killed with SIGKILL mid-run: none lost, each redriven one on its own queue,
// the rest still in the poison queue. A message whose confirm arrived just before the
// kill may be in both places (at-least-once): at most one.
func TestRedriveKilledMidRun(t *testing.T) {
	const total = 1000
	e := newEnv(t, "orders", "billing", "shipping", "email")
	e.apply()
	e.poison(total)

	cmd := exec.Command(binary, append([]string{"poison", "redrive", "--rate", "200/s"}, e.flags()...)...)
	cmd.Env = append(os.Environ(), uriEnv+"="+brokertest.URI())
	var stdout, stderr lockedBuffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitProgress(t, cmd, &stderr) // mid-run: some redriven, most not
	elapsed := time.Since(start)
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	t.Logf("killed command's stderr:\n%s", stderr.String())
	if !strings.Contains(stderr.String(), "progress: ") {
		t.Errorf("no line of counts on a stderr that is not a terminal")
	}

	// The broker requeues what the dead connection had unacked: wait until it is back.
	poison := e.prefix + ".poison"
	seen := map[string]int{}
	redriven := 0
	for _, q := range e.queues {
		for _, msg := range brokertest.Drain(t, q) {
			seen[msg.UUID]++
			redriven++
			if got := middleware.ReadEnvelope(msg.Metadata).Queue; got != q {
				t.Errorf("message %s failed on %s but was redriven to %s", msg.UUID, got, q)
			}
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for brokertest.QueueLength(t, poison)+redriven < total && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	left := brokertest.Drain(t, poison)
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
	if limit := int(200*elapsed.Seconds()) + 200; redriven > limit {
		t.Errorf("%d redriven in %s at 200/s: the rate limit is not kept", redriven, elapsed.Round(time.Millisecond))
	}
	if dups > 1 {
		t.Errorf("%d messages in both places, want at most 1", dups)
	}
}

// TestRedriveInterrupted: SIGINT stops a redrive between two messages: exit status
// 130, and every message is in exactly one place.
func TestRedriveInterrupted(t *testing.T) {
	const total = 300
	e := newEnv(t, "orders", "billing")
	e.apply()
	e.poison(total)
	cmd := exec.Command(binary, append([]string{"poison", "redrive", "--rate", "100/s"}, e.flags()...)...)
	cmd.Env = append(os.Environ(), uriEnv+"="+brokertest.URI())
	var stdout, stderr lockedBuffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitProgress(t, cmd, &stderr) // mid-run: some redriven, most not
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
}

// TestWindowKeepsOrder: with a window smaller than the run, the run stops when the
// window is full, and what it kept is back in its place, in order.
func TestWindowKeepsOrder(t *testing.T) {
	e := newEnv(t, "orders", "billing")
	e.apply()
	e.poison(10) // even: orders, odd: billing
	code, out, _ := e.run("poison", "redrive", "--queue", e.queues[1], "--window", "3")
	if code != exitOK || !strings.Contains(out, "stopped: 3 messages kept (--window); run again to continue") {
		t.Fatalf("redrive with a small window (%d):\n%s", code, out)
	}
	var got []string
	for _, msg := range brokertest.Drain(t, e.prefix+".poison") {
		got = append(got, msg.UUID)
	}
	// m0000, m0002, m0004 were kept (not matching); m0001, m0003 redriven before the
	// window filled; the rest was never looked at. Kept and never taken each keep their
	// order (a quorum queue may put the kept behind the others).
	keptIDs := []string{"m0000", "m0002", "m0004"}
	kept := slices.DeleteFunc(slices.Clone(got), func(id string) bool { return !slices.Contains(keptIDs, id) })
	rest := slices.DeleteFunc(slices.Clone(got), func(id string) bool { return slices.Contains(keptIDs, id) })
	if !slices.Equal(kept, keptIDs) || !slices.Equal(rest, []string{"m0005", "m0006", "m0007", "m0008", "m0009"}) {
		t.Errorf("poison queue after the run: %v", got)
	}
}

// lockedBuffer is an io.Writer that a test reads while a command writes to it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// waitProgress waits until the running redrive cmd reports on stderr a progress line
// with at least one message redriven: the event that puts a run mid-way. It kills cmd
// and fails the test if none comes within a minute.
func waitProgress(t *testing.T, cmd *exec.Cmd, stderr *lockedBuffer) {
	t.Helper()
	redriven := regexp.MustCompile(`progress: \d+/\d+ scanned, [1-9]\d* redriven`)
	for deadline := time.Now().Add(time.Minute); !redriven.MatchString(stderr.String()); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			t.Fatalf("no progress line with a message redriven within a minute; stderr:\n%s", stderr.String())
		}
	}
}

// TestVersionIsTheChangelogsNewestRelease: `amqpretry version` built from a checkout
// prints the release CHANGELOG.md names first, so that one cannot be bumped without
// the other.
func TestVersionIsTheChangelogsNewestRelease(t *testing.T) {
	text, err := os.ReadFile("../../CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^## \[(\d+\.\d+\.\d+)\]`).FindSubmatch(text)
	if m == nil {
		t.Fatal("CHANGELOG.md has no release heading (## [X.Y.Z] - date)")
	}
	if want := "v" + string(m[1]); release != want {
		t.Errorf("the command's release is %s, CHANGELOG.md's newest %s: change both", release, want)
	}
	if v := buildVersion(); !strings.HasPrefix(v, release+" ") {
		t.Errorf("a build from a checkout prints %q, not the release %s", v, release)
	}
}
