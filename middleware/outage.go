package middleware

// Outages (amqpretry.Config.Outage): per work queue, whether the handlers' failures
// say that something they depend on is down. While a queue is in an outage its
// messages wait here, before the handler, instead of running: they spend no attempt,
// nothing is copied or held for them, and the subscriber takes no more from the broker
// than its prefetch. One at a time runs as a probe, never the same message twice in a
// row while another waits; the first success ends the outage. A run is an attempt,
// probe or not: a failed one takes the failure path like any other, so that no message
// runs more often than Policy.MaxAttempts. The engine runs every handler through
// runHandler, here: through its queue's outage, its panic recovered (run) and its error
// decided (decide).

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
)

// outages keeps the outage state of each work queue the engine has seen fail.
type outages struct {
	cfg      amqpretry.Outage // with defaults
	window   int              // runs the ratio is measured over
	maxProbe time.Duration    // the longest wait between probes
	mu       sync.Mutex
	queues   map[string]*outage
	// started, probes and down count outages begun, probes run, and the time spent
	// in outage by the ended ones, for Stats.
	started, probes, down atomic.Int64
}

// newOutages returns the outage state of an engine configured with cfg (with its
// defaults): nil when outage detection is off (a negative Consecutive).
func newOutages(cfg amqpretry.Outage) *outages {
	if cfg.Consecutive < 0 {
		return nil
	}
	maxProbe := time.Duration(math.MaxInt64) // a ProbeInterval of years: no overflow
	if cfg.ProbeInterval <= maxProbe/maxProbeFactor {
		maxProbe = maxProbeFactor * cfg.ProbeInterval
	}
	return &outages{cfg: cfg, window: windowPerConsecutive * cfg.Consecutive, maxProbe: maxProbe}
}

// What amqpretry.Outage derives from its fields (its doc and docs/outage.md say so):
// the ratio's window, windowPerConsecutive × Consecutive runs, and the longest wait
// between probes, maxProbeFactor × ProbeInterval.
const (
	windowPerConsecutive = 5
	maxProbeFactor       = 30
)

// of returns queue's outage state.
func (o *outages) of(queue string) *outage {
	o.mu.Lock()
	defer o.mu.Unlock()
	q := o.queues[queue]
	if q == nil {
		if o.queues == nil {
			o.queues = map[string]*outage{}
		}
		q = &outage{cfg: o.cfg, maxProbe: o.maxProbe, runs: make([]outcome, o.window), changed: make(chan struct{})}
		o.queues[queue] = q
	}
	return q
}

// inOutage counts the queues in an outage now.
func (o *outages) inOutage() int64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	var n int64
	for _, q := range o.queues {
		if q.isDown.Load() {
			n++
		}
	}
	return n
}

// outage is one work queue's: what its latest runs did, and the outage, if any.
//
// The rules (amqpretry.Outage) tell "these messages fail" from "their dependency is
// down" by the new messages: a dependency that is down fails every first delivery,
// while messages that fail for reasons of their own are some of them, and their
// retries fail again. So the failures must include Consecutive first deliveries in a
// row (no run succeeding among them), or a Ratio of the window's first deliveries as
// well as of its runs; and a retry among them, or a storm of messages that fail once
// would be one.
type outage struct {
	cfg      amqpretry.Outage
	maxProbe time.Duration // the longest wait between probes
	mu       sync.Mutex

	// The latest runs: a ring of window outcomes, and counts over it.
	runs                    []outcome
	next, filled            int
	failures, retryFailures int
	firsts, firstFailures   int // first deliveries (attempt 1), and those that failed
	// row has the messages of the first deliveries that failed since the latest
	// success (up to Consecutive of them: enough to tell), rowRetry whether a retry
	// failed since then too.
	row      map[string]struct{}
	rowRetry bool

	down bool
	// isDown mirrors down, for runHandler to read without the lock: a message that
	// reads it false as the outage begins runs once more, as it would have a moment
	// earlier.
	isDown    atomic.Bool
	since     time.Time
	last      error // the latest failure that counted
	interval  time.Duration
	nextProbe time.Time // when the next probe may run
	probe     uint64    // the probe running, or chosen, 0 for none
	probeSeq  uint64
	lastProbe string    // the message of the latest probe
	waiting   []*waiter // the messages waiting, in order of arrival
	// changed is closed, and replaced, when a waiting message may act: the outage
	// ended, a probe was chosen, or a probe finished.
	changed chan struct{}
}

