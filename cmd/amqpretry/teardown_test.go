package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

// ctlFlag is --rabbitmqctl with the broker's own rabbitmqctl, or a skip when there is
// none (on RabbitMQ 4.x the one on PATH serves another node).
func ctlFlag(t *testing.T) []string {
	t.Helper()
	if _, err := brokertest.Ctl(t.Context(), "-q", "list_queues", "name"); err != nil {
		t.Skipf("needs rabbitmqctl: %v", err)
	}
	return []string{"--rabbitmqctl", strings.Join(brokertest.CtlCommand(), " ")}
}

// exchangeExists declares exchange passively.
func exchangeExists(t *testing.T, exchange string) bool {
	t.Helper()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close() //nolint:errcheck // closed by the broker on 404
	return ch.ExchangeDeclarePassive(exchange, amqp.ExchangeDirect, true, false, false, false, nil) == nil
}

// TestTeardownAsks (issue 43): teardown's help promised a confirmation that only
// --force asked for: off a terminal, without --yes, it removed everything (exit 0), and
// on a terminal it never asked. Every teardown that removes asks now, as purge does:
// off a terminal it refuses without --yes (exit 2, nothing dialled); on a terminal it
// shows the dry run and asks: any answer but yes removes nothing (exit 1); yes removes
// what was shown.
func TestTeardownAsks(t *testing.T) {
	t.Parallel()
	// The help says what happens, and that --force does not skip the question.
	_, help, _ := runArgs("teardown", "--help")
	for _, want := range []string{"Every teardown that removes something asks, --force or not, as a purge does", "any other answer\nchanges nothing (exit status 1)",
		"refuses without --yes (exit status 2)", "--force only lifts that refusal:\nit asks like any other teardown"} {
		if !strings.Contains(help, want) {
			t.Errorf("teardown --help lacks %q:\n%s", want, help)
		}
	}
	ctl := ctlFlag(t)
	e := newEnv(t, "orders")
	e.apply()
	tier := e.prefix + ".delay.1s"
	teardown := append([]string{"teardown"}, ctl...)
	in := func(terminal bool, input string, args ...string) (int, string, string) {
		t.Helper()
		return runInput(terminal, input, append(args, e.flags()...)...)
	}
	code, out, errOut := in(false, "y\n", teardown...)
	if code != exitUsage || !strings.Contains(errOut, "teardown removes queues and exchanges for good: pass --yes to confirm (stdin is not a terminal to ask on)") {
		t.Errorf("teardown, stdin not a terminal, no --yes (%d):\n%s%s", code, out, errOut)
	}
	if !queueExists(t, tier) {
		t.Fatal("a teardown refused for want of --yes removed the tier queue")
	}
	for _, answer := range []string{"n\n", "\n", "nope\n", ""} {
		code, out, errOut := in(true, answer, teardown...)
		if code != exitFailed || out != "" || !strings.Contains(errOut, "dry run: would remove 2 queues, 2 exchanges, 3 bindings under prefix "+e.prefix) ||
			!strings.Contains(errOut, "remove these 2 queues and 2 exchanges for good? [y/N]") || !strings.Contains(errOut, "not confirmed: nothing changed") {
			t.Errorf("teardown declined with %q (%d):\nstdout %q\nstderr %s", answer, code, out, errOut)
		}
		if !queueExists(t, tier) || !exchangeExists(t, e.prefix+".deliver") {
			t.Fatalf("a teardown declined with %q removed the storage", answer)
		}
	}
	code, out, errOut = in(true, "y\n", teardown...)
	if code != exitOK || !strings.Contains(out, "removed 2 queues, 2 exchanges, 3 bindings under prefix "+e.prefix) || queueExists(t, tier) || exchangeExists(t, e.prefix+".deliver") {
		t.Errorf("teardown confirmed (%d):\n%s%s", code, out, errOut)
	}
	if !queueExists(t, e.queues[0]) || !queueExists(t, e.prefix+".poison") {
		t.Error("teardown removed the work queue or the poison queue")
	}
}

