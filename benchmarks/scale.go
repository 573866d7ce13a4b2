package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/topology"
)

// Scale (-scale, separate from the suite): for each broker backend (memory has no
// broker side), scaleWaiting retries wait in the broker while we measure
//
//   - the growth of this process's VmRSS (after GC) from before the first hand-off to
//     when all of them are confirmed and counted in their queue;
//   - the broker's memory per waiting retry: erlang:memory(total) as `rabbitmqctl
//     status` reports it (memory.total.erlang), after all of them are in their queue
//     and a settling pause, minus the same before the first, over their number. The
//     broker is shared: other queues' memory moves it too (the categories that moved
//     most are recorded beside it);
//   - the hand-off rate (rig.schedule from scaleWorkers goroutines on one hand-off
//     connection, confirmed) of scaleRateN retries with none waiting, then of as many
//     again with all of them waiting;
//   - the lateness of scaleSameSecond retries that all come due within the same second:
//     each is handed off with the whole number of seconds that puts its due time in
//     [T, T+1s), T far enough ahead for all of them to be handed off first; a plain
//     consumer (prefetch 1,000) reads them back.
//
// The waiting retries have the long delay scaleLong (ttl-tiers: one tier of it; the
// same-second ones use tiers 1s..scaleMaxTier). Everything is deleted at the end, the
// queues with their messages (QueueDelete, not purge); the time that takes is recorded.

// scaleWaiting and scaleSameSecond are set by -scale-waiting and -scale-same-second
// (defaults: the 1,000,000 and 100,000).
var scaleWaiting, scaleSameSecond int

const (
	scaleRateN   = 20_000
	scaleWorkers = 64
	scaleLong    = time.Hour
	scaleMaxTier = 120 * time.Second
	scaleSettle  = 10 * time.Second
)

// ScaleResult is one backend's entry in the -scale JSON.
type ScaleResult struct {
	Waiting           int     `json:"waiting"`
	FillSeconds       float64 `json:"fill_seconds"`
	FillPath          string  `json:"fill_path"`
	ClientRSSGrowthMB float64 `json:"client_rss_growth_mb"`
	ClientRSSBeforeMB float64 `json:"client_rss_before_mb"`
	ClientRSSAfterMB  float64 `json:"client_rss_after_mb"`
	// BrokerBytesPerRetry: the growth of the memory of the backend's queues
	// (rabbitmqctl list_queues name memory: each queue's process), per waiting retry.
	BrokerBytesPerRetry float64 `json:"broker_memory_bytes_per_waiting_retry"`
	QueuesMemoryBefore  int64   `json:"queues_memory_before_bytes"`
	QueuesMemoryAfter   int64   `json:"queues_memory_after_bytes"`
	// BrokerTotalBytesPerRetry: the growth of the whole broker's memory
	// (erlang:memory(total)), per waiting retry; other queues, and the write-ahead log's
	// in-memory tables until they are flushed to disk, move it too.
	BrokerTotalBytesPerRetry float64 `json:"broker_total_memory_bytes_per_waiting_retry"`
	BrokerMemoryBefore       int64   `json:"broker_memory_before_bytes"`
	BrokerMemoryAfter        int64   `json:"broker_memory_after_bytes"`
	BrokerMemorySource       string  `json:"broker_memory_source"`
	BrokerMemoryMoved        string  `json:"broker_memory_categories_moved"`
	HandoffRateNone          float64 `json:"handoff_rate_none_waiting"`
	HandoffRateWaiting       float64 `json:"handoff_rate_all_waiting"`
	HandoffRateRatio         float64 `json:"handoff_rate_ratio"`
	SameSecondN              int     `json:"same_second_retries"`
	SameSecondLatenessMS     any     `json:"same_second_lateness_ms"`
	SameSecondDrainRate      float64 `json:"same_second_drain_per_s"`
	CleanupSeconds           float64 `json:"cleanup_seconds"`
}

