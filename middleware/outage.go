package middleware

// Outages (amqpretry.Config.Outage): per work queue, whether the handlers' failures
// say that something they depend on is down. While a queue is in an outage its
// messages wait here, before the handler, instead of taking the failure path: they
// spend no attempt, nothing is copied or held, and the subscriber takes no more from
// the broker than its prefetch. One at a time runs as a probe; the first success ends
// the outage. The engine runs every handler through runHandler, here: through its
// queue's outage, its panic recovered (run) and its error decided (decide).

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
)

// outages keeps the outage state of each work queue the engine has seen fail.
type outages struct {
	cfg    amqpretry.Outage // with defaults
	mu     sync.Mutex
	queues map[string]*outage
	// started, probes and down count outages begun, probes run, and the time spent
	// in outage by the ended ones, for Stats.
	started, probes, down atomic.Int64
}

// newOutages returns the outage state of an engine configured with cfg (with its
// defaults): nil when outage detection is off.
func newOutages(cfg amqpretry.Outage) *outages {
	if cfg.Off {
		return nil
	}
	return &outages{cfg: cfg}
}

// of returns queue's outage state.
func (o *outages) of(queue string) *outage {
	o.mu.Lock()
	defer o.mu.Unlock()
	q := o.queues[queue]
	if q == nil {
		if o.queues == nil {
			o.queues = map[string]*outage{}
		}
		q = &outage{cfg: o.cfg, runs: make([]outcome, o.cfg.Window), changed: make(chan struct{})}
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
type outage struct {
	cfg amqpretry.Outage
	mu  sync.Mutex

	// The latest runs: a ring of Window outcomes, and counts over it.
	runs                    []outcome
	next, filled            int
	failures, retryFailures int
	firstFailures           int // failed first deliveries (attempt 1)
	// consecutive has the messages of the failures in a row (up to Consecutive of
	// them: enough to tell), consecutiveRetry whether a retry is among the failures.
	// Messages, not runs: one message failing attempt after attempt is a poison, not
	// an outage.
	consecutive      map[string]struct{}
	consecutiveRetry bool
	// consecutiveFirst tells whether a first delivery is among them: new messages fail
	// too. Retries alone failing again (a wave of messages that fail twice) are not an
	// outage.
	consecutiveFirst bool

	down bool
	// isDown mirrors down, for runHandler to read without the lock: a message that
	// reads it false as the outage begins runs once more, as it would have a moment
	// earlier.
	isDown    atomic.Bool
	since     time.Time
	last      error // the latest failure that counted
	interval  time.Duration
	nextProbe time.Time // when the next probe may run
	probe     uint64    // the probe running, 0 for none
	probeSeq  uint64
	// changed is closed, and replaced, when a waiting message may act: the outage
	// ended, or a probe finished.
	changed chan struct{}
}

// outcome is a run's: whether it failed (and counted), whether it was a retry, and
// the message that failed.
type outcome struct {
	failed, retry bool
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
	q.next, q.filled, q.failures, q.retryFailures, q.firstFailures = 0, 0, 0, 0, 0
}

// errClosing is why a waiting message goes back to the broker.
var errClosing = errors.New("the Retry is closing")

// await waits while q is down. It returns the probe's token when this message is to
// run as the probe, 0 when the outage is over (or there is none); an error when ctx
// ends (its subscriber closes) or the engine closes.
func (q *outage) await(ctx context.Context, closing <-chan struct{}) (uint64, error) {
	for {
		q.mu.Lock()
		if !q.down {
			q.mu.Unlock()
			return 0, nil
		}
		changed := q.changed
		var wait time.Duration
		if q.probe == 0 {
			if wait = time.Until(q.nextProbe); wait <= 0 {
				q.probeSeq++
				q.probe = q.probeSeq
				q.mu.Unlock()
				return q.probe, nil
			}
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
			return 0, err
		}
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
// probe is the run's probe token (0: not a probe). It returns whether the message waits (the queue
// is down and the failure counted: no attempt spent), the edge it caused, and, on an
// edge, the outage's duration and last failure.
func (q *outage) record(msg string, err error, dec *amqpretry.Decision, attempt, maxAttempts int, probe uint64, now time.Time) (wait bool, e edge, lasted time.Duration, last error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if probe != 0 && q.probe == probe {
		q.probe = 0
		defer q.signal()
	}
	counts := err != nil && dec != nil && !dec.Permanent && dec.Delay <= 0
	if err != nil && !counts {
		return false, noEdge, 0, nil
	}
	// The run goes into the ring of latest runs, and the counts over it.
	retry := attempt >= 2
	o := outcome{failed: counts, retry: counts && retry}
	if counts {
		o.msg = msg
	}
	if q.filled == len(q.runs) {
		old := q.runs[q.next]
		if old.failed {
			q.failures--
			if old.retry {
				q.retryFailures--
			} else {
				q.firstFailures--
			}
		}
	} else {
		q.filled++
	}
	q.runs[q.next] = o
	q.next = (q.next + 1) % len(q.runs)
	if o.failed {
		q.failures++
		if o.retry {
			q.retryFailures++
		} else {
			q.firstFailures++
		}
	}
	if err == nil {
		if q.down {
			// The outage's failures are its own: the next one is judged on the
			// runs after it.
			q.forget()
		}
		clear(q.consecutive)
		q.consecutiveRetry, q.consecutiveFirst = false, false
		if q.down {
			q.down = false
			q.isDown.Store(false)
			q.signal()
			return false, ended, now.Sub(q.since), q.last
		}
		return false, noEdge, 0, nil
	}
	if q.consecutive == nil {
		q.consecutive = map[string]struct{}{}
	}
	if len(q.consecutive) < q.cfg.Consecutive {
		q.consecutive[msg] = struct{}{}
	}
	q.consecutiveRetry = q.consecutiveRetry || retry
	q.consecutiveFirst = q.consecutiveFirst || !retry
	q.last = err
	if q.down {
		if probe != 0 {
			q.interval = min(2*q.interval, q.cfg.MaxProbeInterval)
			q.nextProbe = now.Add(q.interval)
		}
		return true, noEdge, 0, nil
	}
	trip := dec.Unavailable ||
		(len(q.consecutive) >= q.cfg.Consecutive && q.consecutiveRetry && q.consecutiveFirst) ||
		(q.filled == len(q.runs) && float64(q.failures) >= q.cfg.Ratio*float64(q.filled) && q.retryFailures > 0 && q.firstFailures > 0 &&
			q.failedMessages(min(q.cfg.Consecutive, int(math.Ceil(q.cfg.Ratio*float64(len(q.runs)))))))
	if !trip {
		return false, noEdge, 0, nil
	}
	q.down, q.since = true, now
	q.isDown.Store(true)
	q.interval = q.cfg.ProbeInterval
	q.nextProbe = now.Add(q.interval)
	q.signal()
	return true, started, 0, err
}

// failedMessages tells whether the failures in the ring are of at least n different
// messages. q.mu is locked.
func (q *outage) failedMessages(n int) bool {
	seen := make(map[string]struct{}, n)
	for _, o := range q.runs[:q.filled] {
		if o.failed {
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
// runs only as the probe or once the outage is over, and a failure that counts costs
// no attempt: m waits and runs again. It returns the handler's result and its error's
// decision (nil for no error, or a failed hand-off of a Retry nearer the handler).
// Outside an outage it takes no lock but record's.
func (e *engine) runHandler(h message.HandlerFunc, m *message.Message, d delivery) ([]*message.Message, *amqpretry.Decision, error) {
	if e.outages == nil || !d.owned || d.queue == "" {
		return e.run(h, m, d, nil, 0)
	}
	q := e.outages.of(d.queue)
	attempt := d.attempt
	failedProbes := 0
	for {
		var probe uint64
		if q.isDown.Load() {
			var werr error
			if probe, werr = q.await(m.Context(), e.life.closing()); werr != nil {
				return nil, nil, e.outageGiveBack(m, d, q, werr)
			}
		}
		produced, dec, err := e.run(h, m, d, q, probe)
		wait, edge, lasted, last := q.record(m.UUID, err, dec, attempt, e.cfg.Policy.MaxAttempts, probe, time.Now())
		if probe != 0 {
			e.outages.probes.Add(1)
			e.observe(amqpretry.Event{Kind: amqpretry.EventProbe, Queue: d.queue, Attempt: attempt, Err: err})
		}
		if edge != noEdge {
			e.outageEdge(d, edge, lasted, last)
		}
		if !wait {
			return produced, dec, err
		}
		if probe != 0 {
			if failedProbes++; failedProbes >= probesPerMessage {
				// It may fail for reasons of its own: it takes the retry path, spending
				// an attempt, and the next message probes. A bad message never blocks
				// the queue.
				return produced, dec, err
			}
		}
	}
}

// probesPerMessage is how many failed probes in a row one message runs before it takes
// the retry path (amqpretry.Outage's doc).
const probesPerMessage = 3

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
