package noloss_test

import (
	"context"
	"fmt"
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
)

// TestPartition is the no-loss test through network partitions and bad links (issue
// 27): the harness, consumer and per-UUID accounting of TestNoLoss, on the three
// RabbitMQ 4.3 nodes of scripts/netcluster.sh, each in a network namespace of its own.
// Each variant (ttl-tiers, binary-levels and delayed-retry unless
// AMQPRETRY_NOLOSS_BACKENDS says otherwise) has two consumer processes, one in client
// namespace c1 (with nodes 1 and 2 in a split) and one in c2 (with node 3); the test's
// own connections come from namespace obs. After each batch of messages but the last,
// once retries wait, the fault starts: a quarter of the next batch is published first, so
// that hand-offs are in flight when the network breaks, and another once it is healed. The faults:
//
//  1. the node with most of the consumers' connections cut from the other two
//     (the clients still reach it: a minority node with consumers on it);
//  2. the node leading the queue where most retries wait, its link down;
//  3. a majority/minority split, {1, 2, c1, obs} | {3, c2}: clients on both sides;
//  4. a one-way partition: the consumers' node's packets to the other nodes dropped,
//     theirs to it passing;
//  5. a flapping link: that node cut from the others and healed in turn every few
//     seconds for a minute;
//  6. every link degraded: 200 ms delay and 5% loss (tc netem; where the kernel has no
//     netem, as on the CI machines, the userspace delayer internal/testsupport/netdelay
//     behind an iptables NFQUEUE rule: the same delay and loss, no reordering).
//
// A transient message whose hand-offs failed 5 times in a row (backend.HandoffAttempts)
// while its consumer's node was cut off is poisoned with reason handoff-failed, as
// the library documents: the test counts those (NOLOSS-HANDOFF-POISONED) as accounted
// for, in the poison queue with their envelope, never as lost.
//
// Each fault lasts partitionHold (the flapping one a minute), is healed, and the test
// records how soon every run records messages again after the heal and how soon the
// cluster lists its three nodes again, then waits for the cluster before the next
// batch. Every message is then accounted for (lost must be 0) and each fault's cost
// printed (NOLOSS-FAULT: duplicates, retries due during it and how late they came).
//
//	AMQPRETRY_PARTITION=1 go test -count=1 -timeout 15m -run '^TestPartition$' -v ./internal/testsupport/noloss
//
// Settings: AMQPRETRY_PARTITION_FAULTS (the faults to run, by name, comma-separated),
// AMQPRETRY_PARTITION_SABOTAGE=N (each consumer process loses N messages on purpose:
// the test must fail), AMQPRETRY_PARTITION_KEEP=1 (leave the cluster running),
// AMQPRETRY_NOLOSS_N, AMQPRETRY_NOLOSS_BACKENDS, AMQPRETRY_NOLOSS_LOGS as for
// TestNoLoss. Needs Linux and root; under CI=true it fails rather than skips.
const (
	PartitionEnv         = "AMQPRETRY_PARTITION"
	PartitionFaultsEnv   = "AMQPRETRY_PARTITION_FAULTS"
	PartitionSabotageEnv = "AMQPRETRY_PARTITION_SABOTAGE"
	PartitionKeepEnv     = "AMQPRETRY_PARTITION_KEEP"

	// partitionDefaultN: seven batches of 200 per variant, 40 of them failing each.
	partitionDefaultN = 1400
	// partitionHold is how long a partition lasts: longer than Ra's failure detection
	// (a new leader is elected on the majority side), shorter than the 60 s of
	// net_ticktime and consumer_disconnected_timeout, as a short outage is.
	partitionHold = 10 * time.Second
	flapFor       = time.Minute
	flapCut       = 3 * time.Second
	flapHealed    = 3 * time.Second
)

var partitionPlan = []fault{
	{"consumer_node_cut_from_others", cutConsumerNode},
	{"delay_queue_leader_link_down", leaderLinkDown},
	{"majority_minority_split", majoritySplit},
	{"one_way_partition", oneWay},
	{"flapping_link", flapping},
	{"degraded_links_200ms_5pct_loss", degraded},
}

