package noloss_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss/fates"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

const (
	// EnableEnv turns the test on: "1".
	EnableEnv = "AMQPRETRY_NOLOSS"
	// NEnv is the number of messages per variant (default 5000; 2000 in a cluster).
	NEnv = "AMQPRETRY_NOLOSS_N"
	// SabotageEnv, for proving the test itself, makes the consumer drop this many
	// messages (see the consumer's -sabotage): the test must then fail with lost >= 1.
	SabotageEnv = "AMQPRETRY_NOLOSS_SABOTAGE"
	// BackendsEnv limits the run to these variants (noloss.Variants' names,
	// comma-separated). Default: every one (in a cluster: clusterDefaultVariants).
	BackendsEnv = "AMQPRETRY_NOLOSS_BACKENDS"
	// LogsEnv names a directory to copy each consumer's log into at the end of its run.
	LogsEnv = "AMQPRETRY_NOLOSS_LOGS"

	defaultN = 5000
)

// TestNoLoss sends N messages per variant through a consumer process (20% fail twice,
// or three times for the two-stage form, then succeed; 1% fail permanently) while
// faults are injected, each while retries wait (in delay queues, or in the work queue
// itself for RabbitMQ 4.3's delayed retry), then accounts for every message: handled
// (recorded by the consumer) or poisoned with reason permanent, every queue where
// retries wait empty. It prints one line per variant, starting with "NOLOSS ", that the
// README's Reliability table is filled from. Retries RabbitMQ holds in the work queue
// are counted through rabbitmqctl (list_queues messages - ready - unacked; a passive
// declare does not see them), as waiting before a fault and as still in the broker in
// the accounting. A variant the broker cannot run is skipped, saying why:
// delayed-exchange without its plugin (or on 4.3, which cannot run it), delayed-retry
// and the two-stage form before RabbitMQ 4.3 (the library refuses them,
// delay.ErrUnsupported). The ordered variants (noloss.Variant.Ordered) also count the
// keys blocked at each fault, check that no message was handled for the first time
// after a later message of its key (out_of_order on the NOLOSS line; a duplicate
// counts at its first run only) and that every key was released at the end.
//
// Against one broker (AMQP_URI, rabbitmqctl from AMQPRETRY_RABBITMQCTL) the faults are:
// its connections closed three times, the consumer killed with SIGKILL and restarted
// once, the broker's application stopped and started once. With
// AMQPRETRY_NOLOSS_CLUSTER=1 it runs on the three-node cluster of scripts/cluster.sh
// instead: see cluster_test.go.
func TestNoLoss(t *testing.T) {
	if os.Getenv(EnableEnv) != "1" {
		t.Skipf("takes minutes and disturbs the broker under test: set %s=1 and %s=1 (or %s=1 for the cluster of scripts/cluster.sh)", EnableEnv, brokertest.RestartEnv, ClusterEnv)
	}
	o := readOptions(t)
	if o.cluster {
		testCluster(t, o)
		return
	}
	if brokertest.CI() {
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
	brokertest.Dial(t) // fails under CI=true when no broker answers
	bin := buildConsumer(t)
	for _, v := range o.variants(noloss.Variants()) {
		t.Run(v.Name, func(t *testing.T) {
			newGroup(t, single{}, bin, o, []noloss.Variant{v}).play(singlePlan)
		})
	}
}

// options are the test's settings, from the environment.
type options struct {
	n, sabotage, major int
	nSet               bool     // NEnv set: n for every variant, whatever its own N
	only               []string // BackendsEnv
	cluster            bool
	// handoffPoisonOK accounts a transient message poisoned with reason handoff-failed
	// (5 hand-offs failed in a row: the partition test) as an
	// outcome to count and print, not a wrong one: it is in the poison queue with
	// its envelope, not lost.
	handoffPoisonOK bool
}

func readOptions(t *testing.T) options {
	t.Helper()
	o := options{n: defaultN, cluster: os.Getenv(ClusterEnv) == "1"}
	if o.cluster {
		o.n = clusterDefaultN
	}
	if s := os.Getenv(NEnv); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1 {
			t.Fatalf("%s=%q: want a positive number of messages", NEnv, s)
		}
		o.n, o.nSet = v, true
	}
	if s := os.Getenv(SabotageEnv); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 0 {
			t.Fatalf("%s=%q: want a number of messages to drop", SabotageEnv, s)
		}
		o.sabotage = v
	}
	var err error
	if o.major, err = noloss.ParseMajor(os.Getenv(noloss.MajorEnv)); err != nil {
		t.Fatal(err)
	}
	if s := os.Getenv(BackendsEnv); s != "" {
		for _, name := range strings.Split(s, ",") {
			if _, ok := noloss.VariantNamed(strings.TrimSpace(name)); !ok {
				var known []string
				for _, v := range noloss.Variants() {
					known = append(known, v.Name)
				}
				t.Fatalf("%s: unknown variant %q (known: %s)", BackendsEnv, name, strings.Join(known, ", "))
			}
			o.only = append(o.only, strings.TrimSpace(name))
		}
	}
	return o
}

// variants returns the variants to run: those of BackendsEnv, else all of def.
func (o options) variants(def []noloss.Variant) []noloss.Variant {
	if len(o.only) == 0 {
		return def
	}
	var out []noloss.Variant
	for _, name := range o.only {
		v, _ := noloss.VariantNamed(name)
		out = append(out, v)
	}
	return out
}

func buildConsumer(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "noloss-consumer")
	out, err := exec.Command("go", "build", "-o", bin, "./consumer").CombinedOutput()
	if err != nil {
		t.Fatalf("go build ./consumer: %v\n%s", err, out)
	}
	return bin
}