// ScaleResults is the -scale JSON: the broker version and one entry per backend
// (skipped ones as {"skipped": reason}).
type ScaleResults struct {
	Broker string `json:"broker"`
	Date   string `json:"date"`
	// DeadLetterRate: the broker's own at-least-once dead-letter rate (deadletter.go),
	// with DLXPrefetch the broker's dead_letter_worker_consumer_prefetch.
	DeadLetterRate float64        `json:"broker_dead_letter_rate_per_s"`
	DLXPrefetch    string         `json:"dead_letter_worker_consumer_prefetch"`
	Backends       map[string]any `json:"backends"`
	Seconds        float64        `json:"run_seconds"`
}

// runScale runs the scale scenario for every broker backend, or only for those only
// names (comma-separated; "" is all).
func runScale(ctx context.Context, e *env, ctl []string, only string) (*ScaleResults, error) {
	res := &ScaleResults{Broker: e.brokerVersion(), Date: time.Now().UTC().Format(time.RFC3339), Backends: map[string]any{}, DLXPrefetch: e.dlxPrefetch}
	start := time.Now()
	fmt.Println("== the broker's own dead-letter rate")
	rate, err := e.deadLetterRate(ctx, scaleSameSecond)
	if cerr := e.cleanup(false); cerr != nil { // the broker may be restarting a crashed part
		time.Sleep(scaleSettle)
		if cerr = e.cleanup(false); err == nil {
			err = cerr
		}
	}
	if err != nil {
		return res, fmt.Errorf("dead-letter rate: %w", err)
	}
	res.DeadLetterRate = round(rate, 0)
	for _, name := range benchBackends() {
		if name == (delay.Memory(nil)).Name() {
			continue // no broker side: its retries wait in this process
		}
		if only != "" && !slices.Contains(strings.Split(only, ","), name) {
			continue
		}
		fmt.Printf("== scale %s\n", name)
		r, skip, err := e.scaleOne(ctx, name, ctl)
		cerr := e.cleanup(e.reg.takeUnsure())
		switch {
		case err != nil:
			res.Backends[name] = map[string]string{"error": err.Error()}
			fmt.Printf("   FAILED: %v\n", err)
		case skip != "":
			res.Backends[name] = skipped{skip}
			fmt.Printf("   skipped: %s\n", skip)
		default:
			res.Backends[name] = r
		}
		if cerr != nil {
			return res, cerr
		}
		if ctx.Err() != nil {
			return res, ctx.Err()
		}
	}
	res.Seconds = round(time.Since(start).Seconds(), 0)
	return res, nil
}

