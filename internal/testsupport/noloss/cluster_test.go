package noloss_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss"
	"github.com/amqpretry/amqpretry/ops"
)

// The cluster mode of the no-loss test (issue 20): the same harness, per-UUID
// accounting and consumer, on the three RabbitMQ 4.3 nodes of scripts/cluster.sh,
// which the test starts (building its chroot the first time) and stops at the end.
// The variants (ttl-tiers and binary-levels unless AMQPRETRY_NOLOSS_BACKENDS says
// otherwise) run side by side, each with its own consumer process and queues, through
// the same faults. Every connection, the consumers' (subscribers, hand-off, records)
// and the test's, goes through amqpretry.Cluster(all three nodes); work and results
// queues are quorum queues. After each batch of messages but the last, while retries
// wait, one fault:
//
//  1. rabbitmqctl close_all_connections on every node at once;
//  2. SIGKILL of the node with most of the consumers' connections (rabbitmqctl
//     list_connections, matched with the consumer processes' ports), then its restart;
//     while it is down, a topology is declared (downProbe);
//  3. SIGKILL of the node that leads the queue where most retries wait (a delay
//     queue, or the work queue for delayed retries), then its restart;
//  4. to 6. a rolling restart, one node at a time (scripts/cluster.sh restart 1, 2, 3),
//     a batch before each;
//  7. SIGKILL of two of the three nodes at once: the next batch is published while
//     they are down (nothing can be confirmed), the consumers are watched for 30 s,
//     then both nodes start again.
//
// A node killed alone stays down at least killedFor, and the test records how soon a
// consumer records messages again while it is down. Every queue a run declared must
// have a member online on each node (rabbitmqctl list_queues members online), and so
// must every queue declared while a node was down, once it is back. Then every message
// is accounted for as against one broker, and each fault's cost printed (NOLOSS-FAULT:
// the duplicates it caused, how late the retries due while it lasted came).
const (
	// ClusterEnv switches the test to the cluster: "1".
	ClusterEnv = "AMQPRETRY_NOLOSS_CLUSTER"
	// ClusterKeepEnv leaves the cluster running at the end: "1" (for repeated runs).
	ClusterKeepEnv = "AMQPRETRY_NOLOSS_CLUSTER_KEEP"
	// ClusterScriptEnv overrides the path of scripts/cluster.sh.
	ClusterScriptEnv = "AMQPRETRY_NOLOSS_CLUSTER_SCRIPT"

	// clusterDefaultN is N in the cluster: the node restarts, not the messages, take
	// the time, and 2,000 messages per variant (eight batches of 250, 50 of them
	// failing) still put dozens of retries in the delay queues at each fault and give
	// 800 timed retries per variant for the lateness figures.
	clusterDefaultN = 2000
	// killedFor is the least time a killed node stays down.
	killedFor = 5 * time.Second
	// recordsWithin is how long a consumer may take to record messages again while a
	// killed node is down: the remaining nodes elect new leaders for the killed node's
	// queues and the consumers connected to it reconnect with watermill-amqp's backoff.
	// Alone that took 6 to 13 s; beside CI's other lanes, on two cores, over a minute.
	recordsWithin = 3 * time.Minute
	// majorityLostFor is how long two of the three nodes stay down.
	majorityLostFor = 30 * time.Second
)

// clusterDefaultVariants are the variants run in the cluster unless BackendsEnv names
// others.
func clusterDefaultVariants() []noloss.Variant {
	var out []noloss.Variant
	for _, name := range []string{delay.TTLTiers().Name(), delay.BinaryLevels(0).Name()} {
		v, _ := noloss.VariantNamed(name)
		out = append(out, v)
	}
	return out
}

var clusterPlan = []fault{
	{"close_all_connections_every_node", closeAllNodes},
	{"sigkill_consumer_node_restart", killConsumerNode},
	{"sigkill_leader_restart", killLeader},
	{"rolling_restart_node_1", restartNode(1)},
	{"rolling_restart_node_2", restartNode(2)},
	{"rolling_restart_node_3", restartNode(3)},
	{"sigkill_two_of_three_nodes", majorityLost},
}

