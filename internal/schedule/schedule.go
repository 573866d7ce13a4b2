// Package schedule is the one home of what a retry policy can ask of a delay backend:
// the longest delay it can produce, given MaxAttempts and the schedule, and the field
// that decides it. Config.Validate checks it against the backend's limits, and the
// retry logs it at start.
package schedule

import (
	"fmt"
	"math"
	"time"
)

// Policy is amqpretry.Policy field for field, so that either converts to the other
// (schedule.Policy(cfg.Policy)); a field added to one must be added to the other. It
// has its defaults.
type Policy struct {
	MaxAttempts       int
	Delays            []time.Duration
	InitialInterval   time.Duration
	Multiplier        float64
	MaxInterval       time.Duration
	Jitter            float64
	NoJitter          bool
	Immediate         int
	ImmediateInterval time.Duration
}

// Retries is how many delayed retries of the schedule a message can get from the
// copying backend: every retry but those run in this process (Immediate) or held in
// the work queue (stages, its held retries), the schedule's n-th delay for the
// n-th of them. The engine sizes the retry after attempt a with the schedule's delay
// a - min(stages, a-1) (engine.fail), so the last, attempt MaxAttempts - 1, gets
// delay MaxAttempts - 1 - stages.
func (p Policy) Retries(stages int) int {
	return max(p.MaxAttempts-1-max(stages, 0), 0)
}

// Longest is the longest delay p can ask for in its first n delayed retries, jitter's
// upper bound included, and the field to change to shorten it: "Delays[i]", the
// longest entry within reach, or "MaxInterval", which caps the exponential schedule,
// jitter included. 0 and "" when n < 1.
func (p Policy) Longest(n int) (time.Duration, string) {
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
	jitter := p.Jitter
	if p.NoJitter {
		jitter = 0
	}
	if float64(interval)*(1+jitter) >= float64(p.MaxInterval) {
		return p.MaxInterval, "MaxInterval"
	}
	upper := time.Duration(math.Floor(float64(interval) + jitter*float64(interval)))
	return min(upper, p.MaxInterval), "MaxInterval"
}

// String describes p's schedule, for the log at start: "1s, ×2 per retry up to
// 10m0s, jitter ±20%", or "delays [1s 5s], the last repeating", after "2 immediate
// retries, then " when it has them.
func (p Policy) String() string {
	var s string
	switch {
	case len(p.Delays) > 0:
		s = fmt.Sprintf("delays %v, the last repeating", p.Delays)
	case p.Multiplier == 1:
		s = fmt.Sprintf("%s per retry", p.InitialInterval)
	default:
		s = fmt.Sprintf("%s, ×%g per retry up to %s", p.InitialInterval, p.Multiplier, p.MaxInterval)
	}
	if len(p.Delays) == 0 && !p.NoJitter && p.Jitter > 0 {
		s += fmt.Sprintf(", jitter ±%g%%", p.Jitter*100)
	}
	if p.Immediate > 0 {
		s = fmt.Sprintf("%d immediate retries %s apart, then %s", p.Immediate, p.ImmediateInterval, s)
	}
	return s
}

// HandoffPause is the pause after the n-th failed hand-off of a message in a row (1 is
// the first): 100ms doubling to 5s, so that nothing is redelivered at wire speed. The
// README's figures about the hand-off's pacing are checked against it.
func HandoffPause(n int) time.Duration {
	const first, most = 100 * time.Millisecond, 5 * time.Second
	if n > 6 {
		return most
	}
	return min(first<<max(n-1, 0), most)
}