// waiter is a message waiting in its queue's outage.
type waiter struct {
	msg     string
	attempt int
	probe   uint64 // its probe token, once chosen
}

// outcome is a run's: whether it failed (and counted), whether it was a first
// delivery, and the message.
type outcome struct {
	failed, first bool
	msg           string
}

// signal wakes the waiting messages. q.mu is locked.
func (q *outage) signal() {
	close(q.changed)
	q.changed = make(chan struct{})
}

// forget empties the ring of latest runs. q.mu is locked.
func (q *outage) forget() {
	clear(q.runs)
	q.next, q.filled, q.failures, q.retryFailures, q.firsts, q.firstFailures = 0, 0, 0, 0, 0, 0
}

// errClosing is why a waiting message goes back to the broker.
var errClosing = errors.New("the Retry is closing")

// await waits while q is down, as message msg on attempt. It returns
// the probe's token when msg is to run as the probe, 0 when the outage is over (or
// there is none); an error when ctx ends (its subscriber closes) or the engine closes.
func (q *outage) await(ctx context.Context, closing <-chan struct{}, msg string, attempt int) (uint64, error) {
	q.mu.Lock()
	if !q.down {
		q.mu.Unlock()
		return 0, nil
	}
	w := &waiter{msg: msg, attempt: attempt}
	q.waiting = append(q.waiting, w)
	q.mu.Unlock()
	for {
		q.mu.Lock()
		if w.probe == 0 && q.down && q.probe == 0 && !time.Now().Before(q.nextProbe) {
			c := q.choose()
			q.probeSeq++
			q.probe, c.probe, q.lastProbe = q.probeSeq, q.probeSeq, c.msg
			if c != w {
				q.signal()
			}
		}
		if w.probe != 0 || !q.down {
			q.leave(w)
			q.mu.Unlock()
			return w.probe, nil
		}
		changed := q.changed
		var wait time.Duration
		if q.probe == 0 {
			wait = time.Until(q.nextProbe)
		}
		q.mu.Unlock()
		var tick <-chan time.Time
		var timer *time.Timer
		if wait > 0 {
			timer = time.NewTimer(wait)
			tick = timer.C
		}
		var err error
		select {
		case <-changed:
		case <-tick:
		case <-ctx.Done():
			err = ctx.Err()
		case <-closing:
			err = errClosing
		}
		if timer != nil {
			timer.Stop()
		}
		if err != nil {
			q.mu.Lock()
			q.leave(w)
			if w.probe != 0 && q.probe == w.probe { // chosen, gone: another one probes
				q.probe = 0
				q.signal()
			}
			q.mu.Unlock()
			return 0, err
		}
	}
}

// choose picks the next probe among the waiting messages. A probe asks whether the
// dependency is back, not whether one message is good, and its failure costs its
// message an attempt: so not the latest probe's message while another waits, and of
// the others the one with the most attempts left (a first delivery if one waits), the
// one that has waited longest among those. q.mu is locked, and q.waiting is not empty.
func (q *outage) choose() *waiter {
	best := q.waiting[0]
	for _, w := range q.waiting[1:] {
		if (w.msg == q.lastProbe) != (best.msg == q.lastProbe) {
			if best.msg == q.lastProbe {
				best = w
			}
		} else if w.attempt < best.attempt {
			best = w
		}
	}
	return best
}

// leave takes w out of the waiting messages. q.mu is locked.
func (q *outage) leave(w *waiter) {
	if i := slices.Index(q.waiting, w); i >= 0 {
		q.waiting = slices.Delete(q.waiting, i, i+1)
	}
}

// edge is what a run changed in its queue's outage.
type edge int

const (
	noEdge edge = iota
	started
	ended
)

