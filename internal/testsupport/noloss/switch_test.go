package noloss_test

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/topology"
)

// switchDefaultN is N for TestNoLossSwitch unless NEnv says otherwise: five batches of
// 200, 40 of them failing, put dozens of retries in the old storage at each change.
const switchDefaultN = 1000

// inFlight is how many messages of the next batch are published at a change, just
// before the consumer is stopped.
const inFlight = 40

// switchStage is one configuration of a run that changes backends.
type switchStage struct {
	backend delay.Backend
	prefix  string          // Config.Prefix is the run's prefix, then "." and this; "": the run's
	tiers   []time.Duration // ttl-tiers; nil: the policy's delays (1s, 2s)
	levels  int             // binary-levels; 0: noloss.Setup.Levels (3)
}

func (st switchStage) String() string {
	s := st.backend.Name()
	if st.prefix != "" {
		s += "@" + st.prefix
	}
	if st.tiers != nil {
		var ts []string
		for _, d := range st.tiers {
			ts = append(ts, d.String())
		}
		s += "[" + strings.Join(ts, ",") + "]"
	}
	if st.levels != 0 {
		s += "[levels=" + strconv.Itoa(st.levels) + "]"
	}
	return s
}

// The configurations a run goes through, the first one under the run's own prefix with
// the defaults of the no-loss test. Copying backends (every broker): to another
// backend under the same prefix, to other tiers under the same prefix (new tier
// queues next to the old ones on one delay exchange), to another prefix with other
// levels, then to another backend under that prefix.
var copyingSwitches = []switchStage{
	{backend: delay.TTLTiers()},
	{backend: delay.BinaryLevels(0)},
	{backend: delay.TTLTiers(), tiers: []time.Duration{1200 * time.Millisecond, 2500 * time.Millisecond}},
	{backend: delay.BinaryLevels(0), prefix: "b", levels: 4},
	{backend: delay.TTLTiers(), prefix: "b"},
}

// delayedRetrySwitches (RabbitMQ 4.3): to and from delayed-retry, twice. The work queue
// is a quorum queue from the start, declared without the delayed-retry arguments
// (queue arguments cannot change): before the first switch to delayed-retry the test
// applies the policy the library's error names (docs/switching-backends.md), and the
// delayed-retry configurations run in topology mode verify. The policy stays while
// the copying configurations run: the work queue keeps the retries it holds.
// (The test applies it at the start, as an operator may ahead of a switch: rabbitmqctl
// takes seconds, in which the retries waiting for the change would come back.)
var delayedRetrySwitches = []switchStage{
	{backend: delay.TTLTiers()},
	{backend: delay.DelayedRetry(0)},
	{backend: delay.BinaryLevels(0)},
	{backend: delay.DelayedRetry(0)},
	{backend: delay.TTLTiers(), prefix: "b", tiers: []time.Duration{1200 * time.Millisecond, 2500 * time.Millisecond}},
}

