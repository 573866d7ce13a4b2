package amqpretry

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Policy says how often and how long apart a message is retried. The zero value, after
// defaults, is safe: 5 attempts, 1s doubling to at most 10m, ±20% jitter.
type Policy struct {
	// MaxAttempts is how many times the handler may run for one message, the first
	// delivery included; after the last the message is poisoned. Watermill's
	// middleware.Retry counts retries instead: MaxAttempts = MaxRetries + 1, and 1
	// means no retry. 0 means the default, 5 (not Watermill's "no retries"); the
	// effective value is logged at start. Default: 5.
	MaxAttempts int
	// Delays, if set, is the explicit schedule: the delay before attempt n+1 is
	// Delays[n-1], and the last entry repeats. It replaces the exponential settings
	// below; no jitter is applied. On ttl-tiers, a delay longer than the longest tier
	// is parked again when it comes back, until it is due: never early.
	//
	// On Backend delayed-retry, which holds every retry for one constant delay (its
	// Delay), the zero value of each schedule field below means
	// that delay; a value that would ask for another delay, a growth or a jitter is
	// refused by Config.Validate, naming the fix, rather than ignored. With
	// delay.HeldRetries the held retries are its delay apart, and the whole
	// schedule applies to Backend's retries after them.
	Delays []time.Duration
	// InitialInterval is the delay before the first delayed retry. Default: 1s; on
	// delayed-retry, its delay (another value is refused).
	InitialInterval time.Duration
	// Multiplier grows the delay after each attempt; fractions are kept (1.5 gives 1s,
	// 1.5s, 2.25s). At least 1. Default: 2; on delayed-retry, 1 (its one delay), and
	// any other value, 2 included, is refused.
	Multiplier float64
	// MaxInterval caps each delay of the exponential schedule, jitter included (not
	// Delays, nor a RetryAfter). A policy delay longer than the backend keeps is
	// refused by Config.Validate on binary-levels and delayed-exchange; on ttl-tiers
	// it is parked again when it comes back, until it is due. Default: 10m; on
	// delayed-retry, unused (a value shorter than its delay is refused).
	MaxInterval time.Duration
	// Jitter randomises each delay by up to this fraction either way, below 1, so that
	// messages that failed together do not come back together; a negative Jitter (-1)
	// means none. Default: 0.2; on delayed-retry, none (a value above 0 is refused).
	Jitter float64
	// Immediate is how many retries run at once, in this process, when a message fails
	// on its first delivery, before the delayed ones: for blips such as a deadlock
	// victim. They count towards MaxAttempts; the first delayed retry after them gets
	// the schedule's first delay. An error marked Permanent or RetryAfter, or so decided
	// by Classify, skips them. Default: 0.
	//
	// The schedule (Delays, or InitialInterval onwards) is the delayed stage's: it
	// starts after the retries of a first stage, Immediate or delay.HeldRetries,
	// at its first delay. With delay.HeldRetries(2, 0, nil) and the defaults, attempts 2 and 3 come
	// the held retries' delay after the failure, attempt 4 about 1s after, attempt 5 about 2s.
	Immediate int
	// ImmediateInterval is the pause before each immediate retry. Default: 0.
	ImmediateInterval time.Duration
}

// defaultMaxAttempts is MaxAttempts' default.
const defaultMaxAttempts = 5

func (p Policy) withDefaults() Policy {
	if p.MaxAttempts == 0 {
		p.MaxAttempts = defaultMaxAttempts
	}
	if p.InitialInterval == 0 {
		p.InitialInterval = time.Second
	}
	if p.Multiplier == 0 {
		p.Multiplier = 2
	}
	if p.MaxInterval == 0 {
		p.MaxInterval = 10 * time.Minute
	}
	if p.Jitter == 0 {
		p.Jitter = defaultJitter
	}
	return p
}

// defaultJitter is Jitter's default.
const defaultJitter = 0.2

// jitter is the fraction p randomises each delay by: Jitter, or 0 for a negative one
// (none). p has its defaults.
func (p Policy) jitter() float64 { return max(p.Jitter, 0) }