func testCluster(t *testing.T, o options) {
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		msg := fmt.Sprintf("%s=1 needs Linux and root (scripts/cluster.sh builds a chroot and runs RabbitMQ in it)", ClusterEnv)
		if brokertest.CI() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	script := os.Getenv(ClusterScriptEnv)
	if script == "" {
		script = filepath.Join("..", "..", "..", "scripts", "cluster.sh")
	}
	script, err := filepath.Abs(script)
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{script: script, down: map[int]bool{}}
	// Stopped at the end (registered first: a start that fails midway may leave nodes
	// running), unless asked to keep it.
	if os.Getenv(ClusterKeepEnv) != "1" {
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			stopped := time.Now()
			if out, err := c.exec(ctx, 5*time.Minute, "stop"); err != nil {
				t.Errorf("scripts/cluster.sh stop: %v\n%s", err, out)
			}
			t.Logf("cluster stopped in %.1f s", time.Since(stopped).Seconds())
		})
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	if out, err := c.exec(ctx, 15*time.Minute, "start"); err != nil {
		t.Fatalf("scripts/cluster.sh start: %v\n%s", err, out)
	}
	t.Logf("cluster running %.1f s after scripts/cluster.sh start", time.Since(start).Seconds())
	out, err := c.exec(ctx, time.Minute, "uris")
	if err != nil {
		t.Fatalf("scripts/cluster.sh uris: %v\n%s", err, out)
	}
	c.uris = strings.Fields(string(out))
	for _, u := range c.uris {
		pu, err := url.Parse(u)
		if err != nil {
			t.Fatalf("scripts/cluster.sh uris: %q: %v", u, err)
		}
		c.addrs = append(c.addrs, pu.Host)
	}
	if len(c.addrs) != 3 {
		t.Fatalf("scripts/cluster.sh uris: %q, want three URIs", out)
	}
	bin := buildConsumer(t)

	variants := o.variants(clusterDefaultVariants())
	var names []string
	for _, v := range variants {
		names = append(names, v.Name)
	}
	// The variants run side by side, each with its own consumer and queues, through
	// the same faults.
	t.Run(strings.Join(names, ","), func(t *testing.T) {
		g := newGroup(t, c, bin, o, variants)
		t.Cleanup(func() { c.ensureUp(t) }) // before the runs' clean-up, which needs the nodes
		accs := g.play(clusterPlan)
		for i, r := range g.runs {
			r.faultCosts(accs[i])
		}
	})
}

// cluster is the three nodes of scripts/cluster.sh.
type cluster struct {
	script string
	uris   []string
	addrs  []string // host:port of each node, node n at n-1

	mu   sync.Mutex
	down map[int]bool // nodes killed or stopped by the test
}

func (c *cluster) setup() noloss.Setup { return noloss.Setup{URI: c.uris[0], Nodes: c.addrs} }
func (c *cluster) nodes() int          { return len(c.addrs) }

// ctl runs rabbitmqctl on the first node that runs.
func (c *cluster) ctl(ctx context.Context, args ...string) ([]byte, error) {
	return c.nodeCtl(ctx, c.up()[0], args...)
}

// up lists the nodes not down, in order; node 1 if all are.
func (c *cluster) up() []int {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []int
	for n := 1; n <= len(c.addrs); n++ {
		if !c.down[n] {
			out = append(out, n)
		}
	}
	if len(out) == 0 {
		out = []int{1}
	}
	return out
}

func (c *cluster) setDown(n int, down bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.down[n] = down
}

// nodeCtl runs rabbitmqctl args against node n only, bounded (a minute; three for
// the commands that wait).
func (c *cluster) nodeCtl(ctx context.Context, n int, args ...string) ([]byte, error) {
	limit := time.Minute
	for _, a := range args {
		if a == "await_startup" || a == "stop_app" || a == "start_app" {
			limit = 3 * time.Minute
		}
	}
	return c.exec(ctx, limit, append([]string{"ctl", strconv.Itoa(n)}, args...)...)
}