func (e *env) scaleOne(ctx context.Context, name string, ctl []string) (*ScaleResult, string, error) {
	var tiers []time.Duration
	if name == (delay.TTLTiers()).Name() {
		for d := time.Second; d <= scaleMaxTier; d += time.Second {
			tiers = append(tiers, d)
		}
		tiers = append(tiers, scaleLong)
	}
	r, skip, err := e.newRig(name, "scale", tiers)
	if err != nil || skip != "" {
		return nil, skip, err
	}
	closed := false
	defer func() {
		if !closed {
			r.close()
		}
	}()
	res := &ScaleResult{SameSecondN: scaleSameSecond, BrokerMemorySource: "queues: rabbitmqctl list_queues name memory (the backend's queues); total: rabbitmqctl status memory.total.erlang (erlang:memory(total))"}

	rssBefore, err := rssBytes()
	if err != nil {
		return nil, "", err
	}
	memBefore, catBefore, err := brokerMemory(ctl)
	if err != nil {
		return nil, "", err
	}
	var backendQueues []string
	for _, q := range r.b.Topology().Queues {
		backendQueues = append(backendQueues, q.Name)
	}
	qmemBefore, err := queuesMemory(ctl, backendQueues)
	if err != nil {
		return nil, "", err
	}
	seq := 0
	batch := func(n int) (float64, error) {
		first := seq
		seq += n
		t0 := time.Now()
		err := parallel(ctx, n, scaleWorkers, func(i int) error {
			return r.schedule(fmt.Sprintf("scale-%07d", first+i), scaleLong)
		})
		return float64(n) / time.Since(t0).Seconds(), err
	}
	if _, err := batch(5000); err != nil { // warm-up, counted among the waiting
		return nil, "", err
	}
	if res.HandoffRateNone, err = batch(scaleRateN); err != nil {
		return nil, "", err
	}
	fmt.Printf("   hand-off rate, none waiting: %.0f/s (%d)\n", res.HandoffRateNone, scaleRateN)
	fill := batch
	res.FillPath = "the backend's Publish"
	if name == (delay.BinaryLevels(0)).Name() {
		res.FillPath = "straight to the exchange of the first level the retry waits in (levelPublish), also for the same-second retries"
		fill = func(n int) (float64, error) { return e.fillLevel(ctx, r, &seq, n) }
	}
	t0 := time.Now()
	fillRate := res.HandoffRateNone // the same-second retries go in as the fill does
	if name == (delay.BinaryLevels(0)).Name() {
		fillRate = math.Inf(1)
	}
	for seq < scaleWaiting {
		n := min(100_000, scaleWaiting-seq)
		rate, err := fill(n)
		fillRate = min(fillRate, rate)
		if err != nil {
			return nil, "", err
		}
		fmt.Printf("   %7d waiting (last %d at %.0f/s)\n", seq, n, rate)
	}
	res.FillSeconds = round(time.Since(t0).Seconds(), 0)
	res.Waiting = seq // at least scaleWaiting: the warm-up and the first rate batch wait too
	if err := e.waitDepth(ctx, r, name, seq); err != nil {
		return nil, "", err
	}
	rssAfter, err := rssBytes()
	if err != nil {
		return nil, "", err
	}
	res.ClientRSSBeforeMB, res.ClientRSSAfterMB = round(float64(rssBefore)/mib, 1), round(float64(rssAfter)/mib, 1)
	res.ClientRSSGrowthMB = round(float64(rssAfter-rssBefore)/mib, 1)
	time.Sleep(scaleSettle)
	memAfter, catAfter, err := brokerMemory(ctl)
	if err != nil {
		return nil, "", err
	}
	qmemAfter, err := queuesMemory(ctl, backendQueues)
	if err != nil {
		return nil, "", err
	}
	res.BrokerMemoryBefore, res.BrokerMemoryAfter = memBefore, memAfter
	res.BrokerTotalBytesPerRetry = round(float64(memAfter-memBefore)/float64(res.Waiting), 1)
	res.BrokerMemoryMoved = moved(catBefore, catAfter)
	res.QueuesMemoryBefore, res.QueuesMemoryAfter = qmemBefore, qmemAfter
	res.BrokerBytesPerRetry = round(float64(qmemAfter-qmemBefore)/float64(res.Waiting), 1)
	fmt.Printf("   client VmRSS %.1f -> %.1f MiB; the backend's queues %d -> %d bytes: %.1f bytes per waiting retry; whole broker %d -> %d bytes: %.1f per waiting retry (%s)\n",
		res.ClientRSSBeforeMB, res.ClientRSSAfterMB, qmemBefore, qmemAfter, res.BrokerBytesPerRetry,
		memBefore, memAfter, res.BrokerTotalBytesPerRetry, res.BrokerMemoryMoved)

	if res.HandoffRateWaiting, err = batch(scaleRateN); err != nil {
		return nil, "", err
	}
	res.HandoffRateRatio = round(res.HandoffRateWaiting/res.HandoffRateNone, 3)
	fmt.Printf("   hand-off rate, %d waiting: %.0f/s: ratio %.3f\n", seq-scaleRateN, res.HandoffRateWaiting, res.HandoffRateRatio)

	q, drain, err := e.sameSecond(ctx, r, fillRate)
	if err != nil {
		return nil, "", err
	}
	res.SameSecondLatenessMS, res.SameSecondDrainRate = q, round(drain, 0)

	r.close()
	closed = true
	t0 = time.Now()
	if err := e.cleanup(false); err != nil {
		return nil, "", err
	}
	res.CleanupSeconds = round(time.Since(t0).Seconds(), 1)
	fmt.Printf("   deleted the backend's queues and exchanges in %.1f s\n", res.CleanupSeconds)
	return res, "", nil
}

