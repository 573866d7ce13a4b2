package noloss_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
	"github.com/amqpretry/amqpretry/internal/noloss"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

const (
	// EnableEnv turns the test on: "1".
	EnableEnv = "AMQPRETRY_NOLOSS"
	// NEnv is the number of messages per backend (default 5000).
	NEnv = "AMQPRETRY_NOLOSS_N"
	// SabotageEnv, for proving the test itself, makes the consumer drop this many
	// messages (see the consumer's -sabotage): the test must then fail with lost >= 1.
	SabotageEnv = "AMQPRETRY_NOLOSS_SABOTAGE"

	defaultN = 5000
	batches  = 6 // messages are published in batches, with a fault after each but the last
)

// The faults, one after each batch but the last, in this order.
const (
	faultClose   = "close_all_connections"
	faultKill    = "consumer_sigkill_restart"
	faultStopApp = "stop_app_start_app"
)

var faultPlan = []string{faultClose, faultKill, faultClose, faultStopApp, faultClose}

// TestNoLoss sends N messages per durable backend through a consumer process (20% fail
// twice then succeed, 1% fail permanently) while the broker's connections are closed
// three times, the consumer is killed with SIGKILL and restarted once, and the broker's
// application is stopped and started once, each fault while retries wait in the delay
// queues. It then accounts for every message: handled (recorded by the consumer) or
// poisoned with reason permanent, delay and parking queues empty. It prints one line
// per backend, starting with "NOLOSS ", that the README's Reliability table is filled
// from.
func TestNoLoss(t *testing.T) {
	if os.Getenv(EnableEnv) != "1" {
		t.Skipf("takes minutes and disturbs the broker under test: set %s=1 and %s=1", EnableEnv, brokertest.RestartEnv)
	}
	if os.Getenv("CI") == "true" {
		// brokertest.RequireRestart skips in these cases; asked for explicitly, a
		// skip would be silent, so fail instead.
		if os.Getenv(brokertest.RestartEnv) != "1" {
			t.Fatalf("%s=1 needs %s=1 (the test closes connections and stops the broker's application)", EnableEnv, brokertest.RestartEnv)
		}
		if _, err := exec.LookPath(brokertest.CtlCommand()[0]); err != nil {
			t.Fatalf("%s=1 needs rabbitmqctl for the broker under test (%s): %v", EnableEnv, brokertest.CtlEnv, err)
		}
	}
	brokertest.RequireRestart(t)
	n := defaultN
	if s := os.Getenv(NEnv); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1 {
			t.Fatalf("%s=%q: want a positive number of messages", NEnv, s)
		}
		n = v
	}
	sabotage := 0
	if s := os.Getenv(SabotageEnv); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 0 {
			t.Fatalf("%s=%q: want a number of messages to drop", SabotageEnv, s)
		}
		sabotage = v
	}
	brokertest.Dial(t) // fails under CI=true when no broker answers
	bin := buildConsumer(t)

	for _, backend := range delay.Backends() {
		t.Run(backend, func(t *testing.T) {
			if backend == delay.BackendMemory {
				t.Skip("memory backend: not durable (retries waiting in it die with the process, as the README says); nothing to prove here")
			}
			r := newRun(t, bin, backend, n, sabotage)
			r.run()
		})
	}
}

func buildConsumer(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "noloss-consumer")
	goCmd := filepath.Join(runtime.GOROOT(), "bin", "go") // the toolchain that built this test
	if _, err := os.Stat(goCmd); err != nil {
		goCmd = "go"
	}
	out, err := exec.Command(goCmd, "build", "-o", bin, "./consumer").CombinedOutput()
	if err != nil {
		t.Fatalf("go build ./consumer: %v\n%s", err, out)
	}
	return bin
}

// run is one backend's run.
type run struct {
	t        *testing.T
	ctx      context.Context
	bin      string
	backend  string
	prefix   string
	n        int
	sabotage int
	version  string
	logPath  string

	work, results, poison string
	parking               string   // "" for delayed-exchange, which has none
	delayQueues           []string // empty for delayed-exchange: its retries wait inside the plugin

	uuids    []string
	fates    map[string]noloss.Fate
	consumer *consumerProc
	faults   []string // "what@seconds(waiting=k)"
	// resultsAtFault is how many records the results queue held after the last fault.
	resultsAtFault int
	start          time.Time
}