// record records a run of message msg (its UUID): err and its decision (nil when it
// is not this Retry's to decide: nil err, or a failure of another Retry), on attempt;
// probe is the run's probe token (0: not a probe). It returns the edge the run caused
// and, on an edge, the outage's duration and last failure. The run was an attempt
// either way: a failure takes the failure path.
func (q *outage) record(msg string, err error, dec *amqpretry.Decision, attempt int, probe uint64, now time.Time) (e edge, lasted time.Duration, last error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if probe != 0 && q.probe == probe {
		q.probe = 0
		defer q.signal()
	}
	counts := err != nil && dec != nil && !dec.Permanent && dec.Delay <= 0
	if err != nil && !counts {
		return noEdge, 0, nil
	}
	// The run goes into the ring of latest runs, and the counts over it.
	first := attempt <= 1
	o := outcome{failed: counts, first: first, msg: msg}
	if q.filled == len(q.runs) {
		q.count(q.runs[q.next], -1)
	} else {
		q.filled++
	}
	q.runs[q.next] = o
	q.next = (q.next + 1) % len(q.runs)
	q.count(o, 1)
	if err == nil {
		if q.down {
			// The outage's failures are its own: the next one is judged on the
			// runs after it.
			q.forget()
		}
		clear(q.row)
		q.rowRetry = false
		if q.down {
			q.down = false
			q.isDown.Store(false)
			q.signal()
			return ended, now.Sub(q.since), q.last
		}
		return noEdge, 0, nil
	}
	if first {
		if q.row == nil {
			q.row = map[string]struct{}{}
		}
		if len(q.row) < q.cfg.Consecutive {
			q.row[msg] = struct{}{}
		}
	} else {
		q.rowRetry = true
	}
	q.last = err
	if q.down {
		if probe != 0 {
			q.interval = min(2*q.interval, q.maxProbe)
			q.nextProbe = now.Add(q.interval)
		}
		return noEdge, 0, nil
	}
	if !dec.Unavailable && !q.tripped() {
		return noEdge, 0, nil
	}
	q.down, q.since = true, now
	q.isDown.Store(true)
	q.interval = q.cfg.ProbeInterval
	q.nextProbe = now.Add(q.interval)
	q.signal()
	return started, 0, err
}

// count adds o to the ring's counts (sign 1), or takes it out (-1). q.mu is locked.
func (q *outage) count(o outcome, sign int) {
	if o.first {
		q.firsts += sign
	}
	if !o.failed {
		return
	}
	q.failures += sign
	if o.first {
		q.firstFailures += sign
	} else {
		q.retryFailures += sign
	}
}

// tripped tells whether the failures so far say the dependency is down (the rules:
// amqpretry.Outage, and outage's doc). q.mu is locked.
func (q *outage) tripped() bool {
	if len(q.row) >= q.cfg.Consecutive && q.rowRetry {
		return true
	}
	if q.filled < len(q.runs) || q.retryFailures == 0 {
		return false
	}
	r := q.cfg.Ratio
	need := min(q.cfg.Consecutive, int(math.Ceil(r*float64(len(q.runs)))))
	return float64(q.failures) >= r*float64(q.filled) &&
		float64(q.firstFailures) >= r*float64(q.firsts) &&
		q.firstFailures >= need && q.failedFirsts(need)
}

// failedFirsts tells whether the failed first deliveries in the ring are of at least
// n different messages (one given back and delivered again counts once). q.mu is
// locked.
func (q *outage) failedFirsts(n int) bool {
	seen := make(map[string]struct{}, n)
	for _, o := range q.runs[:q.filled] {
		if o.failed && o.first {
			seen[o.msg] = struct{}{}
			if len(seen) >= n {
				return true
			}
		}
	}
	return false
}

// abandon ends a probe that did not record its outcome (the handler panicked past
// the engine).
func (q *outage) abandon(probe uint64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.probe == probe {
		q.probe = 0
		q.signal()
	}
}

// runHandler runs h on m, on attempt d.attempt (run: its panic recovered, its error
// decided), through the outage of d's queue: while the queue is down, m waits here and
// runs only as the probe or once the outage is over. Every run is an attempt: a
// failure, a probe's included, returns to the failure path (retried or poisoned as
// usual), and the next probe is another message. It returns the handler's result and
// its error's decision (nil for no error, or a failed hand-off of a Retry nearer the
// handler). Outside an outage it takes no lock but record's.
func (e *engine) runHandler(h message.HandlerFunc, m *message.Message, d delivery) ([]*message.Message, *amqpretry.Decision, error) {
	if e.outages == nil || !d.owned || d.queue == "" {
		return e.run(h, m, d, nil, 0)
	}
	q := e.outages.of(d.queue)
	var probe uint64
	if q.isDown.Load() {
		var werr error
		if probe, werr = q.await(m.Context(), e.life.closing(), m.UUID, d.attempt); werr != nil {
			return nil, nil, e.outageGiveBack(m, d, q, werr)
		}
	}
	produced, dec, err := e.run(h, m, d, q, probe)
	edge, lasted, last := q.record(m.UUID, err, dec, d.attempt, probe, time.Now())
	if probe != 0 {
		e.outages.probes.Add(1)
		e.observe(amqpretry.Event{Kind: amqpretry.EventProbe, Queue: d.queue, Attempt: d.attempt, Err: err})
	}
	if edge != noEdge {
		e.outageEdge(d, edge, lasted, last)
	}
	return produced, dec, err
}

