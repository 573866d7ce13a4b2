package noloss_test

import (
	"fmt"
	"slices"
	"strings"

	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss"
)

// The ordered runs (noloss.Variant.Ordered, Config.OrderKey): message i carries key
// noloss.OrderKeyName(i % keys), and each key's messages are published in the order of
// their index. What they check, besides the accounting of every run: no message is
// handled for the first time after a later message of its key was (outOfOrder), and
// no key is left blocked at the end (checkReleased).

// orderKeys gives the run's messages n order keys, and names the behind queues they may
// have, to count what waits in them and to delete them at the end.
func (r *run) orderKeys(n int) {
	r.keys = n
	nm := names.Names{Prefix: r.s.Config().WithDefaults().Prefix}
	r.behind = nil
	for i := range n {
		queue := r.work
		if r.queueOf != nil {
			queue = r.queueOf(i) // the key of message i is key i
		}
		r.behind = append(r.behind, nm.Behind(queue, noloss.OrderKeyName(i)))
	}
}

// keyOf is the order key of message i.
func (r *run) keyOf(i int) string { return noloss.OrderKeyName(i % r.keys) }

// outOfOrder describes each message whose first successful run began after that of a
// later message of its key (a higher index): each key's messages, taken in the order
// their first successful runs began, must have increasing indexes. Messages never
// handled (poisoned, or lost: counted apart) take no place in their key's order, and
// a duplicate, a message handled again, counts at its first run only.
func (r *run) outOfOrder(a *account) []string {
	type run struct {
		idx int
		rec record
	}
	byKey := map[string][]run{}
	for i, id := range r.uuids {
		if recs := a.handled[id]; len(recs) > 0 {
			byKey[r.keyOf(i)] = append(byKey[r.keyOf(i)], run{i, earliest(recs)})
		}
	}
	var out []string
	for key, runs := range byKey {
		slices.SortFunc(runs, func(x, y run) int { return x.rec.handled.Compare(y.rec.handled) })
		latest := runs[0]
		for _, h := range runs[1:] {
			if h.idx < latest.idx {
				out = append(out, fmt.Sprintf("key %s: message %d (%s) first handled at %s by pid %d from %s, after message %d at %s by pid %d",
					key, h.idx, r.uuids[h.idx], h.rec.handled.Format("15:04:05.000000"), h.rec.pid, h.rec.queue,
					latest.idx, latest.rec.handled.Format("15:04:05.000000"), latest.rec.pid))
				continue
			}
			latest = h
		}
	}
	slices.Sort(out)
	return out
}

// blockedIn returns how many of the run's keys are blocked in listed (their behind
// queues exist) and how many messages wait behind them.
func (r *run) blockedIn(listed map[string]queueStats) (keys, behind int) {
	for _, q := range r.behind {
		if s, ok := listed[q]; ok {
			keys++
			behind += s.Messages
		}
	}
	return keys, behind
}

// checkReleased fails the run if a key is still blocked: every head succeeded or was
// poisoned, and the messages behind it ran, so its behind queue is gone.
func (r *run) checkReleased() {
	listed := r.listQueues()
	for _, q := range r.behind {
		if s, ok := listed[q]; ok {
			r.t.Errorf("%s: behind queue %s left at the end with %d messages: its key was never released", r.v.Name, q, s.Messages)
		}
	}
}

// blockedCount is how many keys of a run were blocked, and how many messages waited
// behind them.
type blockedCount struct{ keys, behind int }

// blockedKeys counts the blocked keys of each ordered run of g (nil when none is
// ordered).
func (g *group) blockedKeys() []blockedCount {
	if !slices.ContainsFunc(g.runs, func(r *run) bool { return r.keys > 0 }) {
		return nil
	}
	all := listAll(g)
	var out []blockedCount
	for _, r := range g.runs {
		if r.keys > 0 {
			k, b := r.blockedIn(r.mine(all))
			out = append(out, blockedCount{k, b})
		}
	}
	return out
}

// blockedNote says how many keys were blocked when the fault started, for the log
// ("" when no run is ordered).
func (f faultRecord) blockedNote() string {
	if len(f.blocked) == 0 {
		return ""
	}
	return " with " + f.blockedFields(" ")
}

// blockedFields is "blocked_keys=K1+K2<sep>behind=B1+B2", a field per count, a number
// per ordered run.
func (f faultRecord) blockedFields(sep string) string {
	var keys, behind []string
	for _, b := range f.blocked {
		keys = append(keys, fmt.Sprint(b.keys))
		behind = append(behind, fmt.Sprint(b.behind))
	}
	return "blocked_keys=" + strings.Join(keys, "+") + sep + "behind=" + strings.Join(behind, "+")
}
