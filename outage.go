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
//   - over the last Window runs, at least Ratio of the runs and of the first
//     deliveries fail, a retry among them.
//
// A storm of messages that each fail once is no outage (their retries succeed), nor a
// wave of retries failing while most new messages succeed. Every new message failing
// its first attempts looks like one. Errors marked Permanent or RetryAfter (or so
// decided by Classify) never count.
//
// While the outage lasts, the messages that reach the queue's handlers wait in this
// process, spending no attempt (the subscriber takes no more than its prefetch). One
// at a time runs as a probe, ProbeInterval after the outage began, then after a delay
// doubling up to MaxProbeInterval: the waiting message with the most attempts left,
// never the latest probe's while another waits. Every run is an attempt, a probe's
// too: a failed one takes the retry path, and the next probe is another message. The
// first success ends the outage and every waiting message runs. A waiting message
// goes back to the broker when its subscriber or the Retry closes (on RabbitMQ 4.3's
// held retries the broker counts that as an attempt). docs/outage.md tells more.
type Outage struct {
	// Off turns outage detection off: every failure takes the retry path.
	Off bool
	// Consecutive is how many first deliveries (of different messages) must fail in
	// a row to begin an outage, with a retry failing too; over the Window, how many
	// must be among the failures (or Ratio × Window, if fewer). Default: 10.
	Consecutive int
	// Ratio of failed runs, and of failed first deliveries, over the last Window runs
	// that begins an outage (with a retry among the failures), in (0, 1]. Default:
	// 0.8.
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
