package noloss_test

import (
	"fmt"
	"hash/fnv"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss/fates"
)

// The order partitions (docs/ordering.md, "Partitions: sharing the work").
const (
	partitions      = 6  // work queues, each with a single active consumer
	partitionProcs  = 3  // consumer processes, each subscribed to every partition
	partitionKeys   = 40 // a projection's keys (accounts)
	partitionEvents = 50 // events per key
)

// partitionOf is the partition of key among n, picked by the publisher: the hash of
// docs/ordering.md.
func partitionOf(key string, n int) int {
	h := fnv.New32a()
	h.Write([]byte(key))
	return int(h.Sum32() % uint32(n))
}

// TestOrderPartitions shares a projection's keys among partition work queues, as
// docs/ordering.md says to: 40 keys, each always published to the same one of 6 work
// queues (the publisher's hash), each queue with a single active consumer, and 3
// consumer processes each subscribed to all 6 (the ttl-tiers+ordered variant's
// configuration, Config.OrderKey). 30 events per key, one in ten failing once. Half the
// events are published; once keys are blocked on the queues of the process that is
// their active consumer on the most queues, that process is killed (SIGKILL), and
// the others take its queues over while their keys are blocked; then the rest is
// published. Every event must be handled (nothing lost, nothing poisoned), every key's
// events for the first time in exactly the order they were published (a duplicate,
// an event handled again, is counted, not failed), and every key released at the end.
// It prints a NOLOSS line (scenario=partitions) and a NOLOSS-PARTITIONS line: which
// process was active on each queue before the kill, and how soon another one handled
// each queue of the killed process.
//
//	AMQPRETRY_NOLOSS=1 go test -count=1 -timeout 15m -run '^TestOrderPartitions$' -v ./internal/testsupport/noloss
//
// It disturbs no broker: only its own consumer processes are killed.
func TestOrderPartitions(t *testing.T) {
	if os.Getenv(EnableEnv) != "1" {
		t.Skipf("takes a minute or two: set %s=1", EnableEnv)
	}
	o := readOptions(t)
	if o.cluster {
		t.Skipf("runs against one broker (AMQP_URI), not the cluster of %s", ClusterEnv)
	}
	brokertest.Dial(t) // fails under CI=true when no broker answers
	bin := buildConsumer(t)
	v, ok := noloss.VariantNamed(delay.TTLTiers().Name() + "+ordered")
	if !ok {
		t.Fatal("no ttl-tiers+ordered variant")
	}
	g := newGroup(t, single{}, bin, o, nil)
	r := newPartitionRun(g, v)
	g.runs = append(g.runs, r)
	g.start = time.Now()

	// Each process subscribes to the queues in its own order, and the three start at
	// once: which one becomes a queue's active consumer is the broker's pick.
	procs := make([]*consumerProc, partitionProcs)
	for i := range procs {
		order := slices.Concat(r.works[2*i:], r.works[:2*i])
		procs[i] = r.spawnConsumer(nil, []string{"-queues", strings.Join(order, ","), "-handlers", "1"})
		t.Cleanup(procs[i].kill)
	}
	for _, p := range procs {
		r.awaitReady(p)
	}
	pids := map[int]*consumerProc{}
	for _, p := range procs {
		pids[p.cmd.Process.Pid] = p
	}

	half := partitionEvents / 2 * partitionKeys
	if err := r.publish(0, half); err != nil {
		r.fatal("publish the first half: %v", err)
	}
	r.acc = newAccount()
	victim, active, blocked := r.pickVictim(pids)
	killedAt := time.Now()
	pids[victim].kill()
	g.faults = append(g.faults, faultRecord{name: "sigkill_active_consumer", start: killedAt, end: time.Now(),
		waiting: []int{r.waitingNow()}, blocked: []blockedCount{blocked}, note: fmt.Sprintf("pid %d", victim)})
	t.Logf("at %.1f s: SIGKILL of consumer pid %d, the active consumer of %d queues (%v), %d of their keys blocked with %d messages behind them; active consumers: %s",
		killedAt.Sub(g.start).Seconds(), victim, len(queuesOf(active, victim)), queuesOf(active, victim), blocked.keys, blocked.behind, activeList(active, r.works))
	// The survivors are watched as the run's consumers from here on.
	var alive []*consumerProc
	for _, p := range procs {
		if p != pids[victim] {
			alive = append(alive, p)
		}
	}
	r.consumer, r.extra = alive[0], alive[1:]
	if err := r.publish(half, r.n); err != nil {
		r.fatal("publish the second half: %v", err)
	}
	acc := r.finish()

	// How soon another process handled each queue the killed one was active on.
	var takeover []string
	for _, q := range queuesOf(active, victim) {
		first := time.Time{}
		for _, recs := range acc.handled {
			for _, rec := range recs {
				if rec.queue == q && rec.pid != victim && rec.handled.After(killedAt) && (first.IsZero() || rec.handled.Before(first)) {
					first = rec.handled
				}
			}
		}
		if first.IsZero() {
			t.Errorf("no other process handled a message of %s after pid %d, its active consumer, was killed", q, victim)
			continue
		}
		takeover = append(takeover, fmt.Sprintf("%s:%.1fs", q[strings.LastIndexByte(q, '.')+1:], first.Sub(killedAt).Seconds()))
	}
	byPid := map[int]int{}
	for _, recs := range acc.handled {
		byPid[earliest(recs).pid]++
	}
	var handledBy []string
	for _, pid := range slices.Sorted(maps.Keys(byPid)) {
		handledBy = append(handledBy, fmt.Sprintf("%d:%d", pid, byPid[pid]))
	}
	fmt.Printf("NOLOSS-PARTITIONS rabbitmq=%s partitions=%d consumers=%d keys=%d n=%d killed_pid=%d active_before=%s blocked_keys_at_kill=%d takeover=%s handled_by=%s\n",
		r.version, partitions, partitionProcs, partitionKeys, r.n, victim, activeList(active, r.works), blocked.keys, strings.Join(takeover, ","), strings.Join(handledBy, ","))
}