// broker is what a run is played against: one broker, or the cluster.
type broker interface {
	// setup returns the run's connection settings (URI, and nodes in a cluster).
	setup() noloss.Setup
	// ctl runs rabbitmqctl on (a running node of) the broker.
	ctl(ctx context.Context, args ...string) ([]byte, error)
	// nodes is how many nodes the broker has.
	nodes() int
}

// single is the broker at AMQP_URI, driven by brokertest.Ctl.
type single struct{}

func (single) setup() noloss.Setup { return noloss.Setup{URI: brokertest.URI()} }
func (single) ctl(ctx context.Context, args ...string) ([]byte, error) {
	return brokertest.Ctl(ctx, args...)
}
func (single) nodes() int { return 1 }

// fault is one fault of a plan: it returns a note for the fault list ("" for none).
type fault struct {
	name   string
	inject func(g *group) string
}

// The faults against one broker, one after each batch but the last, in this order.
var singlePlan = []fault{
	{"close_all_connections", closeAll},
	{"consumer_sigkill_restart", killConsumer},
	{"close_all_connections", closeAll},
	{"stop_app_start_app", stopApp},
	{"close_all_connections", closeAll},
}

func closeAll(g *group) string {
	if out, err := g.b.ctl(g.ctx, "close_all_connections", fmt.Sprintf("amqpretry no-loss test, fault %d", len(g.faults)+1)); err != nil {
		g.fatal("%v\n%s", err, out)
	}
	return ""
}

func killConsumer(g *group) string {
	for _, r := range g.runs {
		r.consumer.kill()
		r.consumer = r.startConsumer()
	}
	return ""
}

func stopApp(g *group) string {
	for _, step := range []string{"stop_app", "start_app", "await_startup"} {
		if out, err := g.b.ctl(g.ctx, step); err != nil {
			g.fatal("%v\n%s", err, out)
		}
	}
	if err := g.runs[0].waitBroker(time.Minute); err != nil {
		g.fatal("broker did not come back within a minute after start_app: %v", err)
	}
	return ""
}

// group is runs played together against one broker: each batch goes to every run,
// and each fault, injected once, hits them all. Against one broker a group has one
// run; in the cluster, one run per variant (the node restarts, not the messages, take
// the time).
type group struct {
	t      *testing.T
	ctx    context.Context
	b      broker
	bin    string
	o      options
	runs   []*run
	faults []faultRecord
	start  time.Time
	// batch is the batch just published, of batches: a fault may publish the next.
	batch, batches int
	// client is the command prefix a consumer process runs under (none: run as is);
	// extraClients, one more consumer process per run under each of these prefixes
	// (the partition test: `ip netns exec NS`, clients on both sides of a split).
	client       []string
	extraClients [][]string
}

