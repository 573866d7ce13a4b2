package amqpretry

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"
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
	if multiplier <= 1 || initial >= max || initial <= 0 {
		return []time.Duration{min(initial, max)}
	}
	var ds []time.Duration
	for d := initial; d < max && len(ds) < maxExponentialSteps; {
		ds = append(ds, d)
		next := float64(d) * multiplier
		if next >= float64(max) {
			break
		}
		d = time.Duration(next)
	}
	return append(ds, max)
}

// maxExponentialSteps bounds the schedule Exponential returns.
const maxExponentialSteps = 64

// defaultDelays is Delays' default.
func defaultDelays() []time.Duration { return Exponential(time.Second, 2, 10*time.Minute) }

// defaultMaxAttempts is MaxAttempts' default.
const defaultMaxAttempts = 5

func (p Policy) withDefaults() Policy {
	if p.MaxAttempts == 0 {
		p.MaxAttempts = defaultMaxAttempts
	}
	if len(p.Delays) == 0 {
		p.Delays = defaultDelays()
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

// longest is the longest delay p can ask of the copying backend, after stages retries
// held in the work queue (delay.HeldRetries), jitter's upper bound included (never
// past the longest entry), and the entry of Delays that decides it, i ("Delays[i]"),
// the longest within reach. 0 and -1 when it asks for none. Config.Validate checks it against the backend's limits, and
// the middleware logs it at start. p has its defaults.
func (p Policy) longest(stages int) (time.Duration, int) {
	// The copying backend's retries: every retry but those run in this process
	// (Immediate) or held in the work queue. The engine sizes the retry after attempt
	// a with the schedule's delay a - min(stages, a-1), so the last, attempt
	// MaxAttempts - 1, gets delay MaxAttempts - 1 - stages.
	n := max(p.MaxAttempts-1-max(p.Immediate+stages, 0), 0)
	if n < 1 || len(p.Delays) == 0 {
		return 0, -1
	}
	var longest time.Duration
	at := -1
	for i, d := range p.Delays[:min(n, len(p.Delays))] {
		if at < 0 || d > longest {
			longest, at = d, i
		}
	}
	return min(jittered(longest, p.jitter()), slices.Max(p.Delays)), at
}

// jittered is the longest delay d gives with jitter j before the cap: the engine draws
// from [d - j·d, d + j·d], in whole nanoseconds, then caps it at the longest entry.
func jittered(d time.Duration, j float64) time.Duration {
	return time.Duration(math.Floor(float64(d) + j*float64(d)))
}

// describe describes p's schedule, for the log at start: "1s, ×2 per retry up to
// 10m0s, jitter ±20%" (the default), or "delays [1s 5s], the last repeating", after
// "2 immediate retries, then " when it has them. p has its defaults.
func (p Policy) describe() string {
	var s string
	switch {
	case slices.Equal(p.Delays, defaultDelays()):
		s = "1s, ×2 per retry up to 10m0s"
	default:
		s = fmt.Sprintf("delays %v, the last repeating", p.Delays)
	}
	if p.Jitter > 0 {
		s += fmt.Sprintf(", jitter ±%g%%", p.Jitter*100)
	}
	if p.Immediate > 0 {
		s = fmt.Sprintf("%d immediate retries, then %s", p.Immediate, s)
	}
	return s
}