// kill SIGKILLs node n (scripts/cluster.sh kill).
func (c *cluster) kill(ctx context.Context, n int) error {
	c.setDown(n, true)
	out, err := c.exec(ctx, time.Minute, "kill", strconv.Itoa(n))
	if err != nil {
		return fmt.Errorf("scripts/cluster.sh kill %d: %w\n%s", n, err, out)
	}
	return nil
}

// restart stops node n if it runs, starts it and waits until it has rejoined
// (scripts/cluster.sh restart).
func (c *cluster) restart(ctx context.Context, n int) error {
	c.setDown(n, true)
	out, err := c.exec(ctx, 6*time.Minute, "restart", strconv.Itoa(n))
	if err != nil {
		return fmt.Errorf("scripts/cluster.sh restart %d: %w\n%s", n, err, out)
	}
	c.setDown(n, false)
	return nil
}

// startAll starts every node that does not run and waits until the three run
// clustered (scripts/cluster.sh start).
func (c *cluster) startAll(ctx context.Context) error {
	out, err := c.exec(ctx, 10*time.Minute, "start")
	if err != nil {
		return fmt.Errorf("scripts/cluster.sh start: %w\n%s", err, out)
	}
	c.mu.Lock()
	c.down = map[int]bool{}
	c.mu.Unlock()
	return nil
}

// ensureUp brings back any node the test left down (a subtest that failed midway).
func (c *cluster) ensureUp(t *testing.T) {
	if len(c.up()) == len(c.addrs) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if err := c.startAll(ctx); err != nil {
		t.Errorf("bringing the cluster back: %v", err)
	}
}

// exec runs the cluster script with args, bounded by limit (and ctx), its whole
// process group killed on timeout.
func (c *cluster) exec(ctx context.Context, limit time.Duration, args ...string) ([]byte, error) {
	bounded, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	cmd := exec.CommandContext(bounded, c.script, args...)
	killProcessGroup(cmd)
	cmd.WaitDelay = 5 * time.Second
	started := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil && bounded.Err() != nil {
		return out, fmt.Errorf("scripts/cluster.sh %s: no answer within %s (%.1f s): %w", strings.Join(args, " "), limit, time.Since(started).Seconds(), err)
	}
	return out, err
}

// nodeOf returns the number of a node name ("amqpretryc2@localhost": 2), or 0.
func nodeOf(name string) int {
	s := strings.TrimPrefix(name, "amqpretryc")
	s, _, _ = strings.Cut(s, "@")
	n, err := strconv.Atoi(s)
	if err != nil {
		return 0
	}
	return n
}

func closeAllNodes(g *group) string {
	c := g.b.(*cluster)
	var wg sync.WaitGroup
	errs := make([]error, c.nodes())
	for n := 1; n <= c.nodes(); n++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := c.nodeCtl(g.ctx, n, "close_all_connections", fmt.Sprintf("amqpretry no-loss test, fault %d", len(g.faults)+1))
			if err != nil {
				errs[n-1] = fmt.Errorf("node %d: %w\n%s", n, err, out)
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		g.fatal("%v", err)
	}
	return ""
}