// newGroup bounds the group's runs: 6 min (10 in a cluster, which restarts nodes)
// plus 15 ms per message. After a restart, at-least-once dead lettering may keep
// expired retries until it retries them, minutes later (seen: 3 min on RabbitMQ
// 3.10.8).
func newGroup(t *testing.T, b broker, bin string, o options, variants []noloss.Variant) *group {
	t.Helper()
	budget := 6*time.Minute + time.Duration(o.n*len(variants))*15*time.Millisecond
	if b.nodes() > 1 {
		budget += 4 * time.Minute
	}
	deadline := time.Now().Add(budget)
	if d, ok := t.Deadline(); ok && d.Add(-30*time.Second).Before(deadline) {
		deadline = d.Add(-30 * time.Second)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	t.Cleanup(cancel)
	g := &group{t: t, ctx: ctx, b: b, bin: bin, o: o}
	for _, v := range variants {
		g.runs = append(g.runs, newRun(g, v))
	}
	return g
}

func (g *group) elapsed() float64 { return time.Since(g.start).Seconds() }

func (g *group) fatal(format string, args ...any) {
	g.t.Helper()
	for _, r := range g.runs {
		g.t.Logf("%s: consumer log: %s", r.v.Name, consumerLog(r.logPath))
	}
	g.t.Fatalf(format, args...)
}

// play publishes the messages in batches, one fault after each batch but the last
// once retries of every run wait, then accounts for every run.
func (g *group) play(plan []fault) []*account {
	g.start = time.Now()
	for _, r := range g.runs {
		r.consumer = r.startConsumer()
		g.t.Cleanup(func() { r.consumer.kill() })
		for _, w := range g.extraClients {
			p := r.startConsumerWith(w)
			r.extra = append(r.extra, p)
			g.t.Cleanup(p.kill)
		}
		if g.b.nodes() > 1 {
			// The consumer's subscribers have declared the work queue.
			r.checkReplication()
		}
	}
	batches := len(plan) + 1
	for b := range batches {
		for _, r := range g.runs {
			lo, hi := r.batch(b, batches)
			if err := r.publish(lo, hi); err != nil {
				g.fatal("%s: publish batch %d: %v", r.v.Name, b+1, err)
			}
		}
		if b == len(plan) {
			break
		}
		g.batch, g.batches = b, batches
		waiting := make([]int, len(g.runs))
		for i, r := range g.runs {
			waiting[i] = r.awaitWaitingRetries(r.batch(b, batches))
		}
		g.inject(plan[b], waiting)
	}
	g.t.Logf("all messages published, faults: %s; accounting", g.faultList())
	var accs []*account
	for _, r := range g.runs {
		accs = append(accs, r.finish())
	}
	return accs
}

func (g *group) faultList() string {
	var fl []string
	for _, f := range g.faults {
		fl = append(fl, f.String(g.start))
	}
	return strings.Join(fl, " ")
}

func (g *group) inject(f fault, waiting []int) {
	g.t.Helper()
	rec := faultRecord{name: f.name, start: time.Now(), waiting: waiting}
	rec.blocked = g.blockedKeys()
	g.t.Logf("fault %d %s at %.1f s with %v retries waiting%s", len(g.faults)+1, f.name, g.elapsed(), waiting, rec.blockedNote())
	rec.note = f.inject(g)
	rec.end = time.Now()
	for _, r := range g.runs {
		r.resultsAtFault = r.count(r.results)
	}
	g.faults = append(g.faults, rec)
	g.t.Logf("fault %d %s done after %.1f s %s", len(g.faults), f.name, rec.end.Sub(rec.start).Seconds(), rec.note)
}

// run is one variant's run.
type run struct {
	g        *group
	t        *testing.T
	ctx      context.Context
	b        broker
	s        noloss.Setup
	v        noloss.Variant
	idx      int // in its group
	n        int
	sabotage int
	version  string
	logPath  string
	scenario string // on the NOLOSS line, for a run that is not a variant's plain run

	work, results, poison string
	parking               string   // "" for delayed-exchange and delayed-retry, which have none
	delayQueues           []string // where copies wait: none for delayed-exchange (inside the plugin) and delayed-retry
	allQueues, exchanges  []string // everything the run declared, deleted at its end
	// keys is how many order keys the messages carry (0: none): message i has key
	// noloss.OrderKeyName(i % keys) in noloss.KeyMetadata. behind names the behind
	// queues the keys may have (deleted at the end). queueOf, if set, names the work
	// queue message i is published to, and works then lists them (the order
	// partitions); r.work is the first.
	keys    int
	behind  []string
	queueOf func(i int) string
	works   []string
	// acc, if set, has the records drained before the end (the order partitions).
	acc *account

	uuids     []string
	fates     map[string]fates.Fate
	published map[int]bool // messages confirmed by a fault's own publish
	consumer  *consumerProc
	extra     []*consumerProc // group.extraClients' consumer processes
	// waitingOptional lets a fault go ahead when fewer retries than wanted were seen
	// waiting a minute after its batch (the backend-switch run).
	waitingOptional bool
	// resultsAtFault is how many records the results queue had after the last fault.
	resultsAtFault int
	// consumerArgs are more flags of the consumer (a run that changes backends), and
	// anyHoldsRetries tells that some configuration of the run holds retries in the work queue.
	consumerArgs    []string
	anyHoldsRetries bool
	policyOn        bool // the delayed-retry policy is on the work queue
	// stoppedAt and readyAt are when each change began stopping the consumer and
	// when the next one was ready.
	stoppedAt, readyAt []time.Time
}

// holdsRetries tells whether retries may wait in the work queue itself.
func (r *run) holdsRetries() bool { return r.v.HoldsRetries() || r.anyHoldsRetries }

// faultRecord is one injected fault.
type faultRecord struct {
	name       string
	note       string
	start, end time.Time // from the first command to the broker being back
	waiting    []int     // retries waiting in each run of the group when it started
	// blocked is, for each ordered run of the group (none: no run is), how many of
	// its keys were blocked when it started, and how many messages waited behind
	// them.
	blocked []blockedCount
}

func (f faultRecord) String(start time.Time) string {
	var w []string
	for _, n := range f.waiting {
		w = append(w, strconv.Itoa(n))
	}
	s := fmt.Sprintf("%s@%.1fs+%.1fs(waiting=%s", f.name, f.start.Sub(start).Seconds(), f.end.Sub(f.start).Seconds(), strings.Join(w, "+"))
	if len(f.blocked) > 0 {
		s += "," + f.blockedFields(",")
	}
	if f.note != "" {
		s += "," + f.note
	}
	return s + ")"
}

func newRun(g *group, v noloss.Variant) *run {
	t := g.t
	t.Helper()
	s := g.b.setup()
	s.Variant, s.Major, s.Prefix = v, g.o.major, brokertest.Prefix(t)
	r := &run{g: g, t: t, ctx: g.ctx, b: g.b, s: s, v: v, idx: len(g.runs), n: g.o.n, sabotage: g.o.sabotage, published: map[int]bool{}}
	if v.N > 0 && !g.o.nSet {
		r.n = v.N
	}
	r.work, r.results = noloss.WorkQueue(s.Prefix), noloss.ResultsQueue(s.Prefix)
	if v.Ordered {
		r.orderKeys(noloss.OrderKeys)
	}
	r.logPath = filepath.Join(t.TempDir(), "consumer.log")
	if dir := os.Getenv(LogsEnv); dir != "" {
		t.Cleanup(func() {
			b, err := os.ReadFile(r.logPath)
			if err == nil {
				err = os.WriteFile(filepath.Join(dir, fmt.Sprintf("%s.v%d.%s.log", r.v.Name, r.s.Major, s.Prefix)), b, 0o644)
			}
			if err != nil && !errors.Is(err, os.ErrNotExist) { // none: the run was skipped
				t.Logf("%s: %v", LogsEnv, err)
			}
		})
	}

	// Plan names everything the consumer's Retry declares, for clean-up (even when New
	// then fails) and for the accounting.
	plan, err := s.Config().Plan(r.work)
	if err != nil {
		t.Fatal(err)
	}
	r.poison = s.Config().WithDefaults().PoisonQueue
	r.allQueues = []string{r.work, r.results}
	for _, q := range plan.Queues {
		switch {
		case q.Name == r.work || slices.Contains(r.allQueues, q.Name):
		case q.Name == r.poison:
		case q.Name == s.Prefix+".parking":
			r.parking = q.Name
		default:
			r.delayQueues = append(r.delayQueues, q.Name)
		}
		if !slices.Contains(r.allQueues, q.Name) {
			r.allQueues = append(r.allQueues, q.Name)
		}
	}
	if !slices.Contains(r.allQueues, r.poison) {
		r.allQueues = append(r.allQueues, r.poison)
	}
	for _, e := range plan.Exchanges {
		r.exchanges = append(r.exchanges, e.Name)
	}
	t.Cleanup(r.deleteAll)

	// Build the Retry once here, as the consumer will: it declares the topology and
	// tells whether this broker can run the variant.
	retry, err := noloss.New(s)
	switch {
	case errors.Is(err, delay.ErrPluginMissing):
		t.Skipf("%s needs the rabbitmq_delayed_message_exchange plugin, which this broker does not have (or cannot run): %v", v.Name, err)
	case errors.Is(err, delay.ErrUnsupported):
		t.Skipf("%s needs RabbitMQ 4.3 or later (delayed retry of quorum queues); the library refuses it on this broker: %v", v.Name, err)
	case err != nil:
		t.Fatal(err)
	}
	if err := retry.Close(); err != nil {
		t.Fatal(err)
	}

	r.declareResults()

	r.fates = make(map[string]fates.Fate, r.n)
	for i := range r.n {
		id := watermill.NewUUID()
		r.uuids = append(r.uuids, id)
		r.fates[id] = fates.For(i)
	}
	return r
}

// batch returns the messages of batch b of batches: lo..hi-1.
// declareResults reads the broker's version and declares the queue of the consumers'
// records. The faults go through rabbitmqctl: it makes sure rabbitmqctl drives this
// broker, not another one on the machine, before anything is disturbed.
func (r *run) declareResults() {
	t := r.t
	t.Helper()
	conn := r.dial()
	r.version, _ = conn.Properties["version"].(string)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(r.results, true, false, false, false, r.s.QueueArgs()); err != nil {
		t.Fatal(err)
	}
	noloss.CloseConn(conn)
	if _, ok := r.listQueues()[r.results]; !ok {
		t.Fatalf("rabbitmqctl does not see queue %s, just declared on the broker under test: it drives another broker (%s)", r.results, brokertest.CtlEnv)
	}
}

func (r *run) batch(b, batches int) (lo, hi int) { return b * r.n / batches, (b + 1) * r.n / batches }

// dial connects as the run's connections do (through every node of a cluster),
// trying for up to a minute.
func (r *run) dial() *amqp.Connection {
	r.t.Helper()
	var err error
	for try := 0; try < 120; try++ {
		if try > 0 {
			time.Sleep(500 * time.Millisecond)
		}
		var conn *amqp.Connection
		if conn, err = r.s.Dial(); err == nil {
			return conn
		}
	}
	r.fatal("connect: %v", err)
	return nil
}

// waitBroker returns once the broker accepts a connection.
func (r *run) waitBroker(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		conn, err := r.s.Dial()
		if err == nil {
			noloss.CloseConn(conn)
			return nil
		}
		if time.Now().After(deadline) || r.ctx.Err() != nil {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// deleteAll deletes every queue and exchange of the run (brokers run with few file
// descriptors).
func (r *run) deleteAll() {
	conn, err := r.s.Dial()
	if err != nil {
		r.t.Logf("clean-up: %v", err)
		return
	}
	defer noloss.CloseConn(conn)
	for _, q := range append(slices.Clone(r.allQueues), r.behind...) {
		if ch, err := conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(q, false, false, false)
			_ = ch.Close()
		}
	}
	for _, e := range r.exchanges {
		if ch, err := conn.Channel(); err == nil {
			_ = ch.ExchangeDelete(e, false, false)
			_ = ch.Close()
		}
	}
}

// waitingQueues are the queues that must be empty at the end: the work queue, the
// parking queue and the delay queues.
func (r *run) waitingQueues() []string {
	qs := []string{r.work}
	if len(r.works) > 0 {
		qs = slices.Clone(r.works)
	}
	if r.parking != "" {
		qs = append(qs, r.parking)
	}
	return append(qs, r.delayQueues...)
}

// countable tells whether every retry of the run waits where the test can count it
// (not inside the delayed-message plugin).
func (r *run) countable() bool { return r.v.Backend != delay.DelayedExchange() }

func (r *run) faults() []faultRecord { return r.g.faults }

// finish accounts for every message, prints the NOLOSS lines and fails the test on a
// loss or a wrong outcome.
func (r *run) finish() *account {
	t := r.t
	acc := r.acc
	if acc == nil {
		acc = newAccount()
	}
	missing := r.collectUntilAccounted(acc)
	if len(missing) == 0 {
		// Everything is accounted for; let duplicates in flight finish before the
		// final count, then stop the consumer cleanly.
		r.awaitQuiet()
	}
	for _, p := range r.extra {
		p.stop()
	}
	r.consumer.stop()
	r.drain(acc) // what the consumer recorded before it stopped
	seconds := r.g.elapsed()
	missing = r.missing(acc)

	lost := len(missing)
	dupUUIDs, extra := acc.duplicates()
	cluster := ""
	if r.b.nodes() > 1 {
		cluster = fmt.Sprintf(" nodes=%d", r.b.nodes())
	}
	if r.scenario != "" {
		cluster += " scenario=" + r.scenario
	}
	order := ""
	var outOfOrder []string
	if r.keys > 0 {
		outOfOrder = r.outOfOrder(acc)
		order = fmt.Sprintf(" out_of_order=%d", len(outOfOrder))
	}
	fmt.Printf("NOLOSS backend=%s rabbitmq=%s%s watermill-amqp=v%d n=%d faults=%d lost=%d duplicates=%d%s seconds=%.1f\n",
		r.v.Name, r.version, cluster, r.s.Major, r.n, len(r.faults()), lost, dupUUIDs, order, seconds)
	late := acc.lateness()
	fmt.Printf("NOLOSS-DETAIL backend=%s handled=%d poisoned=%d extra_runs=%d sabotage=%d retries_timed=%d late_p50_ms=%d late_p99_ms=%d late_max_ms=%d faults=%q\n",
		r.v.Name, len(acc.handled), len(acc.poisoned), extra, r.sabotage, len(late), pct(late, 50), pct(late, 99), pct(late, 100), r.g.faultList())

	if dups := acc.duplicated(); len(dups) > 0 {
		t.Logf("%s: %d messages handled or poisoned more than once (at-least-once), the first %d: %s", r.v.Name, len(dups), min(20, len(dups)), strings.Join(dups[:min(20, len(dups))], " "))
	}
	if lost > 0 {
		shown := missing[:min(20, len(missing))]
		var lines []string
		for _, id := range shown {
			lines = append(lines, fmt.Sprintf("  %s (fate %s)", id, r.fates[id]))
		}
		report := fmt.Sprintf("%s: %d of %d messages lost (neither handled nor poisoned as permanent); first %d:\n%s",
			r.v.Name, lost, r.n, len(shown), strings.Join(lines, "\n"))
		if r.v.Backend == (delay.DelayedExchange()) && lost*100 < r.n && r.sabotage == 0 {
			// The plugin may drop retries that come due while the broker stops (README,
			// Reliability): such a loss cannot be told apart from another one, so the
			// test bounds it below 1% and prints it.
			t.Log(report)
		} else {
			t.Error(report)
		}
	}
	if r.g.o.handoffPoisonOK {
		poisoned, handled := 0, 0
		for id, reasons := range acc.poisoned {
			if r.fates[id] != fates.Permanent && slices.Contains(reasons, amqpretry.ReasonHandoffFailed) {
				poisoned++
				if len(acc.handled[id]) > 0 {
					handled++
				}
			}
		}
		fmt.Printf("NOLOSS-HANDOFF-POISONED backend=%s poisoned_handoff_failed=%d of_them_also_handled=%d\n", r.v.Name, poisoned, handled)
	}
	for _, p := range acc.problems(r.fates, r.v.Failures, r.g.o.handoffPoisonOK) {
		t.Errorf("%s: %s", r.v.Name, p)
	}
	if len(outOfOrder) > 0 {
		t.Errorf("%s: %d messages handled for the first time after a later message of their key, the first %d: %s",
			r.v.Name, len(outOfOrder), min(20, len(outOfOrder)), strings.Join(outOfOrder[:min(20, len(outOfOrder))], "; "))
	}
	if r.keys > 0 {
		r.checkReleased()
	}
	// Nothing may be left where retries wait. rabbitmqctl's counts of quorum queues
	// lag by seconds: a count above 0 is asked again for up to 20 s.
	counts := r.brokerCountsEach()
	for deadline := time.Now().Add(20 * time.Second); sum(counts) > 0 && time.Now().Before(deadline); {
		time.Sleep(2 * time.Second)
		counts = r.brokerCountsEach()
	}
	for _, q := range r.waitingQueues() {
		if c := counts[q]; c != 0 {
			t.Errorf("queue %s has %d messages at the end, want 0", q, c)
		}
	}
	if t.Failed() {
		t.Logf("%s: consumer log: %s", r.v.Name, consumerLog(r.logPath))
	}
	return acc
}

func (r *run) fatal(format string, args ...any) {
	r.t.Helper()
	r.g.fatal(r.v.Name+": "+format, args...)
}

// publish sends messages lo..hi-1 to the work queue, persistent, mandatory, each
// confirmed, trying again on a fresh connection for the ones not confirmed. No fault is
// injected while it runs, so it publishes each message once.
func (r *run) publish(lo, hi int) error {
	pending := make([]int, 0, hi-lo)
	for i := lo; i < hi; i++ {
		if !r.published[i] {
			pending = append(pending, i)
		}
	}
	var err error
	for try := 0; len(pending) > 0; try++ {
		if try > 0 {
			if r.ctx.Err() != nil || try > 20 {
				return fmt.Errorf("%d messages not confirmed: %w", len(pending), err)
			}
			time.Sleep(500 * time.Millisecond)
		}
		pending, err = r.publishOnce(r.ctx, pending)
	}
	return nil
}

func (r *run) publishOnce(ctx context.Context, idx []int) (notConfirmed []int, err error) {
	conn, err := r.s.Dial()
	if err != nil {
		return idx, err
	}
	defer noloss.CloseConn(conn)
	// Every call below is bounded by ctx: a broker that does not answer (no quorum)
	// gets its connection closed.
	defer context.AfterFunc(ctx, func() { noloss.CloseConn(conn) })()
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
		msg := message.NewMessage(r.uuids[i], fates.PayloadOf(r.fates[r.uuids[i]], i))
		if r.keys > 0 {
			msg.Metadata.Set(noloss.KeyMetadata, r.keyOf(i))
		}
		p, err := wamqp.DefaultMarshaler{}.Marshal(msg)
		if err != nil {
			return idx, err
		}
		p.MessageId = r.uuids[i]
		queue := r.work
		if r.queueOf != nil {
			queue = r.queueOf(i)
		}
		if confirms[k], err = ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, p); err != nil {
			return idx[k:], err
		}
	}
	for k, dc := range confirms {
		ok, err := dc.WaitContext(ctx)
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
// fault (it recovered and works) and retries of this batch wait (at least 20, or every
// transient message of the batch if fewer), and returns how many wait. For
// delayed-exchange, whose retries wait inside the plugin where they cannot be counted,
// it waits for the recorded messages only and returns -1.
func (r *run) awaitWaitingRetries(lo, hi int) int {
	want := 0
	for i := lo; i < hi; i++ {
		if r.fates[r.uuids[i]] == fates.Transient {
			want++
		}
	}
	want = max(min(want, 20), 1)
	if r.keys > 0 {
		// A blocked key has one retry waiting, its head, whatever waits behind it.
		want = min(want, 10)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		waiting := -1
		if r.count(r.results) > r.resultsAtFault {
			if !r.countable() {
				return waiting
			}
			waiting = r.waitingNow()
			if waiting >= want {
				return waiting
			}
		}
		if time.Now().After(deadline) || r.ctx.Err() != nil {
			if r.waitingOptional && r.ctx.Err() == nil && waiting >= 0 {
				// A run that changes backends between faults: what it measures is that
				// nothing is lost across the change, which the accounting checks.
				r.t.Logf("a minute after publishing messages %d..%d: %d records, %d retries seen waiting in %v (wanted %d): changing backends anyway",
					lo, hi-1, r.count(r.results), waiting, r.retryQueues(), want)
				return waiting
			}
			r.fatal("a minute after publishing messages %d..%d: %d records (%d at the last fault), %d retries waiting in %v (want %d)",
				lo, hi-1, r.count(r.results), r.resultsAtFault, waiting, r.retryQueues(), want)
		}
		r.consumer.checkAlive(r)
		time.Sleep(20 * time.Millisecond)
	}
}

// retryQueues names where retries wait, for messages.
func (r *run) retryQueues() []string {
	qs := slices.Clone(r.delayQueues)
	if r.holdsRetries() {
		qs = append(qs, r.work+" (held)")
	}
	return qs
}

// waitingNow counts the retries waiting: in the delay queues (a passive declare, which
// is current) and, with delayed retry, held in the work queue (rabbitmqctl's messages −
// ready − unacked: a passive declare does not see them).
func (r *run) waitingNow() int {
	waiting := 0
	for _, q := range r.delayQueues {
		waiting += r.count(q)
	}
	if r.holdsRetries() {
		waiting += r.listQueues()[r.work].aside()
	}
	return waiting
}

// queueStats is a queue's line of rabbitmqctl list_queues.
type queueStats struct {
	Name     string   `json:"name"`
	Type     string   `json:"type"`
	Messages int      `json:"messages"`
	Ready    int      `json:"messages_ready"`
	Unacked  int      `json:"messages_unacknowledged"`
	Leader   string   `json:"leader"`
	Members  []string `json:"members"`
	Online   []string `json:"online"`
}

// aside is how many messages the queue has that are neither ready nor delivered:
// retries RabbitMQ 4.3 holds (delayed retry), or messages waiting to be dead-lettered.
func (q queueStats) aside() int { return max(q.Messages-q.Ready-q.Unacked, 0) }

// listQueues runs rabbitmqctl list_queues (every queue of the vhost, with its counts;
// in a cluster also its leader and members) and returns the run's queues.
func (r *run) listQueues() map[string]queueStats { return r.mine(listAll(r.g)) }

// mine returns the run's queues of all.
func (r *run) mine(all []queueStats) map[string]queueStats {
	out := map[string]queueStats{}
	for _, q := range all {
		if strings.HasPrefix(q.Name, r.s.Prefix+".") {
			out[q.Name] = q
		}
	}
	return out
}

// listAll runs rabbitmqctl list_queues once, for every run of g.
func listAll(g *group) []queueStats {
	g.t.Helper()
	cols := []string{"name", "type", "messages", "messages_ready", "messages_unacknowledged"}
	if g.b.nodes() > 1 {
		cols = append(cols, "leader", "members", "online")
	}
	out, err := g.b.ctl(g.ctx, append([]string{"-q", "list_queues", "--formatter", "json"}, cols...)...)
	if err != nil {
		g.fatal("%v", err)
	}
	all, err := parseQueues(out)
	if err != nil {
		g.fatal("list_queues: %v", err)
	}
	return all
}

func parseQueues(out []byte) ([]queueStats, error) {
	if i := strings.IndexByte(string(out), '['); i > 0 {
		out = out[i:] // past any warning printed before the document
	}
	var all []queueStats
	if err := json.Unmarshal(out, &all); err != nil {
		return nil, fmt.Errorf("%w\n%s", err, out)
	}
	return all, nil
}

// account is what the results and poison queues said.
type account struct {
	handled  map[string][]record // UUID -> each record
	poisoned map[string][]amqpretry.Reason
	unknown  []string
}

// record is one result record: the consumer handled a message.
type record struct {
	attempt int
	arrived time.Time
	late    time.Duration
	timed   bool  // late is known: a retry
	hops    []hop // the message's earlier retries, as far as the consumer process knew
	// handled is when the run that succeeded began (to the nanosecond), queue the
	// work queue it came from, pid the consumer process that ran it.
	handled time.Time
	queue   string
	pid     int
}

// hop is one retry's delivery: when it arrived, and how late against its due time.
type hop struct {
	arrived time.Time
	late    time.Duration
}

// retries returns every retry delivery of the record that is timed: the earlier hops,
// then the delivery that succeeded.
func (rec record) retries() []hop {
	out := slices.Clone(rec.hops)
	if rec.timed {
		out = append(out, hop{rec.arrived, rec.late})
	}
	return out
}

func newAccount() *account {
	return &account{handled: map[string][]record{}, poisoned: map[string][]amqpretry.Reason{}}
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

// lateness returns how late each retry was against its due time, as the first record
// of each message tells.
func (a *account) lateness() []time.Duration {
	var out []time.Duration
	for _, recs := range a.handled {
		for _, h := range earliest(recs).retries() {
			out = append(out, h.late)
		}
	}
	slices.Sort(out)
	return out
}

// earliest is the first of a message's records: the first run that succeeded.
func earliest(recs []record) record {
	return slices.MinFunc(recs, func(a, b record) int {
		if c := a.handled.Compare(b.handled); c != 0 {
			return c
		}
		return a.arrived.Compare(b.arrived)
	})
}

// pct returns the p-th percentile of sorted durations, in ms (0 for none).
func pct(sorted []time.Duration, p int) int64 {
	if len(sorted) == 0 {
		return 0
	}
	i := min(len(sorted)-1, (len(sorted)*p+99)/100-1)
	return sorted[max(i, 0)].Milliseconds()
}

// duplicated describes each message handled or poisoned more than once: its UUID, then
// the attempt and arrival (Unix ms) of each record, or the poison reasons.
func (a *account) duplicated() []string {
	var out []string
	for id, recs := range a.handled {
		if len(recs) > 1 {
			var parts []string
			for _, rec := range recs {
				parts = append(parts, fmt.Sprintf("attempt%d@%d", rec.attempt, rec.arrived.UnixMilli()))
			}
			out = append(out, id+"("+strings.Join(parts, ",")+")")
		}
	}
	for id, reasons := range a.poisoned {
		if len(reasons) > 1 {
			out = append(out, fmt.Sprintf("%s(poisoned %d times)", id, len(reasons)))
		}
	}
	slices.Sort(out)
	return out
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
func (a *account) problems(fateOf map[string]fates.Fate, failures int, handoffPoisonOK bool) []string {
	var out []string
	for id, recs := range a.handled {
		first := slices.MinFunc(recs, func(a, b record) int { return a.attempt - b.attempt })
		switch fate, ok := fateOf[id]; {
		case !ok:
			out = append(out, fmt.Sprintf("results contain an unknown message %s", id))
		case fate == fates.Permanent:
			out = append(out, fmt.Sprintf("message %s (fate permanent) was handled", id))
		case fate == fates.Transient && first.attempt <= failures:
			out = append(out, fmt.Sprintf("message %s (fate transient) succeeded on attempt %d", id, first.attempt))
		case fate == fates.Once && first.attempt <= 1:
			out = append(out, fmt.Sprintf("message %s (fate once) succeeded on attempt %d", id, first.attempt))
		}
	}
	for id, reasons := range a.poisoned {
		fate, ok := fateOf[id]
		if ok && fate != fates.Permanent && handoffPoisonOK && !slices.ContainsFunc(reasons, func(r amqpretry.Reason) bool { return r != amqpretry.ReasonHandoffFailed }) {
			continue
		}
		switch {
		case !ok:
			out = append(out, fmt.Sprintf("poison queue has an unknown message %s", id))
		case fate != fates.Permanent:
			out = append(out, fmt.Sprintf("message %s (fate %s) was poisoned: %v", id, fate, reasons))
		}
		for _, reason := range reasons {
			if reason != amqpretry.ReasonPermanent {
				out = append(out, fmt.Sprintf("message %s poisoned with reason %q, want %q", id, reason, amqpretry.ReasonPermanent))
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
		if r.fates[id] == fates.Permanent {
			if !slices.Contains(a.poisoned[id], amqpretry.ReasonPermanent) {
				out = append(out, id)
			}
		} else if len(a.handled[id]) == 0 && !(r.g.o.handoffPoisonOK && slices.Contains(a.poisoned[id], amqpretry.ReasonHandoffFailed)) {
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
// message, ready, unacked or held, in the work, delay or parking queues (see
// brokerCount), seen twice with nothing drained in between. That shortcut needs
// countable retries: not delayed-exchange, which waits for the deadline.
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
			r.t.Logf("%s: deadline reached with %d messages unaccounted for", r.v.Name, len(missing))
			return missing
		}
		if len(a.handled)+len(a.poisoned) != before {
			lastProgress, quietSeen = time.Now(), 0
		} else if r.countable() && time.Since(lastProgress) > quietBeforeGivingUp {
			if r.brokerCount() == 0 {
				quietSeen++
			} else {
				quietSeen = 0
			}
			if quietSeen == 2 {
				r.t.Logf("%s: %d messages unaccounted for and none left in the work, delay or parking queues", r.v.Name, len(missing))
				return missing
			}
		}
		r.consumer.checkAlive(r)
		time.Sleep(250 * time.Millisecond)
	}
}

// brokerCount returns how many messages the work, delay and parking queues have.
func (r *run) brokerCount() int {
	total := 0
	for _, c := range r.brokerCountsEach() {
		total += c
	}
	return total
}

// brokerCountsEach returns how many messages each of the work, delay and parking queues
// has, by two counts of each, the larger: rabbitmqctl list_queues' "messages", which
// includes the unacked ones and, for a quorum queue, those waiting to be dead-lettered
// (after a restart, at-least-once dead lettering may keep expired retries until its
// target is back, and retry them minutes later; they are not "ready") and the retries
// RabbitMQ 4.3 holds in the work queue, but reports quorum queues from statistics
// seconds late; and a passive declare, which asks the queue now.
func (r *run) brokerCountsEach() map[string]int {
	listed := r.listQueues()
	if _, ok := listed[r.work]; !ok {
		r.fatal("rabbitmqctl list_queues does not list the work queue %s: is %s the broker under test?", r.work, brokertest.CtlEnv)
	}
	out := map[string]int{}
	for _, q := range r.waitingQueues() {
		out[q] = max(listed[q].Messages, r.count(q))
	}
	if r.keys > 0 {
		_, out["behind queues"] = r.blockedIn(listed)
	}
	return out
}

// awaitQuiet waits until nothing is left in the work, delay and parking queues (a
// duplicate retry may still wait when every message is accounted for).
func (r *run) awaitQuiet() {
	for r.ctx.Err() == nil {
		total := 0
		for _, q := range r.waitingQueues() {
			total += r.count(q)
		}
		if total == 0 && r.holdsRetries() {
			total = r.listQueues()[r.work].Messages
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
	conn := r.dial()
	defer noloss.CloseConn(conn)
	// Bounded: a broker that stops answering fails the run instead of blocking it.
	watchdog := time.AfterFunc(2*time.Minute, func() { noloss.CloseConn(conn) })
	defer watchdog.Stop()
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
		rec := record{attempt: attempt}
		if ms, ok := asInt(d.Headers[noloss.ArrivedHeader]); ok {
			rec.arrived = time.UnixMilli(int64(ms))
		}
		if ms, ok := asInt(d.Headers[noloss.LateHeader]); ok {
			rec.late, rec.timed = time.Duration(ms)*time.Millisecond, true
		}
		if ns, ok := d.Headers[noloss.HandledHeader].(int64); ok {
			rec.handled = time.Unix(0, ns)
		} else if r.keys > 0 {
			a.unknown = append(a.unknown, fmt.Sprintf("result %q without %s: its order is unknown", d.Body, noloss.HandledHeader))
		}
		rec.queue, _ = d.Headers[noloss.QueueHeader].(string)
		rec.pid, _ = asInt(d.Headers[noloss.PIDHeader])
		if hops, ok := d.Headers[noloss.HopsHeader].(string); ok {
			for _, h := range strings.Split(hops, ",") {
				at, late, _ := strings.Cut(h, ":")
				a, err1 := strconv.ParseInt(at, 10, 64)
				l, err2 := strconv.ParseInt(late, 10, 64)
				if err1 == nil && err2 == nil {
					rec.hops = append(rec.hops, hop{time.UnixMilli(a), time.Duration(l) * time.Millisecond})
				}
			}
		}
		a.handled[string(d.Body)] = append(a.handled[string(d.Body)], rec)
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
			a.poisoned[msg.UUID] = append(a.poisoned[msg.UUID], middleware.ReadEnvelope(msg.Metadata).Reason)
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

// count returns the number of ready messages in queue (a passive declare), retrying
// through a fault for up to 30 s.
func (r *run) count(queue string) int {
	var err error
	for start := time.Now(); time.Since(start) < 30*time.Second; {
		var n int
		if n, err = r.tryCount(queue, 10*time.Second); err == nil {
			return n
		}
		time.Sleep(500 * time.Millisecond)
	}
	r.fatal("count messages in %s: %v", queue, err)
	return 0
}

// tryCount asks once for the number of ready messages in queue, within timeout.
func (r *run) tryCount(queue string, timeout time.Duration) (int, error) {
	conn, err := r.s.Dial()
	if err != nil {
		return 0, err
	}
	defer noloss.CloseConn(conn)
	watchdog := time.AfterFunc(timeout, func() { noloss.CloseConn(conn) })
	defer watchdog.Stop()
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0, err
	}
	return q.Messages, nil
}

func sum(m map[string]int) int {
	total := 0
	for _, v := range m {
		total += v
	}
	return total
}

// consumerProc is one run of the consumer program.
type consumerProc struct {
	cmd    *exec.Cmd
	ready  chan struct{} // closed when it says it is ready
	exited chan struct{}
	err    error // after exited
	killed bool
}

func (r *run) startConsumer() *consumerProc { return r.startConsumerWith(r.g.client) }

// startConsumerWith starts a consumer process under the command prefix client.
func (r *run) startConsumerWith(client []string) *consumerProc {
	r.t.Helper()
	p := r.spawnConsumer(client, r.consumerArgs)
	r.awaitReady(p)
	return p
}

// spawnConsumer starts a consumer process under the command prefix client, with more
// flags args, without waiting for it to be ready (awaitReady).
func (r *run) spawnConsumer(client, args []string) *consumerProc {
	r.t.Helper()
	logf, err := os.OpenFile(r.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		r.t.Fatal(err)
	}
	flags := []string{"-variant", r.v.Name, "-prefix", r.s.Prefix, "-sabotage", strconv.Itoa(r.sabotage)}
	if len(r.s.Nodes) > 0 {
		flags = append(flags, "-nodes", strings.Join(r.s.Nodes, ","))
	}
	flags = append(flags, args...)
	argv := append(slices.Clone(client), r.g.bin)
	cmd := exec.Command(argv[0], append(argv[1:], flags...)...)
	cmd.Env = append(os.Environ(), "AMQP_URI="+r.s.URI, fmt.Sprintf("%s=%d", noloss.MajorEnv, r.s.Major))
	cmd.Stderr = logf
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		r.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	p := &consumerProc{cmd: cmd, exited: make(chan struct{}), ready: make(chan struct{})}
	go func() {
		s := bufio.NewScanner(stdout)
		signalled := false
		for s.Scan() {
			if strings.HasPrefix(s.Text(), noloss.Ready) && !signalled {
				close(p.ready)
				signalled = true
			}
			fmt.Fprintln(logf, "stdout:", s.Text())
		}
		p.err = cmd.Wait()
		_ = logf.Close()
		close(p.exited)
	}()
	return p
}

// awaitReady waits for p to say that its handlers are subscribed.
func (r *run) awaitReady(p *consumerProc) {
	r.t.Helper()
	select {
	case <-p.ready:
	case <-p.exited:
		r.fatal("consumer exited before it was ready: %v", p.err)
	case <-time.After(time.Minute):
		p.kill()
		r.fatal("consumer not ready within a minute")
	}
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