// TestNoLossSwitch changes backends while retries wait, as an operator would: each
// change publishes the next batch, stops the consumer while it works on it (SIGTERM,
// or SIGKILL every other change: deliveries in flight), and starts a consumer with the
// next configuration, while retries of the last batch wait in the old storage. The old
// storage keeps delivering to the work queue until it is empty (its delivery exchange
// and its binding to the work queue stay), and the test accounts for every message as
// TestNoLoss does: 0 lost, every queue of every configuration empty at the end. It
// prints a NOLOSS line with the duplicates and, per change, how late the retries due
// while it ran came back (NOLOSS-SWITCH). It disturbs nothing but its own consumer:
// no AMQPRETRY_BROKER_RESTART needed. Runs copyingSwitches on every broker, and
// delayedRetrySwitches on RabbitMQ 4.3 and later.
func TestNoLossSwitch(t *testing.T) {
	if os.Getenv(EnableEnv) != "1" {
		t.Skipf("takes minutes: set %s=1", EnableEnv)
	}
	o := readOptions(t)
	if o.cluster {
		t.Skip("changes backends on the broker at AMQP_URI only")
	}
	if os.Getenv(NEnv) == "" {
		o.n = switchDefaultN
	}
	if _, err := exec.LookPath(brokertest.CtlCommand()[0]); err != nil {
		msg := fmt.Sprintf("needs rabbitmqctl for the broker under test (%s): %v", brokertest.CtlEnv, err)
		if brokertest.CI() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	v, _ := brokertest.Dial(t).Properties["version"].(string)
	bin := buildConsumer(t)
	t.Run("copying", func(t *testing.T) { playSwitches(t, bin, o, copyingSwitches) })
	if version.DelayedRetry(v) {
		t.Run("delayed-retry", func(t *testing.T) { playSwitches(t, bin, o, delayedRetrySwitches) })
	} else {
		t.Logf("RabbitMQ %s: no switch to and from delayed-retry (it needs 4.3)", v)
	}
}

func playSwitches(t *testing.T, bin string, o options, stages []switchStage) {
	first, _ := noloss.VariantNamed(stages[0].backend.Name())
	g := newGroup(t, single{}, bin, o, []noloss.Variant{first})
	r := g.runs[0]
	var names []string
	quorum := false
	for _, st := range stages {
		names = append(names, st.String())
		quorum = quorum || st.backend == delay.DelayedRetry(0)
	}
	r.scenario = "switch:" + strings.Join(names, ">")
	heldLog := filepath.Join(t.TempDir(), "held.log")
	policy := ""
	if quorum {
		policy = r.s.Prefix + "-delayed-retry"
		t.Cleanup(func() { _, _ = g.b.ctl(g.ctx, "clear_policy", policy) })
	}
	if quorum {
		// Applied ahead of the first switch to delayed-retry (rabbitmqctl takes seconds;
		// the copying configurations run with it unharmed), checked at the switch.
		ms := r.s.HeldDelay().Milliseconds()
		def := fmt.Sprintf(`{"delayed-retry-type":"returned","delayed-retry-min":%d,"delayed-retry-max":%d}`, ms, ms)
		if out, err := g.b.ctl(g.ctx, "set_policy", "--apply-to", "quorum_queues", "--priority", "10", policy, "^"+strings.ReplaceAll(r.work, ".", `\.`)+"$", def); err != nil {
			t.Fatalf("set_policy: %v\n%s", err, out)
		}
	}
	r.waitingOptional = true
	r.use(stages[0], quorum, heldLog)
	var plan []fault
	for i, st := range stages[1:] {
		plan = append(plan, fault{"switch_to_" + st.String(), func(g *group) string {
			return r.switchTo(st, i%2 == 1, quorum, heldLog, policy)
		}})
	}
	acc := g.play(plan)[0]

	// How late the retries due while no consumer ran (from the old one's stop to the
	// new one's start) came back (due = arrival - lateness): against their due time,
	// and against the later of their due time and the new consumer being ready (what
	// the storage adds).
	for k := range g.faults {
		var late, afterReady []time.Duration
		for _, recs := range acc.handled {
			for _, h := range earliest(recs).retries() {
				if due := h.arrived.Add(-h.late); !due.Before(r.stoppedAt[k]) && !due.After(r.readyAt[k]) {
					late = append(late, h.late)
					afterReady = append(afterReady, h.arrived.Sub(later(due, r.readyAt[k])))
				}
			}
		}
		slices.Sort(late)
		slices.Sort(afterReady)
		fmt.Printf("NOLOSS-SWITCH rabbitmq=%s change=%d from=%s to=%s at_s=%.1f no_consumer_s=%.1f %s retries_due_during=%d late_p50_ms=%d late_p99_ms=%d late_max_ms=%d after_ready_p50_ms=%d after_ready_max_ms=%d\n",
			r.version, k+1, names[k], names[k+1], r.stoppedAt[k].Sub(g.start).Seconds(), r.readyAt[k].Sub(r.stoppedAt[k]).Seconds(), g.faults[k].note,
			len(late), pct(late, 50), pct(late, 99), pct(late, 100), pct(afterReady, 50), pct(afterReady, 100))
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// use makes st the run's configuration: the setup and flags of its next consumer, and
// what it declares added to what the run accounts for and deletes at the end.
func (r *run) use(st switchStage, quorum bool, heldLog string) {
	r.t.Helper()
	s := r.s
	s.Variant, _ = noloss.VariantNamed(st.backend.Name())
	s.StoragePrefix, s.Tiers, s.LevelsOf, s.QuorumWork, s.Topology = "", st.tiers, st.levels, quorum, ""
	args := []string{"-held-log", heldLog}
	if quorum {
		args = append(args, "-quorum")
	}
	if st.prefix != "" {
		s.StoragePrefix = s.Prefix + "." + st.prefix
		args = append(args, "-storage-prefix", s.StoragePrefix)
	}
	if st.tiers != nil {
		var ts []string
		for _, d := range st.tiers {
			ts = append(ts, d.String())
		}
		args = append(args, "-tiers", strings.Join(ts, ","))
	}
	if st.levels != 0 {
		args = append(args, "-levels", strconv.Itoa(st.levels))
	}
	if st.backend == (delay.DelayedRetry(0)) {
		// The work queue exists without the delayed-retry arguments: a policy gives
		// them, and nothing is declared (it would be refused).
		s.Topology = topology.ModeVerify
		args = append(args, "-topology", string(topology.ModeVerify))
	}
	r.s, r.v, r.consumerArgs = s, s.Variant, args
	r.anyHoldsRetries = r.anyHoldsRetries || s.Variant.HoldsRetries()

	plan, err := s.Config().Plan(r.work)
	if err != nil {
		r.t.Fatal(err)
	}
	for _, q := range plan.Queues {
		if slices.Contains(r.allQueues, q.Name) {
			continue
		}
		// Every other prefix's parking queue is checked with the delay queues.
		r.allQueues = append(r.allQueues, q.Name)
		r.delayQueues = append(r.delayQueues, q.Name)
	}
	for _, e := range plan.Exchanges {
		if !slices.Contains(r.exchanges, e.Name) {
			r.exchanges = append(r.exchanges, e.Name)
		}
	}
}

// switchTo publishes the next batch, stops the consumer (killing it if kill) while it
// works on that batch, and starts one with st. Before the first switch to
// delayed-retry it checks that the delayed-retry policy is on the work queue.
func (r *run) switchTo(st switchStage, kill, quorum bool, heldLog, policy string) string {
	g := r.g
	// The policy first: applying it takes seconds, while retries wait.
	note := ""
	if st.backend == (delay.DelayedRetry(0)) && !r.policyOn {
		for deadline := time.Now().Add(30 * time.Second); !r.policyApplied(policy); time.Sleep(200 * time.Millisecond) {
			if time.Now().After(deadline) {
				r.fatal("policy %s not on %s after 30 s", policy, r.work)
			}
		}
		r.policyOn, note = true, "policy_checked,"
	}
	// The consumer caught up (nothing ready in the work queue), so that what comes late
	// at the change is the change's doing, not a backlog's; a backlog left after 10 s
	// is noted.
	// (A passive declare does not count the retries RabbitMQ 4.3 holds in the queue.)
	backlog := r.count(r.work)
	for deadline := time.Now().Add(10 * time.Second); backlog > 0 && time.Now().Before(deadline); backlog = r.count(r.work) {
		time.Sleep(20 * time.Millisecond)
	}
	waiting := r.waitingCopies()
	// A few messages of the next batch: in flight when the consumer stops, without a
	// backlog in front of the retries due during the change (the rest follows it).
	lo, hi := r.batch(g.batch+1, g.batches)
	hi = min(hi, lo+inFlight)
	if err := r.publish(lo, hi); err != nil {
		r.fatal("publish batch %d: %v", g.batch+2, err)
	}
	for i := lo; i < hi; i++ {
		r.published[i] = true
	}
	stopped := time.Now()
	r.stoppedAt = append(r.stoppedAt, stopped)
	how := "sigterm"
	if kill {
		how = "sigkill"
		r.consumer.kill()
	} else {
		r.consumer.stop()
	}
	stopTook := time.Since(stopped)
	// No consumer until retries have left the old storage (fewer wait than when the
	// consumer stopped), for up to 15 s: retries come due during the change. Retries
	// held in the work queue are counted (rabbitmqctl) only when the old configuration
	// held them.
	waitingOld := r.waitingCopies
	if r.v.HoldsRetries() {
		waitingOld = r.waitingNow
	}
	base := waitingOld()
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if n := waitingOld(); n < base {
			note += fmt.Sprintf("left_while_down=%d,", base-n)
			break
		}
	}
	r.use(st, quorum, heldLog)
	r.consumer = r.startConsumer()
	r.readyAt = append(r.readyAt, time.Now())
	return fmt.Sprintf("%sbacklog=%d,copies_waiting_at_stop=%d,%s_s=%.1f,down_s=%.1f", note, backlog, waiting, how, stopTook.Seconds(), time.Since(stopped).Seconds())
}

// waitingCopies counts the retries waiting in delay queues (a passive declare of each:
// current, and fast, unlike rabbitmqctl, which takes seconds).
func (r *run) waitingCopies() int {
	n := 0
	for _, q := range r.delayQueues {
		n += r.count(q)
	}
	return n
}

// policyApplied tells whether policy is the work queue's policy (rabbitmqctl).
func (r *run) policyApplied(policy string) bool {
	if policy == "" {
		return false
	}
	out, err := r.g.b.ctl(r.g.ctx, "-q", "list_queues", "--formatter", "json", "name", "policy")
	if err != nil {
		r.fatal("list_queues: %v\n%s", err, out)
	}
	if i := strings.IndexByte(string(out), '['); i > 0 {
		out = out[i:]
	}
	var qs []struct {
		Name   string `json:"name"`
		Policy string `json:"policy"`
	}
	if err := json.Unmarshal(out, &qs); err != nil {
		r.fatal("list_queues: %v\n%s", err, out)
	}
	for _, q := range qs {
		if q.Name == r.work {
			return q.Policy == policy
		}
	}
	return false
}