// killConsumerNode kills the node with most of the consumers' connections
// (amqpretry.Cluster spreads them over the nodes), then restarts it: rabbitmqctl
// list_connections lists every connection of the cluster with the port it came from
// (a consumer process's, read from /proc) and the port it reached (its node's).
func killConsumerNode(g *group) string {
	c := g.b.(*cluster)
	ports := map[int]int{}
	for _, r := range g.runs {
		p, err := tcpPeers(r.consumer.cmd.Process.Pid)
		if err != nil {
			g.fatal("%s: the consumer's connections: %v", r.v.Name, err)
		}
		for local, remote := range p {
			ports[local] = remote
		}
	}
	out, err := c.ctl(g.ctx, "-q", "list_connections", "--no-table-headers", "peer_port", "port")
	if err != nil {
		g.fatal("%v\n%s", err, out)
	}
	counts := make([]int, c.nodes())
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		peer, err1 := strconv.Atoi(f[0])
		port, err2 := strconv.Atoi(f[1])
		if remote, ours := ports[peer]; !ours || remote != port || err1 != nil || err2 != nil {
			continue
		}
		for n, addr := range c.addrs {
			if strings.HasSuffix(addr, ":"+strconv.Itoa(port)) {
				counts[n]++
			}
		}
	}
	node := 1
	for n := 2; n <= c.nodes(); n++ {
		if counts[n-1] > counts[node-1] {
			node = n
		}
	}
	if counts[node-1] == 0 {
		g.fatal("rabbitmqctl lists none of the consumers' %d connections (their ports -> node ports: %v)", len(ports), ports)
	}
	return g.killAndRestart(node, fmt.Sprintf("node=%d,consumer_conns_per_node=%s", node, joinInts(counts)), true)
}

// killLeader kills the node that leads the queue where most retries wait (a delay
// queue; the work queue for retries RabbitMQ holds there), then restarts it.
func killLeader(g *group) string {
	all := listAll(g)
	var best queueStats
	most, short := -1, ""
	for _, r := range g.runs {
		qs := r.mine(all)
		candidates := slices.Clone(r.delayQueues)
		if r.v.HoldsRetries() {
			candidates = append(candidates, r.work)
		}
		for _, q := range candidates {
			w := qs[q].Messages
			if q == r.work {
				w = qs[q].aside()
			}
			if w > most {
				best, most, short = qs[q], w, r.v.Name+strings.TrimPrefix(q, r.s.Prefix)
			}
		}
	}
	node := nodeOf(best.Leader)
	if node == 0 {
		g.fatal("queue %s has no leader listed: %+v", best.Name, best)
	}
	return g.killAndRestart(node, fmt.Sprintf("node=%d,leads=%s,waiting_there=%d", node, short, most), false)
}

// killAndRestart SIGKILLs node n, waits until a consumer records messages again
// (while the node is down: they work on the other two) and at least killedFor, then
// restarts the node. With probe, it also declares a topology while the node is down
// (see downProbe). It returns the fault's note.
func (g *group) killAndRestart(n int, note string, probe bool) string {
	c := g.b.(*cluster)
	if err := c.kill(g.ctx, n); err != nil {
		g.fatal("%v", err)
	}
	killed := time.Now()
	var p *downProbe
	if probe {
		p = startProbe(g, n)
	}
	before := make([]int, len(g.runs))
	for i, r := range g.runs {
		before[i] = r.count(r.results)
	}
	again := "none"
	for deadline := killed.Add(recordsWithin); again == "none" && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		for i, r := range g.runs {
			if got, err := r.tryCount(r.results, 5*time.Second); err == nil && got > before[i] {
				again = fmt.Sprintf("%.1fs", time.Since(killed).Seconds())
				break
			}
			r.consumer.checkAlive(r)
		}
	}
	if again == "none" {
		g.t.Errorf("no message recorded within %v of killing node %d: the consumers do not work on the other two nodes", recordsWithin, n)
	}
	time.Sleep(time.Until(killed.Add(killedFor)))
	restarting := time.Now()
	if err := c.restart(g.ctx, n); err != nil {
		g.fatal("%v", err)
	}
	note = fmt.Sprintf("%s,records_while_down_after=%s,down=%.1fs,restart=%.1fs,killed@%.1fs,back@%.1fs", note, again, time.Since(killed).Seconds(),
		time.Since(restarting).Seconds(), killed.Sub(g.start).Seconds(), g.elapsed())
	if p != nil {
		p.finish(g)
	}
	return note
}

func restartNode(n int) func(g *group) string {
	return func(g *group) string {
		c := g.b.(*cluster)
		started := time.Now()
		if err := c.restart(g.ctx, n); err != nil {
			g.fatal("%v", err)
		}
		return fmt.Sprintf("node=%d,restart=%.1fs", n, time.Since(started).Seconds())
	}
}

