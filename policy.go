package amqpretry

import (
	"errors"
	"fmt"
	"time"

	"github.com/amqpretry/amqpretry/internal/backend"
)

// Policy says how often and how long apart a message is retried. The zero value, after
// defaults, is safe: 5 attempts, 1s doubling to at most 10m, ±20% jitter.
type Policy struct {
	// MaxAttempts is how many times the handler may run for one message, the first
	// delivery included (Watermill's MaxRetries + 1); after the last the message is
	// poisoned. Default: 5.
	MaxAttempts int
	// Delays is the schedule: the delay before attempt n+1 is Delays[n-1], the last
	// repeating (the package doc, The schedule). Default: Exponential(time.Second, 2,
	// 10*time.Minute); on delayed-retry, its delay (another is refused).
	Delays []time.Duration
	// Jitter randomises each delay by up to this fraction either way (below 1), never
	// past the longest of Delays; a negative Jitter (-1) means none. Default: 0.2.
	Jitter float64
	// Immediate is how many retries run at once, in this process, after a failed first
	// delivery, before the delayed ones (which start at Delays[0]). Default: 0.
	Immediate int
}

// Exponential returns the schedule that starts at initial and grows by multiplier at
// each step (fractions kept), each delay capped at max, ending with max, which then
// repeats: Exponential(time.Second, 2, 10*time.Minute), the default, is 1s, 2s, 4s, …,
// 8m32s, 10m. A multiplier of 1 or less, an initial of 0 or less, or one of max or
// more, gives the one delay min(initial, max); past 64 growing steps it ends at max.
func Exponential(initial time.Duration, multiplier float64, max time.Duration) []time.Duration {
	return backend.Exponential(initial, multiplier, max)
}

// defaultMaxAttempts is MaxAttempts' default.
const defaultMaxAttempts = 5

func (p Policy) withDefaults() Policy {
	if p.MaxAttempts == 0 {
		p.MaxAttempts = defaultMaxAttempts
	}
	if len(p.Delays) == 0 {
		p.Delays = backend.DefaultDelays() // Delays' default
	}
	if p.Jitter == 0 {
		p.Jitter = defaultJitter
	}
	return p
}

// defaultJitter is Jitter's default.
const defaultJitter = 0.2

// validate reports every invalid field of p, which has its defaults, each line
// naming its field as "Policy.MaxAttempts: -1, must be at least 1".
func (p Policy) validate() error {
	var errs []error
	if p.MaxAttempts < 1 {
		errs = append(errs, fmt.Errorf("Policy.MaxAttempts: %d, must be at least 1 (0 means the default, %d)", p.MaxAttempts, defaultMaxAttempts))
	}
	for i, d := range p.Delays {
		if d < 0 {
			errs = append(errs, fmt.Errorf("Policy.Delays[%d]: %s, must not be negative: set it to 0 or more (Exponential builds a growing schedule)", i, d))
		}
	}
	if p.Jitter >= 1 {
		errs = append(errs, fmt.Errorf("Policy.Jitter: %g, must be below 1 (a fraction of the delay, either way): set it below 1, 0 for the default %g, or -1 for no jitter", p.Jitter, defaultJitter))
	}
	if p.Immediate < 0 {
		errs = append(errs, fmt.Errorf("Policy.Immediate: %d, must not be negative: set it to 0 (none) or more", p.Immediate))
	}
	return errors.Join(errs...)
}

// values is p, with its defaults, as internal/backend takes it (backend.Policy: the
// schedule's longest delay and its description are computed there).
func (p Policy) values() backend.Policy {
	return backend.Policy{MaxAttempts: p.MaxAttempts, Delays: p.Delays, Jitter: p.Jitter, Immediate: p.Immediate}
}
