package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	amqp3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// blockedRig is an application with Config.OrderKey and Config.BlockOnPoison, its
// Retry (wamqp3) running on the real broker, in the state a poisoned head leaves:
//
//   - acc0 and acc1: their first event fails for good (poisoned, max-attempts), and
//     their 3 later events wait behind them;
//   - acc2: its first event waits 10 minutes for its retry, its second behind it;
//   - acc3: never fails, never blocked.
type blockedRig struct {
	prefix, queue, poison string
	flags                 []string // the common flags, and --rabbitmqctl

	mu      sync.Mutex
	applied map[string][]int // by account, the events handled, in order
	healed  map[string]bool  // accounts whose first event now succeeds
	changed chan struct{}
}

// account is the order key's header; seq numbers each account's events from 1.
const account, seq = "account", "seq"

func newBlockedRig(t *testing.T) *blockedRig {
	t.Helper()
	ctl := ctlFlag(t) // skips without rabbitmqctl: the blocked keys are listed with it
	uri := brokertest.URI()
	t.Setenv(uriEnv, uri)
	prefix := brokertest.Prefix(t)
	r := &blockedRig{prefix: prefix, queue: prefix + ".accounts", poison: prefix + ".poison",
		applied: map[string][]int{}, healed: map[string]bool{}, changed: make(chan struct{}, 100)}
	r.flags = append([]string{"--prefix", prefix, "--tiers", "1s,10m"}, ctl...)
	cfg := amqpretry.Config{
		Prefix:        prefix,
		Backend:       delay.TTLTiers(time.Second, 10*time.Minute),
		Policy:        amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{time.Second}, Jitter: -1},
		OrderKey:      func(msg *message.Message) string { return msg.Metadata.Get(account) },
		BlockOnPoison: true,
		Logger:        watermill.NopLogger{},
	}
	plan, err := cfg.Plan(r.queue)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, plan)
	queues := []string{r.queue, r.poison}
	for a := range 4 {
		queues = append(queues, r.behind("acc"+strconv.Itoa(a)))
	}
	brokertest.Cleanup(t, queues, nil)

	retry, err := wamqp3.New(amqp3.NewDurableQueueConfig(uri), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = retry.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := retry.AddHandler(router, "accounts", r.queue, r.handle); err != nil {
		t.Fatal(err)
	}
	go func() { _ = router.Run(t.Context()) }()
	<-router.Running()
	t.Cleanup(func() { _ = router.Close() })

	pub, err := amqp3.NewPublisher(amqp3.NewDurableQueueConfig(uri), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	events := map[string]int{"acc0": 4, "acc1": 4, "acc2": 2, "acc3": 2}
	for s := 1; s <= 4; s++ {
		for a := range 4 {
			acc := "acc" + strconv.Itoa(a)
			if s > events[acc] {
				continue
			}
			msg := message.NewMessage(fmt.Sprintf("%s-%d", acc, s), []byte("event"))
			msg.Metadata.Set(account, acc)
			msg.Metadata.Set(seq, strconv.Itoa(s))
			if err := pub.Publish(r.queue, msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	r.waitQueue(t, r.poison, 2)
	for acc, n := range map[string]int{"acc0": 3, "acc1": 3, "acc2": 1} {
		r.waitQueue(t, r.behind(acc), n)
	}
	r.waitApplied(t, "acc3", 1, 2)
	return r
}

// handle is the application's handler: acc0's and acc1's first events fail until
// healed, acc2's first waits 10 minutes for its retry.
func (r *blockedRig) handle(msg *message.Message) error {
	acc := msg.Metadata.Get(account)
	n, _ := strconv.Atoi(msg.Metadata.Get(seq))
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case n == 1 && (acc == "acc0" || acc == "acc1") && !r.healed[acc]:
		return errors.New("account locked")
	case n == 1 && acc == "acc2" && amqpretry.Attempt(msg) == 1:
		return amqpretry.RetryAfter(errors.New("rate limited"), 10*time.Minute)
	}
	r.applied[acc] = append(r.applied[acc], n)
	select {
	case r.changed <- struct{}{}:
	default:
	}
	return nil
}

func (r *blockedRig) heal(acc string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.healed[acc] = true
}

// behind is the behind queue of acc.
func (r *blockedRig) behind(acc string) string {
	return names.Names{Prefix: r.prefix}.Behind(r.queue, acc)
}

// waitApplied waits until acc's events handled are want, in that order.
func (r *blockedRig) waitApplied(t *testing.T, acc string, want ...int) {
	t.Helper()
	deadline := time.After(60 * time.Second)
	for {
		r.mu.Lock()
		got := slices.Clone(r.applied[acc])
		r.mu.Unlock()
		if slices.Equal(got, want) {
			return
		}
		if len(got) >= len(want) {
			t.Fatalf("%s's events handled: %v, want %v", acc, got, want)
		}
		select {
		case <-r.changed:
		case <-deadline:
			t.Fatalf("%s's events handled within 60 s: %v, want %v", acc, got, want)
		}
	}
}

// ready is queue's ready messages, -1 when it does not exist.
func ready(t *testing.T, queue string) int {
	t.Helper()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close() //nolint:errcheck // closed by the broker on 404
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return -1
	}
	return q.Messages
}

// waitQueue waits until queue has n ready messages (-1: until it is gone).
func (r *blockedRig) waitQueue(t *testing.T, queue string, n int) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for ready(t, queue) != n {
		if time.Now().After(deadline) {
			t.Fatalf("queue %s has %d ready within 60 s, want %d", queue, ready(t, queue), n)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// run runs the command with the rig's flags, stdin not a terminal.
func (r *blockedRig) run(args ...string) (int, string, string) {
	return runArgs(append(slices.Clone(args), r.flags...)...)
}

// TestBlockedListAndRelease (issue 48): an application with Config.OrderKey and
// Config.BlockOnPoison, running; two keys blocked behind their poisoned heads, one
// behind a head that waits for its retry. blocked list shows each key, what waits
// behind it and its poisoned head (--json too); blocked release asks first (refused
// off a terminal without --yes, declined at the prompt), refuses a key not blocked and
// one whose head waits (naming --force and its risk), and releases: without the head
// (the key's later events run, in order, the head stays poisoned), with its head
// redriven first (all four, in order), forced. A teardown of the whole prefix refuses
// while messages wait behind the keys, naming blocked release.
func TestBlockedListAndRelease(t *testing.T) {
	r := newBlockedRig(t)
	code, out, errOut := r.run("blocked", "list")
	t.Logf("amqpretry blocked list:\n%s", out)
	if code != exitOK {
		t.Fatalf("blocked list (%d):\n%s%s", code, out, errOut)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	wantRows := []string{
		r.queue + "  acc0  3       acc0-1                 ",
		r.queue + "  acc1  3       acc1-1                 ",
		r.queue + "  acc2  1       (waits for its retry)  -",
	}
	if len(lines) != 6 || !strings.HasPrefix(lines[0], "QUEUE") ||
		lines[4] != "3 blocked keys, 7 messages behind them, 2 poisoned heads" || !strings.HasPrefix(lines[5], "release one: amqpretry blocked release --queue QUEUE --key KEY") {
		t.Fatalf("blocked list:\n%s", out)
	}
	for i, want := range wantRows {
		if !strings.HasPrefix(lines[i+1], want) {
			t.Errorf("blocked list row %d: %q, want it to start %q", i+1, lines[i+1], want)
		}
		if i < 2 && (!strings.Contains(lines[i+1], " ago ") || !strings.HasSuffix(lines[i+1], "max-attempts  account locked")) {
			t.Errorf("blocked list row %d: %q, want the head's age, reason and error", i+1, lines[i+1])
		}
	}

	code, out, errOut = r.run("blocked", "list", "--json")
	var listed blockedJSON
	if code != exitOK || json.Unmarshal([]byte(out), &listed) != nil {
		t.Fatalf("blocked list --json (%d):\n%s%s", code, out, errOut)
	}
	if len(listed.Keys) != 3 || listed.Behind != 7 || listed.PoisonedHeads != 2 || listed.Keys[0].Head == nil || listed.Keys[0].Head.UUID != "acc0-1" ||
		listed.Keys[0].BehindQueue != r.behind("acc0") || listed.Keys[2].Head != nil || listed.Keys[2].Behind != 1 {
		t.Errorf("blocked list --json:\n%s", out)
	}
	if code, out, errOut := r.run("blocked", "list", "--queue", r.prefix+".other"); code != exitOK || out != "no blocked key\n" {
		t.Errorf("blocked list --queue of another work queue (%d):\n%s%s", code, out, errOut)
	}

	// Refusals: off a terminal without --yes (before anything is dialled), a key not
	// blocked, a key whose head waits for its retry.
	for _, c := range []struct {
		args []string
		exit int
		says string
	}{
		{[]string{"--key", "acc0"}, exitUsage, "blocked release lets a key's messages run, which cannot be undone: pass --yes to confirm (stdin is not a terminal to ask on)"},
		{[]string{"--key", "acc3", "--yes"}, exitFailed, `release key "acc3" of queue "` + r.queue + `": not blocked (no queue "` + r.behind("acc3") + `"); amqpretry blocked list shows the blocked keys`},
		{[]string{"--key", "acc2", "--yes"}, exitFailed, "behind it would overtake it; pass --force to release it anyway (they then run before their head, out of the key's order)"},
		{[]string{"--key", "acc2", "--redrive-head", "--yes"}, exitFailed, "nothing to redrive; release without --redrive-head, with --force, to run the messages behind the key now"},
	} {
		code, out, errOut := r.run(append([]string{"blocked", "release", "--queue", r.queue}, c.args...)...)
		if code != c.exit || !strings.Contains(errOut, c.says) {
			t.Errorf("blocked release %v (%d), want %d saying %q:\n%s%s", c.args, code, c.exit, c.says, out, errOut)
		}
	}

	// A teardown of the whole prefix refuses while messages wait behind the keys.
	code, out, errOut = r.run("teardown", "--shared", "--dry-run")
	if code != exitFailed || !strings.Contains(errOut, r.behind("acc0")+": 3") ||
		!strings.Contains(errOut, "for the messages behind blocked order keys ("+r.prefix+".behind.*): release the keys first (`amqpretry blocked list` shows them, `amqpretry blocked release` releases one)") {
		t.Errorf("teardown --shared --dry-run with keys blocked (%d):\n%s%s", code, out, errOut)
	}

	// Release acc0 without its head: a dry run, declined, then confirmed.
	release := []string{"blocked", "release", "--queue", r.queue, "--key", "acc0"}
	code, out, errOut = r.run(append(release, "--dry-run")...)
	t.Logf("amqpretry blocked release --dry-run:\n%s", out)
	if code != exitOK || out != "dry run: key acc0 of queue "+r.queue+" would be released: the 3 messages behind it run, in order; its poisoned head acc0-1 stays in "+r.poison+" (redriven later, it runs after them); nothing changed\n" {
		t.Errorf("blocked release --dry-run (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut = runInput(true, "n\n", append(release, r.flags...)...)
	if code != exitFailed || out != "" || !strings.Contains(errOut, "dry run: key acc0") || !strings.Contains(errOut, "run the 3 messages behind key acc0, without its head? [y/N]") ||
		!strings.Contains(errOut, "not confirmed: nothing changed") {
		t.Errorf("blocked release declined (%d):\nstdout %q\nstderr %s", code, out, errOut)
	}
	if n := ready(t, r.behind("acc0")); n != 3 {
		t.Fatalf("after a dry run and a declined release, %d wait behind acc0, want 3", n)
	}
	code, out, errOut = runInput(true, "y\n", append(release, r.flags...)...)
	t.Logf("amqpretry blocked release (answered y):\n%s%s", errOut, out)
	if code != exitOK || !strings.HasPrefix(out, "key acc0 of queue "+r.queue+" released: the 3 messages behind it run, in order; its poisoned head acc0-1 stays in "+r.poison) ||
		!strings.Contains(out, "a release went to "+r.queue+": the application consuming it runs what waits behind the key, then unblocks it") {
		t.Errorf("blocked release confirmed (%d):\n%s%s", code, out, errOut)
	}
	r.waitApplied(t, "acc0", 2, 3, 4)
	r.waitQueue(t, r.behind("acc0"), -1)

	// Redrive acc1's head, then release: all four events, in order.
	r.heal("acc1")
	code, out, errOut = r.run("blocked", "release", "--queue", r.queue, "--key", "acc1", "--redrive-head", "--yes")
	t.Logf("amqpretry blocked release --redrive-head --yes:\n%s", out)
	if code != exitOK || !strings.HasPrefix(out, "the poisoned head acc1-1 of key acc1 redriven to queue "+r.queue+", its attempts reset: once it succeeds, the 3 messages behind it run, in order\n") {
		t.Errorf("blocked release --redrive-head (%d):\n%s%s", code, out, errOut)
	}
	r.waitApplied(t, "acc1", 1, 2, 3, 4)
	r.waitQueue(t, r.behind("acc1"), -1)
	if n := ready(t, r.poison); n != 1 {
		t.Errorf("the poison queue has %d after acc1's head was redriven, want acc0's alone", n)
	}

	// Forced: acc2's second event runs before its head, which still waits.
	code, out, errOut = r.run("blocked", "release", "--queue", r.queue, "--key", "acc2", "--force", "--yes", "--json")
	var res struct {
		Key      struct{ Key string }
		Released bool
	}
	if code != exitOK || json.Unmarshal([]byte(out), &res) != nil || !res.Released || res.Key.Key != "acc2" {
		t.Errorf("blocked release --force --json (%d):\n%s%s", code, out, errOut)
	}
	r.waitApplied(t, "acc2", 2)
	r.waitQueue(t, r.behind("acc2"), -1)

	if code, out, errOut := r.run("blocked", "list"); code != exitOK || out != "no blocked key\n" {
		t.Errorf("blocked list once every key is released (%d):\n%s%s", code, out, errOut)
	}
	r.waitApplied(t, "acc3", 1, 2)
}