// validate reports every invalid field of p, which has its defaults, each line
// naming its field as "Policy.MaxAttempts: -1, must be at least 1".
func (p Policy) validate() error {
	var errs []error
	if p.MaxAttempts < 1 {
		errs = append(errs, fmt.Errorf("Policy.MaxAttempts: %d, must be at least 1 (0 means the default, %d)", p.MaxAttempts, defaultMaxAttempts))
	}
	for i, d := range p.Delays {
		if d < 0 {
			errs = append(errs, fmt.Errorf("Policy.Delays[%d]: %s, must not be negative", i, d))
		}
	}
	if p.InitialInterval < 0 {
		errs = append(errs, fmt.Errorf("Policy.InitialInterval: %s, must not be negative", p.InitialInterval))
	}
	if p.Multiplier < 1 {
		errs = append(errs, fmt.Errorf("Policy.Multiplier: %g, must be at least 1", p.Multiplier))
	}
	if p.MaxInterval < p.InitialInterval && p.InitialInterval >= 0 {
		errs = append(errs, fmt.Errorf("Policy.MaxInterval: %s, must not be shorter than Policy.InitialInterval (%s)", p.MaxInterval, p.InitialInterval))
	}
	if p.Jitter >= 1 {
		errs = append(errs, fmt.Errorf("Policy.Jitter: %g, must be below 1 (a fraction of the delay, either way): set it below 1, 0 for the default %g, or -1 for no jitter", p.Jitter, defaultJitter))
	}
	if p.Immediate < 0 {
		errs = append(errs, fmt.Errorf("Policy.Immediate: %d, must not be negative", p.Immediate))
	}
	if p.ImmediateInterval < 0 {
		errs = append(errs, fmt.Errorf("Policy.ImmediateInterval: %s, must not be negative", p.ImmediateInterval))
	}
	return errors.Join(errs...)
}

// longest is the longest delay p can ask of the copying backend, after stages retries
// held in the work queue (delay.HeldRetries), jitter's upper bound included, and the
// field that decides it: "Delays[i]", the longest entry within reach, or
// "MaxInterval", which caps the exponential schedule. 0 and "" when it asks for none.
// Config.Validate checks it against the backend's limits, and the middleware logs it
// at start. p has its defaults.
func (p Policy) longest(stages int) (time.Duration, string) {
	// The copying backend's retries: every retry but those run in this process
	// (Immediate) or held in the work queue. The engine sizes the retry after attempt
	// a with the schedule's delay a - min(stages, a-1), so the last, attempt
	// MaxAttempts - 1, gets delay MaxAttempts - 1 - stages.
	n := max(p.MaxAttempts-1-max(p.Immediate+stages, 0), 0)
	if n < 1 {
		return 0, ""
	}
	if len(p.Delays) > 0 {
		var longest time.Duration
		field := ""
		for i, d := range p.Delays[:min(n, len(p.Delays))] {
			if field == "" || d > longest {
				longest, field = d, fmt.Sprintf("Delays[%d]", i)
			}
		}
		return longest, field
	}
	// The interval of the n-th delay, grown as github.com/cenkalti/backoff grows it
	// (the engine's delayOf): set to MaxInterval once it would pass it.
	interval := p.InitialInterval
	for i := 1; i < n && interval < p.MaxInterval; i++ {
		next := p.MaxInterval
		if float64(interval) < float64(p.MaxInterval)/p.Multiplier {
			next = time.Duration(float64(interval) * p.Multiplier)
		}
		if next == interval {
			break // Multiplier 1: constant
		}
		interval = next
	}
	// backoff draws from [interval - delta, interval + delta + 1ns) with delta =
	// Jitter * interval, truncated to whole nanoseconds; the engine caps the draw at
	// MaxInterval.
	jitter := p.jitter()
	if float64(interval)*(1+jitter) >= float64(p.MaxInterval) {
		return p.MaxInterval, "MaxInterval"
	}
	upper := time.Duration(math.Floor(float64(interval) + jitter*float64(interval)))
	return min(upper, p.MaxInterval), "MaxInterval"
}

// describe describes p's schedule, for the log at start: "1s, ×2 per retry up to
// 10m0s, jitter ±20%", or "delays [1s 5s], the last repeating", after "2 immediate
// retries, then " when it has them. p has its defaults.
func (p Policy) describe() string {
	var s string
	switch {
	case len(p.Delays) > 0:
		s = fmt.Sprintf("delays %v, the last repeating", p.Delays)
	case p.Multiplier == 1:
		s = fmt.Sprintf("%s per retry", p.InitialInterval)
	default:
		s = fmt.Sprintf("%s, ×%g per retry up to %s", p.InitialInterval, p.Multiplier, p.MaxInterval)
	}
	if len(p.Delays) == 0 && p.Jitter > 0 {
		s += fmt.Sprintf(", jitter ±%g%%", p.Jitter*100)
	}
	if p.Immediate > 0 {
		s = fmt.Sprintf("%d immediate retries %s apart, then %s", p.Immediate, p.ImmediateInterval, s)
	}
	return s
}
