package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/creack/pty"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
)

// TestDestructiveMovesAsk (issue 33): a purge without --dry-run dropped every match at
// once. Now, when stdin is not a terminal, it refuses without --yes (exit 2, nothing
// dialled); on a terminal it shows the dry run and asks: "n" changes nothing (exit 1),
// "y" purges what was shown. teardown --force asks the same way.
func TestDestructiveMovesAsk(t *testing.T) {
	e := newEnv(t, "orders", "billing")
	e.apply()
	e.poison(4) // m0000, m0002 failed on orders; m0001, m0003 on billing
	poison := e.prefix + ".poison"
	in := func(terminal bool, input string, args ...string) (int, string, string) {
		t.Helper()
		return runInput(terminal, input, append(args, e.flags()...)...)
	}
	if code, out, errOut := in(false, "y\n", "poison", "purge", "--all"); code != exitUsage || !strings.Contains(errOut, "pass --yes to confirm") {
		t.Errorf("purge, stdin not a terminal, no --yes (%d):\n%s%s", code, out, errOut)
	}
	if n := brokertest.QueueLength(t, poison); n != 4 {
		t.Fatalf("refused purge left %d of 4", n)
	}
	code, out, errOut := in(true, "n\n", "poison", "purge", "--all")
	if code != exitFailed || out != "" || !strings.Contains(errOut, "dry run: would purge 4 of 4 messages in "+poison) ||
		!strings.Contains(errOut, "purge these 4 messages for good? [y/N]") || !strings.Contains(errOut, "not confirmed: nothing changed") {
		t.Errorf("purge declined at the prompt (%d):\nstdout %q\nstderr %s", code, out, errOut)
	}
	if n := brokertest.QueueLength(t, poison); n != 4 {
		t.Fatalf("declined purge left %d of 4", n)
	}
	code, out, errOut = in(true, "y\n", "poison", "purge", "--queue", e.queues[0])
	if code != exitOK || !strings.Contains(errOut, "  m0000 (max-attempts") || !strings.Contains(errOut, "  m0002 (max-attempts") ||
		!strings.Contains(out, "purged 2 of 4 messages in "+poison) {
		t.Errorf("purge confirmed at the prompt (%d):\n%s%s", code, out, errOut)
	}
	if code, out, errOut := in(false, "", "poison", "purge", "--all", "--yes"); code != exitOK || !strings.Contains(out, "purged 2 of 2 messages") {
		t.Errorf("purge --yes (%d):\n%s%s", code, out, errOut)
	}

	// teardown --force: the dry run, then the question.
	teardown := []string{"teardown", "--backend", "ttl-tiers", "--force", "--rabbitmqctl", "off"}
	if code, out, errOut := in(false, "", teardown...); code != exitUsage || !strings.Contains(errOut, "pass --yes") {
		t.Errorf("teardown --force, not a terminal (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut = in(true, "\n", teardown...)
	if code != exitFailed || !strings.Contains(errOut, "dry run: would remove 2 queues, 2 exchanges, 2 bindings under prefix "+e.prefix) ||
		!strings.Contains(errOut, "remove these 2 queues and 2 exchanges for good? [y/N]") {
		t.Errorf("teardown --force declined (%d):\n%s%s", code, out, errOut)
	}
	if brokertest.QueueLength(t, e.prefix+".delay.1s") != 0 || !queueExists(t, e.prefix+".delay.1s") {
		t.Fatal("a declined teardown removed the tier queue")
	}
	code, out, errOut = in(true, "yes\n", teardown...)
	if code != exitOK || !strings.Contains(out, "removed 2 queues, 2 exchanges, 2 bindings under prefix "+e.prefix) || queueExists(t, e.prefix+".delay.1s") {
		t.Errorf("teardown --force confirmed (%d):\n%s%s", code, out, errOut)
	}
}

// queueExists declares queue passively.
func queueExists(t *testing.T, queue string) bool {
	t.Helper()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close() //nolint:errcheck // closed by the broker on 404
	_, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	return err == nil
}

// TestAsk: the answers the prompt takes; an interrupt while it waits ends it.
func TestAsk(t *testing.T) {
	for input, want := range map[string]bool{"y\n": true, "YES\n": true, " yes \n": true, "n\n": false, "\n": false, "": false, "yess\n": false} {
		var stderr bytes.Buffer
		a := &app{ctx: context.Background(), stdin: strings.NewReader(input), stderr: &stderr}
		if got, err := a.ask("go?"); got != want || err != nil || stderr.String() != "go? [y/N] " {
			t.Errorf("answer %q: %v %v, asked %q", input, got, err, stderr.String())
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r, w := ioPipe(t)
	defer w.Close()
	a := &app{ctx: ctx, stdin: r, stderr: &bytes.Buffer{}}
	if ok, err := a.ask("go?"); ok || err != context.Canceled {
		t.Errorf("interrupted prompt: %v %v", ok, err)
	}
}

// TestTeardownNothingThere (issue 33): teardown of a prefix with nothing declared
// printed "removed 0 queues, 0 exchanges, 34 bindings" and exited 0. It says nothing
// was found, exits 1, and --json carries the same.
func TestTeardownNothingThere(t *testing.T) {
	brokertest.Dial(t)
	t.Setenv(uriEnv, brokertest.URI())
	prefix := brokertest.Prefix(t) // nothing declared under it
	for _, dry := range []string{"--dry-run=false", "--dry-run"} {
		code, out, errOut := runArgs("teardown", "--backend", "ttl-tiers", "--prefix", prefix, "--rabbitmqctl", "off", "--yes", dry)
		if code != exitFailed || strings.Contains(out, "removed") || !strings.Contains(errOut, `nothing to remove: no queue or exchange of any backend under prefix "`+prefix+`"`) {
			t.Errorf("teardown %s of an empty prefix (%d):\n%s%s", dry, code, out, errOut)
		}
	}
	code, out, errOut := runArgs("teardown", "--backend", "ttl-tiers", "--prefix", prefix, "--rabbitmqctl", "off", "--yes", "--json")
	var v struct {
		Queues    []string `json:"queues"`
		Exchanges []string `json:"exchanges"`
		Bindings  *int     `json:"bindings"`
		Error     string   `json:"error"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil || code != exitFailed || v.Bindings == nil || *v.Bindings != 0 ||
		len(v.Queues)+len(v.Exchanges) != 0 || !strings.Contains(v.Error, "nothing to remove") {
		t.Errorf("teardown --json of an empty prefix (%d): %v\n%s%s", code, err, out, errOut)
	}
}

// TestWaitingOnDelayedExchange (issue 33): on delayed-exchange, waiting list,
// retry-now and purge reported "0 of 0" with exit 0 (or asked for rabbitmqctl). They
// refuse with the plugin's reason, exit 1. Needs no plugin: nothing can be read there.
func TestWaitingOnDelayedExchange(t *testing.T) {
	brokertest.Dial(t)
	t.Setenv(uriEnv, brokertest.URI())
	prefix := brokertest.Prefix(t)
	common := []string{"--backend", "delayed-exchange", "--prefix", prefix, "--rabbitmqctl", "off"}
	for _, args := range [][]string{
		{"waiting", "list"}, {"waiting", "list", "--queue", prefix + ".orders"},
		{"waiting", "retry-now", "--queue", prefix + ".orders"}, {"waiting", "retry-now", "--queue", prefix + ".orders", "--dry-run"},
		{"waiting", "purge", "--all", "--dry-run"}, {"waiting", "purge", "--all", "--yes"},
	} {
		code, out, errOut := runArgs(append(args, common...)...)
		if code != exitFailed || strings.Contains(out, "0 of 0") || !strings.Contains(errOut, "the delayed-message plugin offers no way to list, bring back or drop the retries it keeps") ||
			!strings.Contains(errOut, prefix+".delayed") || !strings.Contains(errOut, "amqpretry status") {
			t.Errorf("%q on delayed-exchange (%d):\n%s%s", args, code, out, errOut)
		}
	}
}

// TestStatusShowsPluginCount (issue 33): with retries waiting in the plugin, status
// printed only "nothing flagged" (the count was in --json alone). The text names the
// count, and does not say nothing is there.
func TestStatusShowsPluginCount(t *testing.T) {
	var stdout bytes.Buffer
	a := &app{stdout: &stdout, uri: "amqp://guest:guest@127.0.0.1:5672/"}
	s := ops.Status{Broker: "3.10.8", Backend: delay.DelayedExchange().Name(), Prefix: "shop", DelayedExchange: true, DelayedExchangeName: "shop.delayed",
		PluginCounted: true, PluginWaiting: 3, Flags: []ops.Flag{}}
	a.printStatus(s, amqpretry.Config{Backend: delay.DelayedExchange(), Prefix: "shop"}, nil, "auto", false, false, false)
	out := stdout.String()
	if !strings.Contains(out, "waiting in the plugin: 3 retries, by its own count") || strings.Contains(out, "nothing flagged") ||
		!strings.Contains(out, "3 retries wait in the delayed-message plugin (exchange shop.delayed) until due") {
		t.Errorf("status text with 3 retries in the plugin:\n%s", out)
	}
	stdout.Reset()
	s.PluginCounted, s.PluginWaiting = false, 0
	a.printStatus(s, amqpretry.Config{Backend: delay.DelayedExchange(), Prefix: "shop"}, nil, "auto", false, false, false)
	if out := stdout.String(); !strings.Contains(out, "waiting in the plugin: unknown") {
		t.Errorf("status text, the plugin's count unread:\n%s", out)
	}
}

// TestDelayedExchangeWithPlugin (issue 33), where the delayed-message plugin runs
// (RabbitMQ up to 4.2 with rabbitmq_delayed_message_exchange enabled): three retries
// wait in it. status shows the plugin's count in its text; waiting list refuses
// naming it; teardown refuses advising to wait for the count to reach 0, not
// retry-now.
func TestDelayedExchangeWithPlugin(t *testing.T) {
	if _, err := brokertest.Ctl(t.Context(), "-q", "list_queues", "name"); err != nil {
		t.Skipf("needs rabbitmqctl: %v", err)
	}
	e := newEnv(t, "orders")
	cfg := amqpretry.Config{Backend: delay.DelayedExchange(), Prefix: e.prefix}
	p, err := cfg.Plan(e.queues...)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p)
	flags := []string{"--backend", "delayed-exchange", "--prefix", e.prefix, "--rabbitmqctl", strings.Join(brokertest.CtlCommand(), " ")}
	run := func(args ...string) (int, string, string) { t.Helper(); return runArgs(append(args, flags...)...) }
	if code, out, errOut := runArgs("topology", "apply", "--backend", "delayed-exchange", "--prefix", e.prefix, "--queue", e.queues[0]); code != exitOK {
		t.Skipf("needs the rabbitmq_delayed_message_exchange plugin, which this broker does not run (topology apply: %d %s%s)", code, out, errOut)
	}
	b, err := backend.Open(delay.DelayedExchange(), backend.Setup{Prefix: e.prefix, Env: backend.Env{Handoff: e.h}})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"p-a", "p-b", "p-c"} {
		msg := message.NewMessage(id, []byte(id))
		middleware.Envelope{Queue: e.queues[0], Attempt: 1, Due: time.Now().Add(10 * time.Minute), LastFailure: time.Now()}.Write(msg.Metadata)
		wdelay.Message(msg, wdelay.For(10*time.Minute))
		if err := (backend.Scheduler{Backend: b}).Publish(e.queues[0], msg); err != nil {
			t.Fatal(err)
		}
	}
	var out string
	for deadline := time.Now().Add(30 * time.Second); !strings.Contains(out, "waiting in the plugin: 3 retries"); {
		if time.Now().After(deadline) {
			t.Fatalf("status never showed the plugin's 3 retries:\n%s", out)
		}
		_, out, _ = run("status", "--queue", e.queues[0])
	}
	if strings.Contains(out, "nothing flagged") {
		t.Errorf("status says nothing flagged while 3 retries wait:\n%s", out)
	}
	if code, out, errOut := run("waiting", "list"); code != exitFailed || !strings.Contains(errOut, "3 wait there now") {
		t.Errorf("waiting list (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut := run("teardown", "--yes")
	if code != exitFailed || !strings.Contains(errOut, "plugin's count reaches 0") || strings.Contains(errOut, "retry-now") || !strings.Contains(out, "3 messages waiting, in "+e.prefix+".delayed: 3") {
		t.Errorf("teardown while 3 wait in the plugin (%d):\n%s%s", code, out, errOut)
	}
}

// ioPipe is an os.Pipe closed at the end of the test.
func ioPipe(t *testing.T) (*os.File, *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r, w
}

// TestPurgeAsksOnATerminal (issue 33): the command itself, on a pseudo-terminal: it
// detects the terminal, shows the dry run and asks; "n" leaves the messages, "y"
// purges them.
func TestPurgeAsksOnATerminal(t *testing.T) {
	e := newEnv(t, "orders")
	e.apply()
	e.poison(2)
	poison := e.prefix + ".poison"
	for _, tt := range []struct {
		answer string
		code   int
		left   int
		out    string
	}{
		{"n", exitFailed, 2, "not confirmed: nothing changed"},
		{"y", exitOK, 0, "purged 2 of 2 messages in " + poison},
	} {
		code, out := onTerminal(t, tt.answer, append([]string{"poison", "purge", "--all"}, e.flags()...)...)
		if !strings.Contains(out, "dry run: would purge 2 of 2 messages in "+poison) || !strings.Contains(out, "purge these 2 messages for good? [y/N] ") {
			t.Errorf("before the question:\n%s", out)
		}
		if code != tt.code || !strings.Contains(out, tt.out) {
			t.Errorf("answer %q: exit %d, want %d and %q:\n%s", tt.answer, code, tt.code, tt.out, out)
		}
		if n := brokertest.QueueLength(t, poison); n != tt.left {
			t.Errorf("answer %q: %d left in the poison queue, want %d", tt.answer, n, tt.left)
		}
	}
}

// onTerminal runs the command with args on a pseudo-terminal, answers its question
// ("[y/N] ") with answer, and returns its exit status and everything it wrote there
// (without answering, when it ends without asking).
func onTerminal(t *testing.T, answer string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(binary, args...)
	tty, err := pty.Start(cmd)
	if err != nil {
		t.Skipf("no pseudo-terminal here: %v", err)
	}
	var out lockedBuffer
	copied := make(chan struct{})
	go func() { _, _ = io.Copy(&out, tty); close(copied) }() // ends with EIO once the command exits
	for deadline := time.Now().Add(time.Minute); !strings.Contains(out.String(), "[y/N] "); time.Sleep(20 * time.Millisecond) {
		select {
		case <-copied: // the command ended without asking
			_ = cmd.Wait()
			_ = tty.Close()
			return cmd.ProcessState.ExitCode(), out.String()
		default:
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			t.Fatalf("no question within a minute:\n%s", out.String())
		}
	}
	if _, err := tty.Write([]byte(answer + "\n")); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	<-copied
	_ = tty.Close()
	return cmd.ProcessState.ExitCode(), out.String()
}