func TestPartition(t *testing.T) {
	if os.Getenv(PartitionEnv) != "1" {
		t.Skipf("builds a three-node RabbitMQ 4.3 cluster in network namespaces and partitions it (minutes, root): set %s=1", PartitionEnv)
	}
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		msg := fmt.Sprintf("%s=1 needs Linux and root (network namespaces, nftables, a chroot)", PartitionEnv)
		if brokertest.CI() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	o := readOptions(t)
	o.cluster = true
	o.handoffPoisonOK = true
	if os.Getenv(NEnv) == "" {
		o.n = partitionDefaultN
	}
	if s := os.Getenv(PartitionSabotageEnv); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 0 {
			t.Fatalf("%s=%q: want a number of messages to lose", PartitionSabotageEnv, s)
		}
		o.sabotage = v
	}
	plan := partitionPlan
	if s := os.Getenv(PartitionFaultsEnv); s != "" {
		plan = nil
		for _, name := range strings.Split(s, ",") {
			i := slices.IndexFunc(partitionPlan, func(f fault) bool { return f.name == strings.TrimSpace(name) })
			if i < 0 {
				var known []string
				for _, f := range partitionPlan {
					known = append(known, f.name)
				}
				t.Fatalf("%s: unknown fault %q (known: %s)", PartitionFaultsEnv, name, strings.Join(known, ", "))
			}
			plan = append(plan, partitionPlan[i])
		}
	}

	script, err := filepath.Abs(filepath.Join("..", "..", "..", "scripts", "netcluster.sh"))
	if err != nil {
		t.Fatal(err)
	}
	c := &netCluster{script: script}
	// Registered first: a start that fails midway leaves namespaces and nodes behind.
	if os.Getenv(PartitionKeepEnv) != "1" {
		t.Cleanup(func() {
			stopped := time.Now()
			if out, err := c.exec(context.Background(), 5*time.Minute, "stop"); err != nil {
				t.Errorf("scripts/netcluster.sh stop: %v\n%s", err, out)
			}
			t.Logf("network cluster stopped in %.1f s", time.Since(stopped).Seconds())
		})
	}
	start := time.Now()
	out, err := c.exec(context.Background(), 10*time.Minute, "start")
	if err != nil {
		t.Fatalf("scripts/netcluster.sh start: %v\n%s", err, out)
	}
	t.Logf("network cluster running %.1f s after scripts/netcluster.sh start", time.Since(start).Seconds())
	if out, err = c.exec(context.Background(), time.Minute, "uris"); err != nil {
		t.Fatalf("scripts/netcluster.sh uris: %v\n%s", err, out)
	}
	c.uris = strings.Fields(string(out))
	for _, u := range c.uris {
		host := strings.TrimSuffix(strings.TrimPrefix(u, "amqp://guest:guest@"), "/")
		c.addrs = append(c.addrs, host)
	}
	if len(c.addrs) != 3 {
		t.Fatalf("scripts/netcluster.sh uris: %q, want three URIs", out)
	}
	bin := buildConsumer(t)

	var def []noloss.Variant
	for _, name := range []string{delay.TTLTiers().Name(), delay.BinaryLevels(0).Name(), delay.DelayedRetry(0).Name()} {
		v, _ := noloss.VariantNamed(name)
		def = append(def, v)
	}
	variants := o.variants(def)
	var names []string
	for _, v := range variants {
		names = append(names, v.Name)
	}
	t.Run(strings.Join(names, ","), func(t *testing.T) {
		g := newGroup(t, c, bin, o, variants)
		g.client = []string{"ip", "netns", "exec", "amqpretry-pc1"}
		g.extraClients = [][]string{{"ip", "netns", "exec", "amqpretry-pc2"}}
		// Before the runs' clean-up, which needs the cluster whole.
		t.Cleanup(func() { c.heal(context.Background()) })
		accs := g.play(plan)
		for i, r := range g.runs {
			r.faultCosts(accs[i])
		}
	})
}

// netCluster is the three nodes of scripts/netcluster.sh.
type netCluster struct {
	script string
	uris   []string
	addrs  []string // host:port of node n at n-1
}

func (c *netCluster) setup() noloss.Setup {
	return noloss.Setup{URI: c.uris[0], Nodes: c.addrs, Netns: "/run/netns/amqpretry-pobs"}
}
func (c *netCluster) nodes() int { return len(c.addrs) }

// ctl runs rabbitmqctl on the first node that answers within 90 s (list_queues asks
// every queue's leader, slow on a loaded machine).
func (c *netCluster) ctl(ctx context.Context, args ...string) ([]byte, error) {
	var out []byte
	var err error
	for n := 1; n <= 3; n++ {
		if out, err = c.exec(ctx, 90*time.Second, append([]string{"ctl", strconv.Itoa(n)}, args...)...); err == nil {
			return out, nil
		}
	}
	return out, err
}

func (c *netCluster) exec(ctx context.Context, limit time.Duration, args ...string) ([]byte, error) {
	bounded, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	cmd := exec.CommandContext(bounded, c.script, args...)
	killProcessGroup(cmd)
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil && bounded.Err() != nil {
		return out, fmt.Errorf("scripts/netcluster.sh %s: no answer within %s: %w", strings.Join(args, " "), limit, err)
	}
	return out, err
}