// fillLevel is the fill of binary-levels: the backend's Publish sends every retry to
// the top level's exchange, through up to 28 topic exchanges bound exchange to
// exchange, and this broker routes that at a few hundred per second (the hand-off
// rates measured above), which would take most of an hour for 1,000,000. The fill
// therefore publishes each retry with levelPublish. The same-second retries too: at a
// few hundred per second, 100,000 of them could not be handed off within a window that
// still lets them come due together.
func (e *env) fillLevel(ctx context.Context, r *rig, seq *int, n int) (float64, error) {
	start := *seq
	*seq += n
	t0 := time.Now()
	err := parallel(ctx, n, scaleWorkers, func(i int) error {
		return levelPublish(ctx, r, fmt.Sprintf("scale-%07d", start+i), scaleLong)
	})
	return float64(n) / time.Since(t0).Seconds(), err
}

// levelPublish hands a retry of d (whole seconds) for r's queue to binary-levels the
// short way: the same message, with the same routing key, that Publish would send,
// through the same hand-off, but straight to the exchange of the first level it waits
// in, where the chain of exchanges would have delivered it. The retry that waits is the
// same; only its way in is shorter.
func levelPublish(ctx context.Context, r *rig, id string, d time.Duration) error {
	const levels = backend.DefaultLevels
	secs := int64(d / time.Second)
	first := 0
	var key strings.Builder
	for l := levels - 1; l >= 0; l-- {
		bit := secs >> l & 1
		if bit == 1 && first == 0 {
			first = l
		}
		key.WriteString([]string{"0.", "1."}[bit])
	}
	key.WriteString(r.queue)
	exchange := strings.TrimSuffix(r.queue, ".work") + ".level." + strconv.Itoa(first)
	msg := message.NewMessage(id, []byte(id))
	msg.Metadata.Set(keys.Due, time.Now().Add(d).UTC().Format(time.RFC3339Nano))
	return r.h.Publish(ctx, exchange, key.String(), msg, nil, true, func() topology.Topology { return backend.Plan(r.b, r.queue) })
}

// waitDepth waits until the backend's queues have want messages: every retry handed
// off is confirmed, so this is at once for ttl-tiers; binary-levels may still be
// moving some between levels.
func (e *env) waitDepth(ctx context.Context, r *rig, name string, want int) error {
	conn, err := r.h.Connection()
	if err != nil {
		return err
	}
	var queues []string
	for _, q := range r.b.Topology().Queues {
		queues = append(queues, q.Name)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		total := 0
		for _, q := range queues {
			n, err := queueDepth(conn, q)
			if err != nil {
				return err
			}
			total += n
		}
		if total >= want {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("%s: %d of %d retries in its queues", name, total, want)
		}
		time.Sleep(time.Second)
	}
}

// sameSecond hands off scaleSameSecond retries that all come due within [T, T+1s)
// and returns their lateness and the rate at which they were read back.
func (e *env) sameSecond(ctx context.Context, r *rig, rate float64) (any, float64, error) {
	n := scaleSameSecond
	c, err := e.consume(r.queue, 2*n)
	if err != nil {
		return nil, 0, err
	}
	defer c.close()
	ahead := time.Duration(1.5*float64(n)/rate*float64(time.Second)) + 5*time.Second
	if r.b.Name() == (delay.TTLTiers()).Name() && ahead > scaleMaxTier-5*time.Second {
		return nil, 0, fmt.Errorf("%d hand-offs at %.0f/s would not fit in the %s tiers", n, rate, scaleMaxTier)
	}
	T := time.Now().Add(ahead)
	var mu sync.Mutex
	outside := 0
	err = parallel(ctx, n, scaleWorkers, func(i int) error {
		d := time.Until(T).Truncate(time.Second) + time.Second // due in [T, T+1s)
		if d < time.Second {
			d = time.Second
			mu.Lock()
			outside++
			mu.Unlock()
		}
		if r.b.Name() == (delay.BinaryLevels(0)).Name() {
			return levelPublish(ctx, r, fmt.Sprintf("same-%06d", i), d)
		}
		return r.schedule(fmt.Sprintf("same-%06d", i), d)
	})
	if err != nil {
		return nil, 0, err
	}
	handed := time.Now()
	fmt.Printf("   %d retries due in [T, T+1s) handed off %.1f s before T (%d outside the window)\n", n, T.Sub(handed).Seconds(), outside)
	if outside > 0 {
		return nil, 0, fmt.Errorf("%d of %d retries handed off too late for the window", outside, n)
	}
	deadline := time.After(ahead + 5*time.Minute)
	seen := make(map[string]bool, n)
	late := make([]time.Duration, 0, n)
	var firstAt, lastAt time.Time
	for len(seen) < n {
		a, err := c.next(ctx, deadline)
		if err != nil {
			return nil, 0, fmt.Errorf("%d of %d same-second retries back: %w", len(seen), n, err)
		}
		if seen[a.msg.UUID] {
			continue
		}
		seen[a.msg.UUID] = true
		due, err := dueOf(a.msg)
		if err != nil {
			return nil, 0, err
		}
		if firstAt.IsZero() {
			firstAt = a.at
		}
		lastAt = a.at
		late = append(late, a.at.Sub(due))
	}
	q := quantilesOf(late)
	drain := float64(n) / lastAt.Sub(firstAt).Seconds()
	fmt.Printf("   same-second lateness: p50 %.1f, p95 %.1f, p99 %.1f, max %.1f ms; read back over %.1f s (%.0f/s)\n",
		q.P50, q.P95, q.P99, q.Max, lastAt.Sub(firstAt).Seconds(), drain)
	return q, drain, nil
}