func newRun(t *testing.T, bin, backend string, n, sabotage int) *run {
	t.Helper()
	// 6 min: after a restart, at-least-once dead lettering may hold expired retries
	// until it retries them, minutes later (seen: 3 min on RabbitMQ 3.10.8).
	budget := 6*time.Minute + time.Duration(n)*15*time.Millisecond
	deadline := time.Now().Add(budget)
	if d, ok := t.Deadline(); ok && d.Add(-30*time.Second).Before(deadline) {
		deadline = d.Add(-30 * time.Second)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	t.Cleanup(cancel)

	r := &run{t: t, ctx: ctx, bin: bin, backend: backend, n: n, sabotage: sabotage, prefix: brokertest.Prefix(t)}
	r.work, r.results = noloss.WorkQueue(r.prefix), noloss.ResultsQueue(r.prefix)
	r.logPath = filepath.Join(t.TempDir(), "consumer.log")

	// Build the configuration once here, as the consumer will: it declares the
	// topology, tells whether this broker can run the backend, and names the queues.
	cfg := noloss.Config(brokertest.URI(), backend, r.prefix)
	r.poison = r.prefix + ".poison" // the default, which New declares even when it then fails
	brokertest.Cleanup(t, []string{r.work, r.results, r.poison}, nil)
	retry, err := amqpretry.New(cfg)
	if errors.Is(err, delay.ErrPluginMissing) {
		t.Skipf("%s needs the rabbitmq_delayed_message_exchange plugin, which this broker does not have: %v", backend, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	topo := retry.Backend().Topology()
	if retry.PoisonQueue() != r.poison {
		t.Fatalf("poison queue %s, want %s", retry.PoisonQueue(), r.poison)
	}
	if err := retry.Close(); err != nil {
		t.Fatal(err)
	}
	for _, q := range topo.Queues {
		if q.Name == r.prefix+".parking" {
			r.parking = q.Name
		} else {
			r.delayQueues = append(r.delayQueues, q.Name)
		}
	}
	brokertest.CleanupTopology(t, topo)

	conn := brokertest.Dial(t)
	r.version, _ = conn.Properties["version"].(string)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(r.results, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close()
	// The faults go through rabbitmqctl: make sure it drives this broker, not another
	// one on the machine, before disturbing anything.
	out, err := brokertest.Ctl(ctx, "-q", "list_queues", "--no-table-headers", "name")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(strings.Fields(string(out)), r.results) {
		t.Fatalf("%s (%s) does not see queue %s, just declared on the broker at AMQP_URI (%s): it drives another broker",
			strings.Join(brokertest.CtlCommand(), " "), brokertest.CtlEnv, r.results, brokertest.Redact(brokertest.URI()))
	}

	r.fates = make(map[string]noloss.Fate, n)
	for i := range n {
		id := watermill.NewUUID()
		r.uuids = append(r.uuids, id)
		r.fates[id] = noloss.FateFor(i)
	}
	return r
}

// queues are the queues that must be empty at the end: the work queue, the parking
// queue (delayed-exchange has none) and the delay queues.
func (r *run) queues() []string {
	qs := []string{r.work}
	if r.parking != "" {
		qs = append(qs, r.parking)
	}
	return append(qs, r.delayQueues...)
}

func (r *run) elapsed() float64 { return time.Since(r.start).Seconds() }

func (r *run) run() {
	t := r.t
	r.start = time.Now()
	r.consumer = r.startConsumer()
	t.Cleanup(func() { r.consumer.kill() })

	for b := range batches {
		lo, hi := b*r.n/batches, (b+1)*r.n/batches
		if err := r.publish(lo, hi); err != nil {
			r.fatal("publish batch %d: %v", b+1, err)
		}
		if b == len(faultPlan) {
			break
		}
		waiting := r.awaitWaitingRetries(lo, hi)
		r.inject(faultPlan[b], waiting)
	}
	t.Logf("%s: all %d messages published, faults: %s; accounting", r.backend, r.n, strings.Join(r.faults, ", "))

	acc := newAccount()
	missing := r.collectUntilAccounted(acc)
	if len(missing) == 0 {
		// Everything is accounted for; let duplicates in flight finish before the
		// final count, then stop the consumer cleanly.
		r.awaitQuiet()
	}
	r.consumer.stop()
	r.drain(acc) // what the consumer recorded before it stopped
	seconds := r.elapsed()
	missing = r.missing(acc)

	lost := len(missing)
	dupUUIDs, extra := acc.duplicates()
	fmt.Printf("NOLOSS backend=%s rabbitmq=%s n=%d faults=%d lost=%d duplicates=%d seconds=%.1f\n",
		r.backend, r.version, r.n, len(r.faults), lost, dupUUIDs, seconds)
	fmt.Printf("NOLOSS-DETAIL backend=%s handled=%d poisoned=%d extra_runs=%d sabotage=%d faults=%q\n",
		r.backend, len(acc.handled), len(acc.poisoned), extra, r.sabotage, strings.Join(r.faults, " "))

	if lost > 0 {
		shown := missing[:min(20, len(missing))]
		var lines []string
		for _, id := range shown {
			lines = append(lines, fmt.Sprintf("  %s (fate %s)", id, r.fates[id]))
		}
		report := fmt.Sprintf("%s: %d of %d messages lost (neither handled nor poisoned as permanent); first %d:\n%s",
			r.backend, lost, r.n, len(shown), strings.Join(lines, "\n"))
		if r.backend == delay.BackendDelayedExchange && lost*100 < r.n {
			// The plugin may drop retries that come due while the broker stops (README,
			// Reliability): such a loss cannot be told apart from another one, so the
			// test bounds it below 1% and prints it.
			t.Log(report)
		} else {
			t.Error(report)
		}
	}
	for _, p := range acc.problems(r.fates) {
		t.Errorf("%s", p)
	}
	for _, q := range r.queues() {
		if c := r.count(q); c != 0 {
			t.Errorf("queue %s holds %d messages at the end, want 0", q, c)
		}
	}
	if t.Failed() {
		t.Logf("consumer log: %s", consumerLog(r.logPath))
	}
}

func (r *run) fatal(format string, args ...any) {
	r.t.Helper()
	r.t.Logf("consumer log: %s", consumerLog(r.logPath))
	r.t.Fatalf(format, args...)
}

// publish sends messages lo..hi-1 to the work queue, persistent, mandatory, each
// confirmed, trying again on a fresh connection for the ones not confirmed. No fault is
// injected while it runs, so it publishes each message once.
func (r *run) publish(lo, hi int) error {
	pending := make([]int, 0, hi-lo)
	for i := lo; i < hi; i++ {
		pending = append(pending, i)
	}
	var err error
	for try := 0; len(pending) > 0; try++ {
		if try > 0 {
			if r.ctx.Err() != nil || try > 20 {
				return fmt.Errorf("%d messages not confirmed: %w", len(pending), err)
			}
			time.Sleep(500 * time.Millisecond)
		}
		pending, err = r.publishOnce(pending)
	}
	return nil
}

func (r *run) publishOnce(idx []int) (notConfirmed []int, err error) {
	conn, err := amqp.Dial(brokertest.URI())
	if err != nil {
		return idx, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return idx, err
	}
	if err := ch.Confirm(false); err != nil {
		return idx, err
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, len(idx)))
	confirms := make([]*amqp.DeferredConfirmation, len(idx))
	for k, i := range idx {
		msg := message.NewMessage(r.uuids[i], noloss.Payload(i))
		p, err := wamqp.DefaultMarshaler{}.Marshal(msg)
		if err != nil {
			return idx, err
		}
		p.MessageId = r.uuids[i]
		if confirms[k], err = ch.PublishWithDeferredConfirmWithContext(r.ctx, "", r.work, true, false, p); err != nil {
			return idx[k:], err
		}
	}
	for k, dc := range confirms {
		ok, err := dc.WaitContext(r.ctx)
		if err != nil || !ok {
			notConfirmed = append(notConfirmed, idx[k])
		}
	}
	for {
		select {
		case ret := <-returns:
			return notConfirmed, fmt.Errorf("message %s returned (%s): the work queue is missing", ret.MessageId, ret.ReplyText)
		default:
			if len(notConfirmed) > 0 {
				return notConfirmed, errors.New("not confirmed")
			}
			return nil, nil
		}
	}
}

// awaitWaitingRetries waits until the consumer has recorded messages since the last
// fault (it recovered and works) and retries of this batch wait in the delay queues (at
// least 20, or every transient message of the batch if fewer), and returns how many
// wait. For delayed-exchange, whose retries wait inside the plugin where they cannot be
// counted, it waits for the recorded messages only and returns -1.
func (r *run) awaitWaitingRetries(lo, hi int) int {
	want := 0
	for i := lo; i < hi; i++ {
		if r.fates[r.uuids[i]] == noloss.FateTransient {
			want++
		}
	}
	want = max(min(want, 20), 1)
	deadline := time.Now().Add(time.Minute)
	for {
		waiting := -1
		if r.count(r.results) > r.resultsAtFault {
			if len(r.delayQueues) == 0 {
				return waiting
			}
			waiting = 0
			for _, q := range r.delayQueues {
				waiting += r.count(q)
			}
			if waiting >= want {
				return waiting
			}
		}
		if time.Now().After(deadline) || r.ctx.Err() != nil {
			r.fatal("a minute after publishing messages %d..%d: %d records (%d at the last fault), %d retries waiting in %v (want %d)",
				lo, hi-1, r.count(r.results), r.resultsAtFault, waiting, r.delayQueues, want)
		}
		r.consumer.checkAlive(r)
		time.Sleep(20 * time.Millisecond)
	}
}

func (r *run) inject(fault string, waiting int) {
	r.t.Helper()
	at := r.elapsed()
	switch fault {
	case faultClose:
		k := len(r.faults) + 1
		if out, err := brokertest.Ctl(r.ctx, "close_all_connections", fmt.Sprintf("amqpretry no-loss test, fault %d", k)); err != nil {
			r.fatal("%v\n%s", err, out)
		}
	case faultKill:
		r.consumer.kill()
		r.consumer = r.startConsumer()
	case faultStopApp:
		for _, step := range []string{"stop_app", "start_app", "await_startup"} {
			if out, err := brokertest.Ctl(r.ctx, step); err != nil {
				r.fatal("%v\n%s", err, out)
			}
		}
		if err := brokertest.Wait(time.Minute); err != nil {
			r.fatal("broker did not come back within a minute after start_app: %v", err)
		}
	}
	r.resultsAtFault = r.count(r.results)
	r.faults = append(r.faults, fmt.Sprintf("%s@%.1fs(waiting=%d)", fault, at, waiting))
	r.t.Logf("%s: fault %d %s at %.1f s with %d retries waiting", r.backend, len(r.faults), fault, at, waiting)
}

// account is what the results and poison queues said.
type account struct {
	handled  map[string][]int // UUID -> attempt of each record
	poisoned map[string][]string
	unknown  []string
}

func newAccount() *account {
	return &account{handled: map[string][]int{}, poisoned: map[string][]string{}}
}

// duplicates returns how many messages were handled (or poisoned) more than once, and
// how many runs beyond the first there were in all.
func (a *account) duplicates() (uuids, extra int) {
	for _, m := range []map[string]int{lens(a.handled), lens(a.poisoned)} {
		for _, c := range m {
			if c > 1 {
				uuids++
				extra += c - 1
			}
		}
	}
	return uuids, extra
}

func lens[V any](m map[string][]V) map[string]int {
	out := make(map[string]int, len(m))
	for k, v := range m {
		out[k] = len(v)
	}
	return out
}

// problems lists outcomes that are not losses but are wrong: a message handled against
// its fate, poisoned for another reason, or unknown to the run.
func (a *account) problems(fates map[string]noloss.Fate) []string {
	var out []string
	for id, attempts := range a.handled {
		switch fate, ok := fates[id]; {
		case !ok:
			out = append(out, fmt.Sprintf("results hold an unknown message %s", id))
		case fate == noloss.FatePermanent:
			out = append(out, fmt.Sprintf("message %s (fate permanent) was handled", id))
		case fate == noloss.FateTransient && slices.Min(attempts) <= noloss.TransientFailures:
			out = append(out, fmt.Sprintf("message %s (fate transient) succeeded on attempt %d", id, slices.Min(attempts)))
		}
	}
	for id, reasons := range a.poisoned {
		fate, ok := fates[id]
		switch {
		case !ok:
			out = append(out, fmt.Sprintf("poison queue holds an unknown message %s", id))
		case fate != noloss.FatePermanent:
			out = append(out, fmt.Sprintf("message %s (fate %s) was poisoned: %v", id, fate, reasons))
		}
		for _, reason := range reasons {
			if reason != middleware.PoisonPermanent {
				out = append(out, fmt.Sprintf("message %s poisoned with reason %q, want %q", id, reason, middleware.PoisonPermanent))
			}
		}
	}
	for _, u := range a.unknown {
		out = append(out, "unreadable record: "+u)
	}
	slices.Sort(out)
	return out
}

// missing returns the UUIDs neither handled nor poisoned as permanent, in publish order.
func (r *run) missing(a *account) []string {
	var out []string
	for _, id := range r.uuids {
		if r.fates[id] == noloss.FatePermanent {
			if !slices.Contains(a.poisoned[id], middleware.PoisonPermanent) {
				out = append(out, id)
			}
		} else if len(a.handled[id]) == 0 {
			out = append(out, id)
		}
	}
	return out
}

// quietBeforeGivingUp is how long collectUntilAccounted waits without progress before it
// looks whether anything is left: longer than the statistics' delay of list_queues.
const quietBeforeGivingUp = 15 * time.Second

// collectUntilAccounted drains the results and poison queues until every message is
// accounted for; it returns the messages still missing at the run's deadline, or as soon
// as nothing is left that could account for them: after 15 s without progress, no
// message, ready or unacked, in the work, delay or parking queues (see brokerHolds),
// seen twice with nothing drained in between. That shortcut needs countable delay
// queues: not delayed-exchange, which waits for the deadline.
func (r *run) collectUntilAccounted(a *account) []string {
	lastProgress, quietSeen := time.Now(), 0
	for {
		before := len(a.handled) + len(a.poisoned)
		r.drain(a)
		missing := r.missing(a)
		if len(missing) == 0 {
			return nil
		}
		if r.ctx.Err() != nil {
			r.t.Logf("%s: deadline reached with %d messages unaccounted for", r.backend, len(missing))
			return missing
		}
		if len(a.handled)+len(a.poisoned) != before {
			lastProgress, quietSeen = time.Now(), 0
		} else if len(r.delayQueues) > 0 && time.Since(lastProgress) > quietBeforeGivingUp {
			if r.brokerHolds() == 0 {
				quietSeen++
			} else {
				quietSeen = 0
			}
			if quietSeen == 2 {
				r.t.Logf("%s: %d messages unaccounted for and none left in the work, delay or parking queues", r.backend, len(missing))
				return missing
			}
		}
		r.consumer.checkAlive(r)
		time.Sleep(250 * time.Millisecond)
	}
}

// brokerHolds returns how many messages the work, delay and parking queues hold, by two
// counts of each, the larger: rabbitmqctl list_queues' "messages", which includes the
// unacked ones and, for a quorum queue, those waiting to be dead-lettered (after a
// restart, at-least-once dead lettering may hold expired retries until its target is
// back, and retry them minutes later; they are not "ready"), but reports quorum queues
// from statistics seconds late; and a passive declare, which asks the queue now.
func (r *run) brokerHolds() int {
	out, err := brokertest.Ctl(r.ctx, "-q", "list_queues", "--no-table-headers", "name", "messages")
	if err != nil {
		r.fatal("%v", err)
	}
	listed := map[string]int{}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		c, err := strconv.Atoi(f[1])
		if err != nil {
			r.fatal("list_queues: %q: %v", line, err)
		}
		listed[f[0]] = c
	}
	if _, ok := listed[r.work]; !ok {
		r.fatal("rabbitmqctl list_queues does not list the work queue %s: is %s the broker at AMQP_URI?", r.work, brokertest.CtlEnv)
	}
	total := 0
	for _, q := range r.queues() {
		total += max(listed[q], r.count(q))
	}
	return total
}

// awaitQuiet waits until nothing is left in the work, delay and parking queues (a
// duplicate retry may still wait when every message is accounted for).
func (r *run) awaitQuiet() {
	for r.ctx.Err() == nil {
		total := 0
		for _, q := range r.queues() {
			total += r.count(q)
		}
		if total == 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// drain reads every message now in the results and poison queues into a. Acks follow
// the recording, on a connection no fault is injected into any more: each record is
// counted once.
func (r *run) drain(a *account) {
	conn, err := amqp.Dial(brokertest.URI())
	if err != nil {
		r.fatal("drain: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		r.fatal("drain: %v", err)
	}
	for {
		d, ok, err := ch.Get(r.results, false)
		if err != nil {
			r.fatal("drain %s: %v", r.results, err)
		}
		if !ok {
			break
		}
		attempt, ok := asInt(d.Headers[noloss.AttemptHeader])
		if !ok {
			a.unknown = append(a.unknown, fmt.Sprintf("result %q without %s", d.Body, noloss.AttemptHeader))
		}
		a.handled[string(d.Body)] = append(a.handled[string(d.Body)], attempt)
		if err := d.Ack(false); err != nil {
			r.fatal("ack: %v", err)
		}
	}
	for {
		d, ok, err := ch.Get(r.poison, false)
		if err != nil {
			r.fatal("drain %s: %v", r.poison, err)
		}
		if !ok {
			break
		}
		msg, err := xdeath.Marshaler{}.Unmarshal(d)
		if err != nil {
			a.unknown = append(a.unknown, fmt.Sprintf("poisoned message %s: %v", d.MessageId, err))
		} else {
			a.poisoned[msg.UUID] = append(a.poisoned[msg.UUID], msg.Metadata.Get(middleware.PoisonReasonKey))
		}
		if err := d.Ack(false); err != nil {
			r.fatal("ack: %v", err)
		}
	}
}

func asInt(v any) (int, bool) {
	switch x := v.(type) {
	case int32:
		return int(x), true
	case int64:
		return int(x), true
	case int16:
		return int(x), true
	case int8:
		return int(x), true
	}
	return 0, false
}

// count returns the number of messages in queue (a passive declare), retrying through
// a fault for up to 30 s.
func (r *run) count(queue string) int {
	var err error
	for try := 0; try < 60; try++ {
		if try > 0 {
			time.Sleep(500 * time.Millisecond)
		}
		var conn *amqp.Connection
		if conn, err = amqp.Dial(brokertest.URI()); err != nil {
			continue
		}
		var ch *amqp.Channel
		if ch, err = conn.Channel(); err == nil {
			var q amqp.Queue
			if q, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil); err == nil {
				_ = conn.Close()
				return q.Messages
			}
		}
		_ = conn.Close()
	}
	r.fatal("count messages in %s: %v", queue, err)
	return 0
}

// consumerProc is one run of the consumer program.
type consumerProc struct {
	cmd    *exec.Cmd
	exited chan struct{}
	err    error // after exited
	killed bool
}

func (r *run) startConsumer() *consumerProc {
	r.t.Helper()
	logf, err := os.OpenFile(r.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		r.t.Fatal(err)
	}
	cmd := exec.Command(r.bin, "-backend", r.backend, "-prefix", r.prefix, "-sabotage", strconv.Itoa(r.sabotage))
	cmd.Env = append(os.Environ(), "AMQP_URI="+brokertest.URI())
	cmd.Stderr = logf
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		r.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	p := &consumerProc{cmd: cmd, exited: make(chan struct{})}
	ready := make(chan struct{})
	go func() {
		s := bufio.NewScanner(stdout)
		signalled := false
		for s.Scan() {
			if s.Text() == noloss.Ready && !signalled {
				close(ready)
				signalled = true
			}
			fmt.Fprintln(logf, "stdout:", s.Text())
		}
		p.err = cmd.Wait()
		_ = logf.Close()
		close(p.exited)
	}()
	select {
	case <-ready:
		return p
	case <-p.exited:
		r.fatal("consumer exited before it was ready: %v", p.err)
	case <-time.After(time.Minute):
		p.kill()
		r.fatal("consumer not ready within a minute")
	}
	return nil
}

// checkAlive fails the run if the consumer died by itself.
func (p *consumerProc) checkAlive(r *run) {
	select {
	case <-p.exited:
		if !p.killed {
			r.fatal("consumer exited unexpectedly: %v", p.err)
		}
	default:
	}
}

// kill sends SIGKILL and waits for the process to end.
func (p *consumerProc) kill() {
	if p == nil {
		return
	}
	p.killed = true
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// stop sends SIGTERM (the consumer closes its router, which lets running handlers
// finish) and waits up to 30 s, then kills it.
func (p *consumerProc) stop() {
	p.killed = true
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		p.kill()
	}
}

// consumerLog returns the consumer's sabotage lines, its last 20 error lines (without
// the expected ones: the failures the fates ask for and the poisonings of the 1%
// permanent messages) and its last 20 lines.
func consumerLog(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	all := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	var sabotage, errs []string
	for _, l := range all {
		switch {
		case strings.Contains(l, "SABOTAGE"):
			sabotage = append(sabotage, l)
		case strings.Contains(l, "level=ERROR") && !strings.Contains(l, `msg="Message poisoned"`) && !strings.Contains(l, "(by the message's fate)"):
			errs = append(errs, l)
		}
	}
	last := func(lines []string) string { return strings.Join(lines[max(0, len(lines)-20):], "\n") }
	return fmt.Sprintf("%d sabotage lines:\n%s\n%d error lines (expected failures left out), the last %d:\n%s\nthe last %d lines:\n%s",
		len(sabotage), strings.Join(sabotage, "\n"), len(errs), min(20, len(errs)), last(errs), min(20, len(all)), last(all))
}
