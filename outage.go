package amqpretry

import (
	"errors"
	"fmt"
	"time"
)

// Unavailable marks err as a sign that something the handler depends on is down (a
// database, an API), not that the message is bad: the work queue's outage begins at
// once (see Outage). The message's own run was an attempt and takes the retry path;
// the messages behind it wait in this process, spending no attempt, until a probe
// succeeds. Unavailable(nil) is nil.
//
// Watermill's CircuitBreaker middleware, while open, returns gobreaker's
// ErrOpenState or ErrTooManyRequests: those are read as Unavailable too.
func Unavailable(err error) error {
	if err == nil {
		return nil
	}
	return &unavailableError{err}
}

type unavailableError struct{ err error }

func (e *unavailableError) Error() string { return e.err.Error() }
func (e *unavailableError) Unwrap() error { return e.err }

// Outage says when the handlers of a work queue are judged to fail because something
// they depend on is down, and what happens then. An outage is per work queue, shared
// by every handler of this Retry that consumes it.
//
// The rules tell "these messages fail" from "their dependency is down" by the new
// messages: a dependency that is down fails every first delivery, while messages that
// fail for reasons of their own are some of the new ones, and then their retries fail.
// An outage begins when:
//   - a handler error is marked Unavailable (or an open CircuitBreaker refused the
//     message), at once; or
//   - Consecutive first deliveries fail in a row, no run succeeding among them, and a
//     retry (attempt 2 or later) fails too; or
//   - over the last 5 × Consecutive runs (the window: 50 by default), at least Ratio
//     of the runs and of the first deliveries fail, a retry among them.
//
// A storm of messages that each fail once is no outage (their retries succeed), nor a
// wave of retries failing while most new messages succeed. Every new message failing
// its first attempts looks like one. Errors marked Permanent or RetryAfter (or so
// decided by Classify) never count.
//
// While the outage lasts, the messages that reach the queue's handlers wait in this
// process, spending no attempt (the subscriber takes no more than its prefetch). One
// at a time runs as a probe, ProbeInterval after the outage began, then after a delay
// doubling up to 30 × ProbeInterval (30s by default): the waiting message with the most attempts left,
// never the latest probe's while another waits. Every run is an attempt, a probe's
// too: a failed one takes the retry path, and the next probe is another message. The
// first success ends the outage and every waiting message runs. A waiting message
// goes back to the broker when its subscriber or the Retry closes (on RabbitMQ 4.3's
// held retries the broker counts that as an attempt). docs/outage.md tells more.
type Outage struct {
	// Consecutive is how many first deliveries (of different messages) must fail in a
	// row, a retry failing too, to begin an outage; the window is 5 × Consecutive runs.
	// A negative Consecutive (-1) turns detection off. At most 100,000. Default: 10.
	Consecutive int
	// Ratio of failed runs, and of failed first deliveries, over the window that begins
	// an outage (with a retry among the failures), in (0, 1]. Default: 0.8.
	Ratio float64
	// ProbeInterval is the wait before the first probe of an outage; it doubles after
	// each failed probe, up to 30 × ProbeInterval. Default: 1s.
	ProbeInterval time.Duration
}

func (o Outage) withDefaults() Outage {
	if o.Consecutive == 0 {
		o.Consecutive = 10
	}
	if o.Ratio == 0 {
		o.Ratio = 0.8
	}
	if o.ProbeInterval == 0 {
		o.ProbeInterval = time.Second
	}
	return o
}

// maxConsecutive bounds Outage.Consecutive, so that its window fits in memory.
const maxConsecutive = 100_000

// validate reports every invalid field of o, which has its defaults; none when
// detection is off (a negative Consecutive).
func (o Outage) validate() error {
	if o.Consecutive < 0 {
		return nil
	}
	var errs []error
	if o.Consecutive > maxConsecutive {
		errs = append(errs, fmt.Errorf("Outage.Consecutive: %d, must be at most %d (its window, 5 × Consecutive runs, is kept per work queue): lower it, or set -1 to turn detection off", o.Consecutive, maxConsecutive))
	}
	if o.Ratio <= 0 || o.Ratio > 1 {
		errs = append(errs, fmt.Errorf("Outage.Ratio: %g, must be in (0, 1]: set it to a fraction such as 0.8 (0 means the default, 0.8), or turn detection off with Outage.Consecutive -1", o.Ratio))
	}
	if o.ProbeInterval < 0 {
		errs = append(errs, fmt.Errorf("Outage.ProbeInterval: %s, must not be negative: set it to how long to wait before the first probe (0 means the default, 1s)", o.ProbeInterval))
	}
	return errors.Join(errs...)
}