// majorityLost kills two of the three nodes at once (a majority: no quorum queue and
// no metadata change can commit), publishes the next batch of each run meanwhile (it
// is not confirmed; play publishes what was not once the nodes are back), watches the
// consumers for majorityLostFor, then starts the two nodes again.
func majorityLost(g *group) string {
	c := g.b.(*cluster)
	killed := time.Now()
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for k, n := range []int{2, 3} {
		wg.Add(1)
		go func() { defer wg.Done(); errs[k] = c.kill(g.ctx, n) }()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		g.fatal("%v", err)
	}
	g.t.Logf("two of three nodes killed in %.1f s", time.Since(killed).Seconds())
	// The next batch of every run, each publish bounded: not one should be confirmed.
	confirmed, sent := 0, 0
	var perrs []string
	var mu sync.Mutex
	for _, r := range g.runs {
		lo, hi := r.batch(g.batch+1, g.batches)
		var idx []int
		for i := lo; i < hi; i++ {
			idx = append(idx, i)
		}
		sent += len(idx)
		wg.Add(1)
		go func() {
			defer wg.Done()
			pctx, cancel := context.WithTimeout(g.ctx, 20*time.Second)
			defer cancel()
			pending, err := r.publishOnce(pctx, idx)
			mu.Lock()
			defer mu.Unlock()
			for _, i := range idx {
				if !slices.Contains(pending, i) {
					r.published[i] = true
					confirmed++
				}
			}
			if err != nil {
				perrs = append(perrs, err.Error())
			}
		}()
	}
	wg.Wait()
	g.t.Logf("two of three nodes down: %d of %d publishes confirmed within 20 s %v", confirmed, sent, perrs)
	// What the consumers record while the majority is gone, asked through node 1 (the
	// count may not be had: no leader answers).
	before := make([]int, len(g.runs))
	for i, r := range g.runs {
		before[i] = -1
		if got, err := r.tryCount(r.results, 5*time.Second); err == nil {
			before[i] = got
		}
	}
	var during []string
	for time.Since(killed) < majorityLostFor {
		during = during[:0]
		for i, r := range g.runs {
			got, err := r.tryCount(r.results, 5*time.Second)
			switch {
			case err != nil:
				during = append(during, "unknown("+firstWords(err.Error(), 6)+")")
			case before[i] < 0:
				during = append(during, "unknown")
			default:
				during = append(during, strconv.Itoa(got-before[i]))
			}
			r.consumer.checkAlive(r)
		}
		time.Sleep(time.Second)
	}
	down := time.Since(killed)
	starting := time.Now()
	if err := c.startAll(g.ctx); err != nil {
		g.fatal("%v", err)
	}
	back := time.Since(starting)
	return fmt.Sprintf("killed=2+3,publishes_confirmed_while_down=%d/%d,results_while_down=%s,down=%.1fs,nodes_back_after=%.1fs,killed@%.1fs,back@%.1fs",
		confirmed, sent, strings.Join(during, "+"), down.Seconds(), back.Seconds(), killed.Sub(g.start).Seconds(), g.elapsed())
}

// firstWords returns the first n words of s, joined by '_' (for a fault's note).
func firstWords(s string, n int) string {
	f := strings.Fields(s)
	return strings.Join(f[:min(n, len(f))], "_")
}

// checkReplication fails the run unless every queue it declared is a quorum queue
// with a member online on every node, as the broker lists them.
func (r *run) checkReplication() {
	qs := r.listQueues()
	var detail []string
	full := 0
	for _, name := range r.allQueues {
		q, ok := qs[name]
		if !ok {
			r.t.Errorf("queue %s not listed by rabbitmqctl list_queues", name)
			continue
		}
		short := strings.TrimPrefix(name, r.s.Prefix)
		detail = append(detail, fmt.Sprintf("%s:%s:%d/%d", short, q.Type, len(q.Online), len(q.Members)))
		switch {
		case q.Type != "quorum":
			r.t.Errorf("queue %s is a %s queue: not replicated", name, q.Type)
		case len(q.Members) != r.b.nodes() || len(q.Online) != r.b.nodes():
			r.t.Errorf("quorum queue %s has members %v, online %v: want one on each of the %d nodes", name, q.Members, q.Online, r.b.nodes())
		default:
			full++
		}
	}
	fmt.Printf("NOLOSS-REPLICATION backend=%s queues=%d on_every_node=%d detail=%s\n", r.v.Name, len(r.allQueues), full, strings.Join(detail, ","))
}