// brokerMemory runs `<ctl> status --formatter json` and returns memory.total.erlang
// and the categories of the breakdown.
func brokerMemory(ctl []string) (int64, map[string]int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	args := append(append([]string{}, ctl[1:]...), "-q", "status", "--formatter", "json")
	out, err := exec.CommandContext(ctx, ctl[0], args...).Output()
	if err != nil {
		return 0, nil, fmt.Errorf("%s status: %w", strings.Join(ctl, " "), err)
	}
	var st struct {
		Memory map[string]json.RawMessage `json:"memory"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		return 0, nil, fmt.Errorf("%s status: %w", strings.Join(ctl, " "), err)
	}
	var total struct {
		Erlang int64 `json:"erlang"`
	}
	if err := json.Unmarshal(st.Memory["total"], &total); err != nil || total.Erlang == 0 {
		return 0, nil, fmt.Errorf("%s status: no memory.total.erlang (%v)", strings.Join(ctl, " "), err)
	}
	cats := map[string]int64{}
	for k, v := range st.Memory {
		var n int64
		if json.Unmarshal(v, &n) == nil {
			cats[k] = n
		}
	}
	return total.Erlang, cats, nil
}

// queuesMemory sums the memory rabbitmqctl list_queues reports for the named queues.
func queuesMemory(ctl []string, names []string) (int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	args := append(append([]string{}, ctl[1:]...), "-q", "list_queues", "name", "memory", "--formatter", "json")
	out, err := exec.CommandContext(ctx, ctl[0], args...).Output()
	if err != nil {
		return 0, fmt.Errorf("%s list_queues: %w", strings.Join(ctl, " "), err)
	}
	var qs []struct {
		Name   string `json:"name"`
		Memory int64  `json:"memory"`
	}
	if err := json.Unmarshal(out, &qs); err != nil {
		return 0, fmt.Errorf("%s list_queues: %w", strings.Join(ctl, " "), err)
	}
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	var sum int64
	found := 0
	for _, q := range qs {
		if want[q.Name] {
			sum += q.Memory
			found++
		}
	}
	if found != len(names) {
		return 0, fmt.Errorf("list_queues: %d of the backend's %d queues listed", found, len(names))
	}
	return sum, nil
}

// moved names the three categories whose memory changed most, with the change.
func moved(before, after map[string]int64) string {
	type kv struct {
		k string
		d int64
	}
	var all []kv
	for k, v := range after {
		if k != "reserved_unallocated" && k != "allocated_unused" {
			all = append(all, kv{k, v - before[k]})
		}
	}
	sort.Slice(all, func(i, j int) bool { return abs(all[i].d) > abs(all[j].d) })
	var parts []string
	for _, x := range all[:min(3, len(all))] {
		parts = append(parts, fmt.Sprintf("%s %+.1f MiB", x.k, float64(x.d)/mib))
	}
	return strings.Join(parts, ", ")
}

func abs(x int64) int64 {
	if x < 0 {
		return -x
	}
	return x
}