// run runs h on msg and decides its error (decide; a failed hand-off of a Retry nearer
// the handler is not this one's to decide). A panic is recovered as a failure (the
// package's doc in panic.go): a *panicked error carrying the stack, logged at ERROR.
// The Retry nearest the handler recovers it; one further out sees its error. A probe
// (token probe of q, 0 for none) whose handler never returns (runtime.Goexit) is
// abandoned, so that another message can probe.
func (e *engine) run(h message.HandlerFunc, msg *message.Message, d delivery, q *outage, probe uint64) (produced []*message.Message, dec *amqpretry.Decision, err error) {
	returned := false
	defer func() {
		if v := recover(); v != nil {
			p := &panicked{value: v, stack: panicStack()}
			produced, err = nil, p
			e.cfg.Logger.Error("Handler panicked: recovered, dealt with as a failure", p, watermill.LogFields{
				"message_uuid": msg.UUID, "handler": d.handler, "topic": d.topic, "queue": d.queue, "attempt": d.attempt,
				"stack": p.stack,
			})
		} else if !returned {
			if probe != 0 {
				q.abandon(probe)
			}
			return
		}
		if err != nil && !errors.Is(err, amqpretry.ErrHandoff) {
			// decide, on the way of every failure: the error's marks, then Classify.
			x := amqpretry.DecisionOf(err)
			if e.cfg.Classify != nil {
				x = e.cfg.Classify(amqpretry.ClassifyParams{Err: err, Message: msg, Attempt: d.attempt, Default: x})
			}
			dec = &x
		}
	}()
	produced, err = h(msg)
	returned = true
	return produced, nil, err
}

// decide classifies err: the error's marks, then Classify if set.
func (e *engine) decide(msg *message.Message, err error, attempt int) amqpretry.Decision {
	p := amqpretry.ClassifyParams{Err: err, Message: msg, Attempt: attempt, Default: amqpretry.DecisionOf(err)}
	if e.cfg.Classify == nil {
		return p.Default
	}
	return e.cfg.Classify(p)
}

// outageEdge reports an outage's start or end: an event, and one log line.
func (e *engine) outageEdge(d delivery, ed edge, lasted time.Duration, last error) {
	switch ed {
	case started:
		e.outages.started.Add(1)
		notice(e.cfg.Logger, "Work queue in an outage: its handlers fail as if something they depend on is down; its messages wait, spending no attempt, and one at a time is run as a probe", withErr(watermill.LogFields{
			"queue": d.queue, "handler": d.handler, "probe_interval": e.cfg.Outage.ProbeInterval.String(),
		}, last))
		e.observe(amqpretry.Event{Kind: amqpretry.EventOutageStarted, Queue: d.queue, Err: last})
	case ended:
		e.outages.down.Add(int64(lasted))
		e.cfg.Logger.Info("Work queue's outage over: a probe succeeded; its messages run again", watermill.LogFields{
			"queue": d.queue, "handler": d.handler, "outage_duration": lasted.String(), "last_error": fmt.Sprint(last),
		})
		e.observe(amqpretry.Event{Kind: amqpretry.EventOutageEnded, Queue: d.queue, Err: last, Duration: lasted})
	}
}

// outageGiveBack answers a message that waited for an outage to end when its
// subscriber or the Retry closed: it goes back to the broker (the router nacks it with
// requeue), having spent no attempt here (a work queue that holds retries on RabbitMQ
// 4.3 counts the return itself: amqpretry.Outage).
func (e *engine) outageGiveBack(m *message.Message, d delivery, q *outage, why error) error {
	q.mu.Lock()
	last := q.last
	q.mu.Unlock()
	err := fmt.Errorf("%w: work queue %q is in an outage and %v: the message goes back to the queue", amqpretry.ErrHandoff, d.queue, why)
	if errors.Is(why, errClosing) {
		return e.refuseClosed(m, d, errors.Join(last, err))
	}
	e.givenBack.add(m.UUID)
	return errors.Join(last, err)
}