// faultCosts prints, for each fault, the duplicates it caused (a record beyond a
// message's first, counted against the last fault started before it arrived) and the
// lateness of the retries due while it lasted (or within 5 s after), beside the
// lateness of the retries due outside any fault.
func (r *run) faultCosts(acc *account) {
	type cost struct {
		dups, due int
		late      time.Duration
		worst     hop // the latest retry
	}
	costs := make([]cost, len(r.faults()))
	inWindow := func(at time.Time) int {
		for i, f := range r.faults() {
			if !at.Before(f.start) && !at.After(f.end.Add(5*time.Second)) {
				return i
			}
		}
		return -1
	}
	lastBefore := func(at time.Time) int {
		i := -1
		for k, f := range r.faults() {
			if !f.start.After(at) {
				i = k
			}
		}
		return i
	}
	var baseline []time.Duration
	unattributed := 0
	var csv strings.Builder // every timed retry, for LogsEnv
	csv.WriteString("uuid,hop,due_s,arrived_s,late_ms\n")
	for id, recs := range acc.handled {
		recs = slices.Clone(recs)
		slices.SortFunc(recs, func(a, b record) int { return a.arrived.Compare(b.arrived) })
		for k, h := range recs[0].retries() {
			fmt.Fprintf(&csv, "%s,%d,%.3f,%.3f,%d\n", id, k, h.arrived.Add(-h.late).Sub(r.g.start).Seconds(), h.arrived.Sub(r.g.start).Seconds(), h.late.Milliseconds())
		}
		for _, h := range recs[0].retries() {
			if i := inWindow(h.arrived.Add(-h.late)); i >= 0 {
				costs[i].due++
				if h.late > costs[i].late {
					costs[i].late, costs[i].worst = h.late, h
				}
			} else {
				baseline = append(baseline, h.late)
			}
		}
		for _, extra := range recs[1:] {
			if i := lastBefore(extra.arrived); i >= 0 {
				costs[i].dups++
			} else {
				unattributed++
			}
		}
	}
	slices.Sort(baseline)
	worst, worstFault := time.Duration(0), ""
	for i, f := range r.faults() {
		c := costs[i]
		when := ""
		if c.due > 0 {
			when = fmt.Sprintf(" (due@%.1fs,arrived@%.1fs)", c.worst.arrived.Add(-c.worst.late).Sub(r.g.start).Seconds(), c.worst.arrived.Sub(r.g.start).Seconds())
		}
		fmt.Printf("NOLOSS-FAULT backend=%s fault=%s at=%.1fs took=%.1fs waiting=%d duplicates=%d retries_due=%d late_max_ms=%d%s %s\n",
			r.v.Name, f.name, f.start.Sub(r.g.start).Seconds(), f.end.Sub(f.start).Seconds(), f.waiting[r.idx], c.dups, c.due, c.late.Milliseconds(), when, f.note)
		if c.late > worst {
			worst, worstFault = c.late, f.name
		}
	}
	if dir := os.Getenv(LogsEnv); dir != "" {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("%s.v%d.%s.retries.csv", r.v.Name, r.s.Major, r.s.Prefix)), []byte(csv.String()), 0o644); err != nil {
			r.t.Logf("%s: %v", LogsEnv, err)
		}
	}
	poisonDups := 0
	for _, reasons := range acc.poisoned {
		poisonDups += max(len(reasons)-1, 0)
	}
	fmt.Printf("NOLOSS-LATENESS backend=%s baseline_retries=%d baseline_p50_ms=%d baseline_p99_ms=%d baseline_max_ms=%d failover_max_ms=%d failover_fault=%s duplicates_before_any_fault=%d poison_duplicates=%d\n",
		r.v.Name, len(baseline), pct(baseline, 50), pct(baseline, 99), pct(baseline, 100), worst.Milliseconds(), worstFault, unattributed, poisonDups)
}