// heal removes every fault (bounded; errors are the caller's to see in the log).
func (c *netCluster) heal(ctx context.Context) error {
	out, err := c.exec(ctx, time.Minute, "heal")
	if err != nil {
		return fmt.Errorf("scripts/netcluster.sh heal: %w\n%s", err, out)
	}
	return nil
}

func (c *netCluster) do(g *group, args ...string) string {
	out, err := c.exec(g.ctx, 3*time.Minute, args...) // (a fault is applied in seconds, on a loaded machine in a minute)
	if err != nil {
		g.fatal("scripts/netcluster.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// nodeOfHost returns the node of address "198.18.0.N" (or a node name
// "amqpretrypN@pnN"), or 0.
func nodeOfHost(s string) int {
	if _, host, ok := strings.Cut(s, "@pn"); ok {
		s = host
	} else {
		s = strings.TrimPrefix(s, "198.18.0.")
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 3 {
		return 0
	}
	return n
}

// consumerNode returns the node with most of the consumer processes'
// connections (rabbitmqctl list_connections: the node address each reached and the
// client port, matched with the processes' own sockets), with the counts per node.
func consumerNode(g *group) (int, []int) {
	c := g.b.(*netCluster)
	ours := map[int]bool{}
	for _, r := range g.runs {
		for _, p := range append([]*consumerProc{r.consumer}, r.extra...) {
			peers, err := tcpPeers(p.cmd.Process.Pid)
			if err != nil {
				g.fatal("%s: the consumer's connections: %v", r.v.Name, err)
			}
			for local := range peers {
				ours[local] = true
			}
		}
	}
	out, err := c.ctl(g.ctx, "-q", "list_connections", "--no-table-headers", "host", "peer_port")
	if err != nil {
		g.fatal("%v\n%s", err, out)
	}
	counts := make([]int, 3)
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		port, err := strconv.Atoi(f[1])
		if n := nodeOfHost(f[0]); n > 0 && err == nil && ours[port] {
			counts[n-1]++
		}
	}
	node := 1
	for n := 2; n <= 3; n++ {
		if counts[n-1] > counts[node-1] {
			node = n
		}
	}
	if counts[node-1] == 0 {
		g.fatal("rabbitmqctl lists none of the consumers' connections (%d client ports)", len(ours))
	}
	return node, counts
}

// leaderNode returns the node leading the queue where most retries wait: a delay
// queue, or the work queue for retries RabbitMQ holds there.
func leaderNode(g *group) (int, string) {
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
	n := nodeOfHost(best.Leader)
	if n == 0 {
		g.fatal("queue %s has no leader listed: %+v", best.Name, best)
	}
	return n, fmt.Sprintf("leads=%s,waiting_there=%d", short, most)
}

// publishQuarter publishes quarter q (0 to 3) of the next batch of every run, from
// obs, each message confirmed (tries bounded to 30 s each, for up to 3 minutes: the
// cluster may still be recovering).
func publishQuarter(g *group, q int) {
	var wg sync.WaitGroup
	errs := make([]error, len(g.runs))
	for k, r := range g.runs {
		lo, hi := r.batch(g.batch+1, g.batches)
		lo, hi = lo+q*(hi-lo)/4, lo+(q+1)*(hi-lo)/4
		var idx []int
		for i := lo; i < hi; i++ {
			if !r.published[i] {
				idx = append(idx, i)
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for start := time.Now(); len(idx) > 0; {
				ctx, cancel := context.WithTimeout(g.ctx, 30*time.Second)
				pending, err := r.publishOnce(ctx, idx)
				cancel()
				for _, i := range idx {
					if !slices.Contains(pending, i) {
						r.published[i] = true
					}
				}
				idx = pending
				if len(idx) > 0 && (time.Since(start) > 3*time.Minute || g.ctx.Err() != nil) {
					errs[k] = fmt.Errorf("%d messages not confirmed: %w", len(idx), err)
					return
				}
			}
		}()
	}
	wg.Wait()
	for k, err := range errs {
		if err != nil {
			g.fatal("%s: publishing quarter %d of the next batch: %v", g.runs[k].v.Name, q+1, err)
		}
	}
}

// partition runs one fault: a quarter of the next batch published, apply (which breaks
// the network and returns a note), the fault kept for lasting (flap does its own), the
// network healed; then it publishes the next quarter and waits until every run
// records messages again and the cluster lists its three nodes, and returns the note
// with those times (records_again_after_heal counts from the heal, the publish
// included).
func partition(g *group, apply func() string, lasting time.Duration) string {
	c := g.b.(*netCluster)
	publishQuarter(g, 0) // in flight when the network breaks
	broke := time.Now()
	note := apply()
	time.Sleep(time.Until(broke.Add(lasting)))
	// Asked from obs, which no fault cuts from the majority; unknown (-1) if no node
	// answers in time: the first count after the heal is the mark then.
	before := make([]int, len(g.runs))
	for i, r := range g.runs {
		if before[i], _ = r.tryCount(r.results, 5*time.Second); before[i] == 0 {
			before[i] = -1
		}
	}
	if err := c.heal(g.ctx); err != nil {
		g.fatal("%v", err)
	}
	healed := time.Now()
	// Meanwhile, until every node lists the three again.
	var whole time.Duration
	wholeErr := make(chan error, 1)
	go func() {
		out, err := c.exec(g.ctx, 3*time.Minute, "await", "150")
		whole = time.Since(healed)
		if err != nil {
			err = fmt.Errorf("%w\n%s", err, out)
		}
		wholeErr <- err
	}()
	// Fresh work, then every run records a message again (up to 90 s): new messages
	// and the retries due meanwhile are handled.
	publishQuarter(g, 1)
	again := make([]string, len(g.runs))
	pending := len(g.runs)
	for deadline := healed.Add(90 * time.Second); pending > 0 && time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		for i, r := range g.runs {
			if again[i] != "" {
				continue
			}
			got, err := r.tryCount(r.results, 5*time.Second)
			if err == nil && before[i] < 0 {
				before[i] = got
			} else if err == nil && got > before[i] {
				again[i] = fmt.Sprintf("%.1fs", time.Since(healed).Seconds())
				pending--
			}
			r.consumer.checkAlive(r)
		}
	}
	for i := range again {
		if again[i] == "" {
			again[i] = "none"
		}
	}
	if err := <-wholeErr; err != nil {
		g.fatal("the cluster did not list its three nodes within 150 s of the heal: %v", err)
	}
	return fmt.Sprintf("%s,lasted=%.1fs,records_again_after_heal=%s,cluster_whole_after_heal=%.1fs,broke@%.1fs,healed@%.1fs",
		note, healed.Sub(broke).Seconds(), strings.Join(again, "/"), whole.Seconds(), broke.Sub(g.start).Seconds(), healed.Sub(g.start).Seconds())
}

func cutConsumerNode(g *group) string {
	c := g.b.(*netCluster)
	n, counts := consumerNode(g)
	return partition(g, func() string {
		c.do(g, "isolate", strconv.Itoa(n))
		return fmt.Sprintf("node=%d,consumer_conns_per_node=%s", n, joinInts(counts))
	}, partitionHold)
}

func leaderLinkDown(g *group) string {
	c := g.b.(*netCluster)
	n, note := leaderNode(g)
	return partition(g, func() string {
		c.do(g, "down", strconv.Itoa(n))
		return fmt.Sprintf("node=%d,%s", n, note)
	}, partitionHold)
}

func majoritySplit(g *group) string {
	c := g.b.(*netCluster)
	return partition(g, func() string {
		c.do(g, "split", "1 2 c1 obs", "3 c2")
		return "split={1,2,c1,obs}|{3,c2}"
	}, partitionHold)
}

func oneWay(g *group) string {
	c := g.b.(*netCluster)
	n, _ := consumerNode(g)
	return partition(g, func() string {
		for m := 1; m <= 3; m++ {
			if m != n {
				c.do(g, "oneway", strconv.Itoa(n), strconv.Itoa(m))
			}
		}
		return fmt.Sprintf("dropped=%d->others", n)
	}, partitionHold)
}

func flapping(g *group) string {
	c := g.b.(*netCluster)
	n, _ := consumerNode(g)
	return partition(g, func() string {
		flaps := 0
		for start := time.Now(); time.Since(start) < flapFor-flapCut; flaps++ {
			c.do(g, "isolate", strconv.Itoa(n))
			time.Sleep(flapCut)
			if err := c.heal(g.ctx); err != nil {
				g.fatal("%v", err)
			}
			time.Sleep(flapHealed)
		}
		c.do(g, "isolate", strconv.Itoa(n)) // the last cut, healed by partition
		return fmt.Sprintf("node=%d,flaps=%d,cut=%s,healed=%s", n, flaps+1, flapCut, flapHealed)
	}, flapFor)
}

func degraded(g *group) string {
	c := g.b.(*netCluster)
	return partition(g, func() string {
		applied := strings.TrimSpace(c.do(g, "degrade", "200", "5"))
		if i := strings.LastIndexByte(applied, '\n'); i >= 0 {
			applied = applied[i+1:]
		}
		return "applied=" + strings.ReplaceAll(applied, " ", "_")
	}, 2*partitionHold)
}