// newPartitionRun prepares the partitions' run: its 6 work queues, the retry topology
// of each, its results queue, and the events, numbered so that event i is event
// i/partitionKeys+1 of key i%partitionKeys (published in the order of i: each key's
// in order).
func newPartitionRun(g *group, v noloss.Variant) *run {
	t := g.t
	t.Helper()
	s := g.b.setup()
	s.Variant, s.Major, s.Prefix = v, g.o.major, brokertest.Prefix(t)
	r := &run{g: g, t: t, ctx: g.ctx, b: g.b, s: s, v: v, n: partitionKeys * partitionEvents, published: map[int]bool{}, scenario: "partitions"}
	r.results = noloss.ResultsQueue(s.Prefix)
	for p := range partitions {
		r.works = append(r.works, fmt.Sprintf("%s.%d", noloss.WorkQueue(s.Prefix), p))
	}
	r.work = r.works[0]
	r.queueOf = func(i int) string { return r.works[partitionOf(r.keyOf(i), partitions)] }
	r.orderKeys(partitionKeys)
	r.logPath = filepath.Join(t.TempDir(), "consumers.log")
	if dir := os.Getenv(LogsEnv); dir != "" {
		t.Cleanup(func() {
			b, err := os.ReadFile(r.logPath)
			if err == nil {
				err = os.WriteFile(filepath.Join(dir, fmt.Sprintf("partitions.%s.log", s.Prefix)), b, 0o644)
			}
			if err != nil {
				t.Logf("%s: %v", LogsEnv, err)
			}
		})
	}

	cfg := s.Config()
	r.poison = cfg.WithDefaults().PoisonQueue
	r.allQueues = append(slices.Clone(r.works), r.results, r.poison)
	for _, w := range r.works {
		plan, err := cfg.Plan(w)
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range plan.Queues {
			if slices.Contains(r.allQueues, q.Name) {
				continue
			}
			r.allQueues = append(r.allQueues, q.Name)
			r.delayQueues = append(r.delayQueues, q.Name)
		}
		for _, e := range plan.Exchanges {
			if !slices.Contains(r.exchanges, e.Name) {
				r.exchanges = append(r.exchanges, e.Name)
			}
		}
	}
	t.Cleanup(r.deleteAll)
	retry, err := noloss.New(s)
	if err != nil {
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
		r.fates[id] = fates.OK
		if (i/partitionKeys+i%partitionKeys)%10 == 3 { // one event in ten of each key
			r.fates[id] = fates.Once
		}
	}
	return r
}

// pickVictim drains the records so far into r.acc and returns the process to kill:
// the one that handled the latest message of the most queues (their active consumer
// now), as soon as at least one of the keys of those queues is blocked (a passive
// declaration of each behind queue: milliseconds); with which process is active on
// each queue, and the victim's blocked keys.
func (r *run) pickVictim(pids map[int]*consumerProc) (victim int, active map[string]int, blocked blockedCount) {
	deadline := time.Now().Add(time.Minute)
	for {
		r.drain(r.acc)
		active = map[string]int{}
		latest := map[string]time.Time{}
		for _, recs := range r.acc.handled {
			for _, rec := range recs {
				if _, ok := pids[rec.pid]; ok && rec.handled.After(latest[rec.queue]) {
					latest[rec.queue], active[rec.queue] = rec.handled, rec.pid
				}
			}
		}
		count := map[int]int{}
		for _, pid := range active {
			count[pid]++
		}
		for pid, c := range count {
			if victim == 0 || c > count[victim] || c == count[victim] && pid < victim {
				victim = pid
			}
		}
		if victim != 0 {
			blocked = blockedCount{}
			for k, q := range r.behind {
				if active[r.queueOf(k)] != victim {
					continue
				}
				if n, err := r.tryCount(q, 10*time.Second); err == nil {
					blocked.keys++
					blocked.behind += n
				}
			}
			if blocked.keys > 0 {
				return victim, active, blocked
			}
		}
		if time.Now().After(deadline) || r.ctx.Err() != nil {
			r.fatal("a minute after the first half was published: %d records, active consumers %v, no key blocked on the queues of one of them", len(r.acc.handled), active)
		}
		for _, p := range pids {
			p.checkAlive(r)
		}
		victim = 0
	}
}

// queuesOf lists the queues whose active consumer is pid.
func queuesOf(active map[string]int, pid int) []string {
	var out []string
	for q, p := range active {
		if p == pid {
			out = append(out, q)
		}
	}
	slices.Sort(out)
	return out
}

// activeList is "0:pid,1:pid,...": the active consumer of each work queue, by its
// number ("-" for a queue nothing was handled from yet).
func activeList(active map[string]int, works []string) string {
	var out []string
	for i, q := range works {
		pid := "-"
		if p, ok := active[q]; ok {
			pid = fmt.Sprint(p)
		}
		out = append(out, fmt.Sprintf("%d:%s", i, pid))
	}
	return strings.Join(out, ",")
}