// downProbe is a topology declared while a node is down (New with a prefix of its
// own, and a quorum work queue as a subscriber declares one): how many members its
// quorum queues get then, and whether every one has a member online on each node once
// the node is back.
type downProbe struct {
	s         noloss.Setup
	node      int
	queues    []string
	whileDown string
	flagged   []string // ops.Status's under-replicated queues while the node was down
	declared  time.Duration
}

func startProbe(g *group, node int) *downProbe {
	t := g.t
	c := g.b.(*cluster)
	v, _ := noloss.VariantNamed(delay.TTLTiers().Name())
	s := c.setup()
	s.Variant, s.Major, s.Prefix = v, g.o.major, brokertest.Prefix(t)+".probe"
	p := &downProbe{s: s, node: node}
	work := noloss.WorkQueue(s.Prefix)
	plan, err := s.Config().Plan(work)
	if err != nil {
		g.fatal("%v", err)
	}
	p.queues = []string{work}
	for _, q := range plan.Queues {
		if !slices.Contains(p.queues, q.Name) {
			p.queues = append(p.queues, q.Name)
		}
	}
	t.Cleanup(func() {
		conn, err := s.Dial()
		if err != nil {
			t.Logf("clean-up: %v", err)
			return
		}
		defer noloss.CloseConn(conn)
		for _, q := range p.queues {
			if ch, err := conn.Channel(); err == nil {
				_, _ = ch.QueueDelete(q, false, false, false)
				_ = ch.Close()
			}
		}
		for _, e := range plan.Exchanges {
			if ch, err := conn.Channel(); err == nil {
				_ = ch.ExchangeDelete(e.Name, false, false)
				_ = ch.Close()
			}
		}
	})
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		retry, err := noloss.New(s)
		if err == nil {
			err = retry.Close()
		}
		if err == nil {
			err = declareQuorum(s, work)
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			g.fatal("declaring a topology with node %d down: %v", node, err)
		}
	case <-time.After(2 * time.Minute):
		g.fatal("declaring a topology with node %d down: no answer within 2 minutes", node)
	}
	p.declared = time.Since(start)
	p.whileDown, _ = p.members(g)
	// Every queue has a member on the down node: status flags each one (issue 20).
	p.flagged = p.underReplicated(g)
	if len(p.flagged) != len(p.queues) {
		g.t.Errorf("with node %d down, status flags %d queues under-replicated, want all %d of the probe's: %v (members: %s)", node, len(p.flagged), len(p.queues), p.flagged, p.whileDown)
	}
	return p
}

// underReplicated runs ops.Status (what `amqpretry status` runs) on the probe's
// topology, with the broker's counts as rabbitmqctl lists them, and returns the queues
// it flags under-replicated, with their members online.
func (p *downProbe) underReplicated(g *group) []string {
	o, err := ops.New(ops.Config{URI: p.s.URI, AMQP: *p.s.AMQPConfig(), Retry: p.s.Config()})
	if err != nil {
		g.fatal("ops: %v", err)
	}
	defer o.Close()
	counts := func(context.Context) (ops.BrokerCounts, error) {
		c := ops.BrokerCounts{Messages: map[string]int{}, Ready: map[string]int{}, Unacked: map[string]int{}, Members: map[string]int{}, Online: map[string]int{}}
		for _, q := range listAll(g) {
			c.Messages[q.Name], c.Ready[q.Name], c.Unacked[q.Name] = q.Messages, q.Ready, q.Unacked
			if q.Type == "quorum" {
				c.Members[q.Name], c.Online[q.Name] = len(q.Members), len(q.Online)
			}
		}
		return c, nil
	}
	s, err := o.Status(g.ctx, ops.StatusOptions{WorkQueues: []string{noloss.WorkQueue(p.s.Prefix)}, Peek: "never", Counts: counts})
	if err != nil {
		g.fatal("status: %v", err)
	}
	var flagged []string
	for _, f := range s.Flags {
		if f.Kind == ops.FlagUnderReplicated {
			flagged = append(flagged, fmt.Sprintf("%s:%d/%d", strings.TrimPrefix(f.Name, p.s.Prefix), f.Count, f.Limit))
		}
	}
	return flagged
}