// TestTeardownAsksOnATerminal (issue 43): the command itself, on a pseudo-terminal,
// without --force: "n" leaves the storage (exit 1), "y" removes it.
func TestTeardownAsksOnATerminal(t *testing.T) {
	t.Parallel()
	ctl := ctlFlag(t)
	e := newEnv(t, "orders")
	e.apply()
	tier := e.prefix + ".delay.1s"
	args := append(append([]string{"teardown"}, ctl...), e.flags()...)
	code, out := onTerminal(t, "n", args...)
	if code != exitFailed || !strings.Contains(out, "dry run: would remove 2 queues, 2 exchanges") || !strings.Contains(out, "remove these 2 queues and 2 exchanges for good? [y/N]") ||
		!strings.Contains(out, "not confirmed: nothing changed") {
		t.Errorf("answer n: exit %d:\n%s", code, out)
	}
	if !queueExists(t, tier) {
		t.Fatal("answer n removed the tier queue")
	}
	code, out = onTerminal(t, "y", args...)
	if code != exitOK || !strings.Contains(out, "removed 2 queues, 2 exchanges") || queueExists(t, tier) {
		t.Errorf("answer y: exit %d:\n%s", code, out)
	}
}

// TestTeardownEveryBackend (issue 43): teardown --backend ttl-tiers removed the queues
// binary-levels had left under the prefix but not its exchanges, nor the
// delayed-exchange backend's exchange: it took one teardown per backend. One teardown
// removes what any backend declared under the prefix, names what it left and why (the
// parking exchange and queue and the poison queue, shared, stay without --shared), and
// a second one finds nothing left.
func TestTeardownEveryBackend(t *testing.T) {
	t.Parallel()
	ctl := ctlFlag(t)
	e := newEnv(t, "orders")
	e.apply() // ttl-tiers, tiers 1s and 2s
	levels := amqpretry.Config{Backend: delay.BinaryLevels(4), Prefix: e.prefix}
	p, err := levels.Plan(e.queues...)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p)
	if code, out, errOut := runArgs("topology", "apply", "--backend", "binary-levels", "--levels", "4", "--prefix", e.prefix, "--queue", e.queues[0]); code != exitOK {
		t.Fatalf("apply binary-levels: %d %s%s", code, out, errOut)
	}
	// The delayed-exchange backend's exchange: the plugin does not run on the test
	// broker, so a direct exchange of its name stands in for it (a passive declare does
	// not look at the kind), and its count is unknown.
	delayed := e.prefix + ".delayed"
	brokertest.Cleanup(t, nil, []string{delayed})
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.ExchangeDeclare(delayed, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	var gone []string // what one teardown must remove
	for i := range 4 {
		gone = append(gone, fmt.Sprintf("%s.level.%d", e.prefix, i))
	}
	gone = append(gone, e.prefix+".levels.deliver", e.prefix+".delay", e.prefix+".deliver", delayed)
	teardown := append([]string{"teardown", "--backend", "ttl-tiers", "--yes"}, ctl...)

	// What waits in the plugin is unknown: refused, nothing removed, naming the exchange.
	code, out, errOut := e.run(teardown...)
	if code != exitFailed || !strings.Contains(errOut, "teardown refused: what waits there is unknown") || !strings.Contains(errOut, `exchange "`+delayed+`"`) {
		t.Errorf("teardown with the plugin's count unknown (%d):\n%s%s", code, out, errOut)
	}
	if !queueExists(t, e.prefix+".level.0") || !exchangeExists(t, delayed) {
		t.Fatal("a refused teardown removed something")
	}
	code, out, errOut = e.run(append(teardown, "--force")...)
	if code != exitOK || !strings.Contains(out, "removed 6 queues, 8 exchanges") ||
		!strings.Contains(out, "  left 3, shared by every backend under the prefix (--shared removes them): "+e.prefix+".parking (queue), "+e.prefix+".poison (queue), "+e.prefix+".parking (exchange)") {
		t.Errorf("teardown --force (%d):\n%s%s", code, out, errOut)
	}
	for _, name := range gone {
		if queueExists(t, name) || exchangeExists(t, name) {
			t.Errorf("%s is still there after one teardown", name)
		}
	}
	for _, q := range []string{e.prefix + ".delay.1s", e.prefix + ".delay.2s"} {
		if queueExists(t, q) {
			t.Errorf("queue %s is still there after one teardown", q)
		}
	}
	if !queueExists(t, e.queues[0]) || !queueExists(t, e.prefix+".poison") || !queueExists(t, e.prefix+".parking") || !exchangeExists(t, e.prefix+".parking") {
		t.Error("teardown removed the work queue, or, without --shared, the poison or parking queue or exchange")
	}
	// Nothing of any backend is left; with --shared, the shared ones go too.
	if code, out, errOut := e.run(teardown...); code != exitFailed || !strings.Contains(errOut, "nothing to remove under prefix \""+e.prefix+"\": of what any backend declares there, only what stays was found (3") ||
		!strings.Contains(out, "  left 3, shared by every backend under the prefix (--shared removes them): ") {
		t.Errorf("a second teardown (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut = e.run(append(teardown, "--shared", "--json")...)
	var v struct {
		Queues    []string `json:"queues"`
		Exchanges []string `json:"exchanges"`
		Left      []any    `json:"left"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil || code != exitOK || len(v.Queues) != 2 || len(v.Exchanges) != 1 || len(v.Left) != 0 {
		t.Errorf("teardown --shared (%d): %v\n%s%s", code, err, out, errOut)
	}
	if queueExists(t, e.prefix+".poison") || queueExists(t, e.prefix+".parking") || !queueExists(t, e.queues[0]) {
		t.Error("teardown --shared left the poison or parking queue, or removed the work queue")
	}
}

// TestNameListsShortened (issue 43): dry runs and result lines named every queue on
// one line (62 of them). They give the count and the first few names; --verbose names
// them all.
func TestNameListsShortened(t *testing.T) {
	t.Parallel()
	ctl := ctlFlag(t)
	e := newEnv(t, "orders")
	flags := []string{"--prefix", e.prefix, "--tiers", "1s,2s,3s,4s,5s,6s"}
	var tiers []time.Duration
	for i := 1; i <= 6; i++ {
		tiers = append(tiers, time.Duration(i)*time.Second)
	}
	p, err := amqpretry.Config{Prefix: e.prefix, Backend: delay.TTLTiers(tiers...)}.Plan(e.queues...)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p)
	if code, out, errOut := runArgs(append([]string{"topology", "apply", "--queue", e.queues[0]}, flags...)...); code != exitOK {
		t.Fatalf("apply: %d %s%s", code, out, errOut)
	}
	run := func(args ...string) (int, string, string) {
		t.Helper()
		return runArgs(append(append(args, flags...), ctl...)...)
	}
	q := func(i int) string { return fmt.Sprintf("%s.delay.%ds", e.prefix, i) }
	short := fmt.Sprintf("%s, %s, %s, … and 3 more", q(1), q(2), q(3))
	all := fmt.Sprintf("%s, %s, %s, %s, %s, %s", q(1), q(2), q(3), q(4), q(5), q(6))

	// The queues' line is shortened (the bindings' line may name q(6) among its first
	// three: their order is the broker's).
	code, out, errOut := run("teardown", "--backend", "ttl-tiers", "--dry-run")
	if code != exitOK || !strings.Contains(out, "dry run: would remove 6 queues, 2 exchanges") || !strings.Contains(out, "  6 queues: "+short+"\n") {
		t.Errorf("teardown --dry-run (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut = run("teardown", "--backend", "ttl-tiers", "--dry-run", "--verbose")
	if code != exitOK || !strings.Contains(out, "  queue "+q(6)+"\n") || !strings.Contains(out, "  exchange "+e.prefix+".deliver\n") {
		t.Errorf("teardown --dry-run --verbose (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut = run("waiting", "retry-now", "--queue", e.queues[0], "--dry-run")
	if code != exitOK || !strings.Contains(out, "dry run: would retry now 0 of 0 retries waiting in "+short+", back to work queue "+e.queues[0]) {
		t.Errorf("retry-now --dry-run (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut = run("waiting", "retry-now", "--queue", e.queues[0], "--verbose")
	if code != exitOK || !strings.Contains(out, "retried now 0 of 0 retries waiting in "+all+", back to work queue "+e.queues[0]) {
		t.Errorf("retry-now --verbose (%d):\n%s%s", code, out, errOut)
	}
}

// TestRedriveDryRunToDeletedQueue (issue 43): poison redrive --dry-run towards a
// deleted queue said "would redrive 7 of 7" while the run leaves them (unroutable,
// exit 1). The dry run checks each queue as the run does, passively, says what would
// stay and why, and exits as the run does.
func TestRedriveDryRunToDeletedQueue(t *testing.T) {
	e := newEnv(t, "orders", "billing")
	e.apply()
	e.poison(4) // m0000, m0002 failed on orders; m0001, m0003 on billing
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDelete(e.queues[1], false, false, false); err != nil {
		t.Fatal(err)
	}
	poison := e.prefix + ".poison"
	var dry, real string
	for _, flag := range []string{"--dry-run", "--dry-run=false"} {
		code, out, errOut := e.run("poison", "redrive", flag)
		if code != exitFailed || !strings.Contains(out, " 2 of 4 messages in "+poison+" (4 scanned, 0 not matching, 2 unroutable)") ||
			!strings.Contains(out, `  left in place, queue "`+e.queues[1]+`" does not exist: m0001`) ||
			!strings.Contains(out, `  left in place, queue "`+e.queues[1]+`" does not exist: m0003`) {
			t.Errorf("poison redrive %s (%d):\n%s%s", flag, code, out, errOut)
		}
		if flag == "--dry-run" {
			dry = out
			if n := brokertest.QueueLength(t, poison); n != 4 {
				t.Fatalf("the dry run left %d of 4 in the poison queue", n)
			}
		} else {
			real = out
		}
	}
	if !strings.HasPrefix(dry, "dry run: would redrive 2 of 4") || strings.Contains(dry, "m0001 ->") || !strings.HasPrefix(real, "redriven 2 of 4") {
		t.Errorf("dry run:\n%s\nrun:\n%s", dry, real)
	}
	if n := brokertest.QueueLength(t, poison); n != 2 {
		t.Errorf("the run left %d in the poison queue, want the 2 unroutable", n)
	}
}

// TestTeardownWholePrefix (issue 51): teardown needed --backend though it removes every
// backend's storage under the prefix, and left the work queues and the application's
// topic exchanges without a word, nor counted the binding from the delivery exchange
// to the work queue, which went with it. Without --backend, a dry run lists every
// queue, exchange and binding it would remove, and names the work queue and the
// exchange the application bound to it as the application's, left; --shared then
// removes the whole prefix, and only those stay.
func TestTeardownWholePrefix(t *testing.T) {
	t.Parallel()
	ctl := ctlFlag(t)
	e := newEnv(t, "orders")
	e.apply()
	queue := e.queues[0]
	topic := e.prefix + ".topic.orders" // as watermill-amqp's pub/sub config declares one
	brokertest.Cleanup(t, nil, []string{topic})
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.ExchangeDeclare(topic, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(queue, "", topic, false, nil); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) (int, string, string) {
		t.Helper()
		return e.run(append(append([]string{"teardown"}, args...), ctl...)...)
	}
	application := "  left 2, the application's (work queues, and the exchanges bound to them): never removed: " + queue + " (queue), " + topic + " (exchange)\n"
	code, out, errOut := run("--dry-run")
	if code != exitOK || !strings.HasPrefix(out, "dry run: would remove 2 queues, 2 exchanges, 3 bindings under prefix "+e.prefix+"\n") ||
		!strings.Contains(out, "  3 bindings: ") || !strings.Contains(out, e.prefix+".deliver -> "+queue) || !strings.Contains(out, application) {
		t.Errorf("teardown --dry-run without --backend (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut = run("--dry-run", "--verbose")
	if code != exitOK || !strings.Contains(out, "  binding "+e.prefix+".deliver -> queue "+queue+` key "`+queue+`"`+"\n") ||
		!strings.Contains(out, "  binding "+e.prefix+`.delay -> queue `+e.prefix+`.delay.2s key ""`+"\n") || !strings.Contains(out, "  queue "+e.prefix+".delay.1s\n") {
		t.Errorf("teardown --dry-run --verbose (%d):\n%s%s", code, out, errOut)
	}
	// Without rabbitmqctl, no binding is listed: it says what it could not name.
	code, out, errOut = e.run("teardown", "--dry-run", "--force", "--rabbitmqctl", "off")
	if code != exitOK || !strings.Contains(out, "  not listed: the bindings to the work queues") || strings.Contains(out, "left 2, the application's") {
		t.Errorf("teardown --dry-run --rabbitmqctl off (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut = run("--shared", "--yes")
	if code != exitOK || !strings.HasPrefix(out, "removed 4 queues, 3 exchanges, 4 bindings under prefix "+e.prefix+"\n") || !strings.Contains(out, application) {
		t.Errorf("teardown --shared --yes (%d):\n%s%s", code, out, errOut)
	}
	for _, q := range []string{".delay.1s", ".delay.2s", ".parking", ".poison"} {
		if queueExists(t, e.prefix+q) {
			t.Errorf("queue %s%s is still there", e.prefix, q)
		}
	}
	for _, x := range []string{".deliver", ".delay", ".parking"} {
		if exchangeExists(t, e.prefix+x) {
			t.Errorf("exchange %s%s is still there", e.prefix, x)
		}
	}
	if !queueExists(t, queue) || !exchangeExists(t, topic) {
		t.Error("teardown removed the work queue or the application's exchange")
	}
	if code, out, errOut := run("--shared", "--yes"); code != exitFailed || !strings.Contains(errOut, "nothing to remove") {
		t.Errorf("a second teardown (%d):\n%s%s", code, out, errOut)
	}
}

// TestTeardownRefusalNamesTheFix (issue 51): teardown --shared, refused because
// messages sat in the poison queue, advised waiting until they come due and retry-now:
// the fixes of a delay queue. Each kind of queue gets its own fix: the poison queue's
// are poison redrive and purge, the parking queue's parking redrive and purge; without
// --shared those queues stay and do not stop the teardown.
func TestTeardownRefusalNamesTheFix(t *testing.T) {
	t.Parallel()
	ctl := ctlFlag(t)
	e := newEnv(t, "orders")
	e.apply()
	e.poison(3)
	poison, parking := e.prefix+".poison", e.prefix+".parking"
	teardown := append([]string{"teardown", "--shared", "--yes"}, ctl...)
	code, out, errOut := e.run(teardown...)
	if code != exitFailed || !strings.Contains(errOut, "teardown refused: messages wait in "+poison+": 3; for the messages in the poison queue "+poison+": redrive them to their work queues (amqpretry poison redrive), or drop them (amqpretry poison purge); or force it") ||
		strings.Contains(errOut, "retry-now") || strings.Contains(errOut, "come due") {
		t.Errorf("teardown --shared with 3 in the poison queue (%d):\n%s%s", code, out, errOut)
	}
	msg := message.NewMessage("parked-1", []byte("parked"))
	if err := e.h.ToQueue(t.Context(), parking, msg); err != nil {
		t.Fatal(err)
	}
	code, out, errOut = e.run(teardown...)
	if code != exitFailed || !strings.Contains(errOut, "(amqpretry poison purge); for the retries in the parking queue "+parking+": ") ||
		!strings.Contains(errOut, "(amqpretry parking redrive), or drop them (amqpretry parking purge)") || strings.Contains(errOut, "retry-now") {
		t.Errorf("teardown --shared with messages in the poison and parking queues (%d):\n%s%s", code, out, errOut)
	}
	if !queueExists(t, e.prefix+".delay.1s") || brokertest.QueueLength(t, poison) != 3 {
		t.Fatal("a refused teardown removed something")
	}
	code, out, errOut = e.run(append([]string{"teardown", "--yes"}, ctl...)...)
	if code != exitOK || !strings.HasPrefix(out, "removed 2 queues, 2 exchanges") || !queueExists(t, poison) || !queueExists(t, parking) {
		t.Errorf("teardown without --shared (%d):\n%s%s", code, out, errOut)
	}
}
