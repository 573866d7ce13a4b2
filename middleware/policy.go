package middleware

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Policy says how often and how long apart a message is retried. The zero value, after
// defaults, is safe: 5 attempts, 1s doubling to at most 10m, 20% jitter.
type Policy struct {
	// MaxAttempts is how many times the handler may run for one message, the first
	// delivery included; after the last the message goes to the poison queue.
	// Default: 5. Must be at least 1.
	MaxAttempts int
	// Delays, if set, is the explicit schedule: the delay before attempt n+1 is
	// Delays[n-1], and the last entry repeats. It replaces the exponential settings
	// below, and no jitter is applied.
	Delays []time.Duration
	// InitialInterval is the delay before the second attempt. Default: 1s.
	InitialInterval time.Duration
	// Multiplier grows the delay after each attempt; fractions are kept (1.5 means
	// 1s, 1.5s, 2.25s). Default: 2. Must be at least 1.
	Multiplier float64
	// MaxInterval caps each delay of the exponential schedule, jitter included. It does
	// not cap Delays or a RetryAfter, which are taken as given (the backend still
	// refuses a delay it cannot hold). Default: 10m.
	MaxInterval time.Duration
	// Jitter randomises each delay by up to this fraction either way, so that messages
	// that failed together do not come back together. Default: 0.2. Must be in [0, 1).
	Jitter float64
	// NoJitter turns jitter off (Jitter is then ignored). Default: false.
	NoJitter bool
	// Immediate is how many retries run at once, in this process, when a message fails
	// on its first delivery, before any broker-side delayed retry: for blips such as a
	// deadlock victim or a 50 ms network hiccup. They count towards MaxAttempts and
	// Attempt numbers them like the others (the first delayed retry is attempt
	// Immediate+2, after the schedule's first delay). An error marked Permanent or
	// RetryAfter, or decided so by Classify, skips them. Default: 0.
	Immediate int
	// ImmediateInterval is the pause before each immediate retry. Default: 0.
	ImmediateInterval time.Duration
}

// DefaultMaxAttempts is Policy.MaxAttempts's default.
const DefaultMaxAttempts = 5

func (p *Policy) setDefaults() {
	if p.MaxAttempts == 0 {
		p.MaxAttempts = DefaultMaxAttempts
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
	if p.Jitter == 0 && !p.NoJitter {
		p.Jitter = 0.2
	}
	if p.NoJitter {
		p.Jitter = 0
	}
}

// Validate reports every invalid field, each named. Zero fields are checked as their
// defaults.
func (p Policy) Validate() error {
	p.setDefaults()
	var errs []error
	if p.MaxAttempts < 1 {
		errs = append(errs, fmt.Errorf("MaxAttempts: %d, must be at least 1", p.MaxAttempts))
	}
	for i, d := range p.Delays {
		if d < 0 {
			errs = append(errs, fmt.Errorf("Delays[%d]: %s is negative", i, d))
		}
	}
	if p.InitialInterval < 0 {
		errs = append(errs, fmt.Errorf("InitialInterval: %s is negative", p.InitialInterval))
	}
	if p.Multiplier < 1 {
		errs = append(errs, fmt.Errorf("Multiplier: %g, must be at least 1", p.Multiplier))
	}
	if p.MaxInterval < p.InitialInterval {
		errs = append(errs, fmt.Errorf("MaxInterval: %s is shorter than InitialInterval %s", p.MaxInterval, p.InitialInterval))
	}
	if p.Jitter < 0 || p.Jitter >= 1 {
		errs = append(errs, fmt.Errorf("Jitter: %g, must be in [0, 1)", p.Jitter))
	}
	if p.Immediate < 0 {
		errs = append(errs, fmt.Errorf("Immediate: %d is negative", p.Immediate))
	}
	if p.ImmediateInterval < 0 {
		errs = append(errs, fmt.Errorf("ImmediateInterval: %s is negative", p.ImmediateInterval))
	}
	return errors.Join(errs...)
}

// Longest returns the longest delay the policy can ask for (zero fields count as their
// defaults): the longest of Delays, or MaxInterval.
func (p Policy) Longest() time.Duration {
	p.setDefaults()
	if len(p.Delays) > 0 {
		return slices.Max(p.Delays)
	}
	return p.MaxInterval
}

// Delay returns the delay before the delayed retry after the failed-th delayed round
// (from 1: Delay(1) is the first delay, InitialInterval for the exponential schedule).
// Zero fields count as their defaults.
func (p Policy) Delay(failed int) time.Duration {
	p.setDefaults()
	failed = max(failed, 1)
	if len(p.Delays) > 0 {
		return p.Delays[min(failed, len(p.Delays))-1]
	}
	b := &backoff.ExponentialBackOff{
		InitialInterval:     p.InitialInterval,
		RandomizationFactor: p.Jitter,
		Multiplier:          p.Multiplier,
		MaxInterval:         p.MaxInterval,
		Stop:                backoff.Stop,
		Clock:               backoff.SystemClock,
	}
	b.Reset()
	var d time.Duration
	for range failed {
		d = b.NextBackOff()
	}
	return min(d, p.MaxInterval)
}

// delayAfter returns the delay after attempt number attempt failed, past the immediate
// retries: the first delayed retry gets Delay(1).
func (p Policy) delayAfter(attempt int) time.Duration {
	return p.Delay(attempt - min(p.Immediate, attempt-1))
}
