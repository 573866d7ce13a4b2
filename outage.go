package amqpretry

import (
	"errors"
	"fmt"
	"time"
)

// Unavailable marks err as a sign that something the handler depends on is down (a
// database, an API), not that the message is bad: the work queue's outage begins at
// once (see Outage), and the message waits in this process, spending no attempt, until
// a probe succeeds. Unavailable(nil) is nil.
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
// It begins when:
//   - a handler error is marked Unavailable (or an open CircuitBreaker refused the
//     message), at once; or
//   - failures in a row of Consecutive different messages, or a failure ratio of at
//     least Ratio over the last Window runs, failures of Consecutive different
//     messages (or of Ratio × Window, if fewer), and both a retry (attempt 2 or later)
//     and a first delivery among the failures: old and new messages fail. A storm of
//     messages that each fail once and then succeed is not an outage, since their
//     retries succeed; nor is a wave of retries failing again alone; nor are a few
//     messages that fail attempt after attempt, however many runs they fail: they are
//     poisons.
//
// Errors marked Permanent or RetryAfter (or so decided by Classify) never count: they
// are about the message. While the outage lasts, the failing message and every message
// that reaches the queue's handlers wait in this process (the subscriber then takes no
// more than its prefetch from the broker), spending no attempt, and nothing is copied
// or held. One of them at a time is run as a probe, ProbeInterval after the outage
// began, then after a delay doubling up to MaxProbeInterval; a failed probe costs its
// message no attempt, but a message that fails three probes in a row then takes the
// retry path (spending an attempt), so that a message failing for reasons of its own
// never blocks its queue: the next message probes. The first success ends the outage,
// whose failures then no longer count, and every waiting message runs at once. A
// waiting message is given back to the broker (nacked with requeue; on AMQP 1.0,
// released) when its subscriber closes or the Retry closes. The broker counts that
// return as a failed delivery only on a work queue that holds retries on RabbitMQ 4.3
// (delayed-retry, HeldRetries: their attempt is counted from x-acquired-count): there
// the message comes back one attempt later, after the queue's delay, as do the
// messages the subscriber had prefetched. docs/outage.md tells more: the rules'
// arithmetic, the costs, measurements, and where Watermill's CircuitBreaker, Throttle
// and Retry go.
type Outage struct {
	// Off turns outage detection off: every failure takes the retry path.
	Off bool
	// Consecutive is how many different messages must fail in a row to begin an
	// outage (with a retry and a first delivery among the failures); over the Window,
	// that many different messages must be among the failures. Default: 10.
	Consecutive int
	// Ratio of failed runs over the last Window runs that begins an outage (with a
	// retry and a first delivery among the failures), in (0, 1]. Default: 0.8.
	Ratio float64
	// Window is how many of the latest runs Ratio is measured over. Default: 50.
	Window int
	// ProbeInterval is the wait before the first probe of an outage. Default: 1s.
	ProbeInterval time.Duration
	// MaxProbeInterval caps the wait between probes, which doubles after each failed
	// probe. Default: 30s.
	MaxProbeInterval time.Duration
}

func (o Outage) withDefaults() Outage {
	if o.Consecutive == 0 {
		o.Consecutive = 10
	}
	if o.Ratio == 0 {
		o.Ratio = 0.8
	}
	if o.Window == 0 {
		o.Window = 50
	}
	if o.ProbeInterval == 0 {
		o.ProbeInterval = time.Second
	}
	if o.MaxProbeInterval == 0 {
		o.MaxProbeInterval = 30 * time.Second
	}
	return o
}

// validate reports every invalid field of o, which has its defaults.
func (o Outage) validate() error {
	if o.Off {
		return nil
	}
	var errs []error
	if o.Consecutive < 1 {
		errs = append(errs, fmt.Errorf("Outage.Consecutive: %d, must be at least 1 (0 means the default, 10; Outage.Off turns detection off)", o.Consecutive))
	}
	if o.Ratio <= 0 || o.Ratio > 1 {
		errs = append(errs, fmt.Errorf("Outage.Ratio: %g, must be in (0, 1] (0 means the default, 0.8)", o.Ratio))
	}
	if o.Window < 1 {
		errs = append(errs, fmt.Errorf("Outage.Window: %d, must be at least 1 (0 means the default, 50)", o.Window))
	}
	if o.ProbeInterval < 0 {
		errs = append(errs, fmt.Errorf("Outage.ProbeInterval: %s, must not be negative (0 means the default, 1s)", o.ProbeInterval))
	}
	if o.MaxProbeInterval < o.ProbeInterval {
		errs = append(errs, fmt.Errorf("Outage.MaxProbeInterval: %s, must not be shorter than Outage.ProbeInterval (%s)", o.MaxProbeInterval, o.ProbeInterval))
	}
	return errors.Join(errs...)
}