// members describes the members of the probe's queues, and tells whether each has a
// member online on every node.
func (p *downProbe) members(g *group) (string, bool) {
	all := listAll(g)
	byName := map[string]queueStats{}
	for _, q := range all {
		byName[q.Name] = q
	}
	var parts []string
	full := true
	for _, name := range p.queues {
		q := byName[name]
		parts = append(parts, fmt.Sprintf("%s:members=%d,online=%d", strings.TrimPrefix(name, p.s.Prefix), len(q.Members), len(q.Online)))
		full = full && len(q.Members) == g.b.nodes() && len(q.Online) == g.b.nodes()
	}
	return strings.Join(parts, " "), full
}

// finish, once the node is back, waits up to two minutes for every queue of the probe
// to have a member online on each node, prints what it found and fails the test if
// one has not.
func (p *downProbe) finish(g *group) {
	start := time.Now()
	var after string
	full := false
	for deadline := start.Add(2 * time.Minute); !full && time.Now().Before(deadline); {
		if after, full = p.members(g); !full {
			time.Sleep(2 * time.Second)
		}
	}
	var flaggedAfter []string
	if full {
		flaggedAfter = p.underReplicated(g)
	}
	fmt.Printf("NOLOSS-REPLICATION-DOWN node_down=%d declared_in=%.1fs while_down=%q status_flagged_while_down=%q after_restart=%q full=%t seconds_after_restart=%.1f status_flagged_after=%q\n",
		p.node, p.declared.Seconds(), p.whileDown, strings.Join(p.flagged, " "), after, full, time.Since(start).Seconds(), strings.Join(flaggedAfter, " "))
	if !full {
		g.t.Errorf("queues declared while node %d was down do not have a member online on every node two minutes after it came back: %s", p.node, after)
	}
	if len(flaggedAfter) > 0 {
		g.t.Errorf("with every member online again, status still flags %v under-replicated", flaggedAfter)
	}
}

// declareQuorum declares queue as a quorum queue, as the consumer's subscriber does.
func declareQuorum(s noloss.Setup, queue string) error {
	conn, err := s.Dial()
	if err != nil {
		return err
	}
	defer noloss.CloseConn(conn)
	ch, err := conn.Channel()
	if err == nil {
		_, err = ch.QueueDeclare(queue, true, false, false, false, s.QueueArgs())
	}
	return err
}

// tcpPeers returns the established TCP connections of process pid: its local port ->
// the remote port.
func tcpPeers(pid int) (map[int]int, error) {
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return nil, err
	}
	inodes := map[string]bool{}
	for _, fd := range fds {
		link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if err == nil && strings.HasPrefix(link, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")] = true
		}
	}
	out := map[int]int{}
	for _, file := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, file))
		if err != nil {
			continue
		}
		for _, line := range bytes.Split(b, []byte("\n"))[1:] {
			f := strings.Fields(string(line))
			if len(f) < 10 || f[3] != "01" || !inodes[f[9]] { // 01: established
				continue
			}
			local, lok := hexPort(f[1])
			remote, rok := hexPort(f[2])
			if lok && rok {
				out[local] = remote
			}
		}
	}
	return out, nil
}

// hexPort reads the port of a /proc/net/tcp address ("0100007F:1F90").
func hexPort(addr string) (int, bool) {
	_, port, ok := strings.Cut(addr, ":")
	if !ok {
		return 0, false
	}
	p, err := strconv.ParseInt(port, 16, 32)
	return int(p), err == nil
}

func joinInts(v []int) string {
	var s []string
	for _, x := range v {
		s = append(s, strconv.Itoa(x))
	}
	return strings.Join(s, "/")
}
