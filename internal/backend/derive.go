package backend

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/topology"
)

// Input is what an amqpretry.Config, with its defaults, gives Derive: its exported
// fields that decide what it derives, as plain values (Derive cannot import the root
// package). The root package builds it for Validate, Plan and ApplyCommand; the
// middleware, its transports and ops through internal/derived.Of.
type Input struct {
	// Backend is Config.Backend, a delay.Backend value.
	Backend interface{ Name() string }
	Prefix  string
	// PoisonQueue and Topology are the Config's; Ordered: its OrderKey is set.
	PoisonQueue string
	Topology    topology.Mode
	Ordered     bool
	Policy      Policy
	// Apply is the Config's ApplyCommand, for the fix of a topology error.
	Apply func(workQueues ...string) string
}

// Policy is an amqpretry.Policy's fields, with its defaults.
type Policy struct {
	MaxAttempts int
	Delays      []time.Duration
	Jitter      float64
	Immediate   int
}

// Derive returns what in derives beyond its fields, each fact computed here only: the
// backend it names, opened for planning, and what it can do, the one held in front of
// it, how to fix a topology error, what its work queues need, the schedule. Invalid
// fields are amqpretry.Config.Validate's to report: Derive only records the backend's
// own error (Err).
func Derive(in Input) Derived {
	s := Setup{Prefix: in.Prefix}
	var value any = in.Backend
	v := Derived{Name: in.Backend.Name(), Schedule: in.Policy.describe(), Setup: s}
	v.Backend, v.Err = Open(value, s)
	var held Opener
	if f, ok := value.(Fronted); ok && v.Err == nil {
		v.HeldRetries, held, value = f.Front()
	}
	v.Open = func(env Env) (Backend, error) {
		s := s
		s.Env = env
		return Open(value, s)
	}
	if b := v.Backend; b != nil {
		v.Caps = b.Caps()
		_, v.AMQP1 = b.(AMQP1)
		if l, ok := b.(InProcess); ok {
			v.InProcess, v.Local = true, l.Local()
		}
		if w, ok := b.(WorkQueueArgser); ok {
			v.WorkQueueArgs = w.WorkQueueArgs()
		}
	}
	v.Longest, _ = in.Policy.Longest(v.HeldRetries)
	var retryDelay time.Duration
	if held != nil {
		if h, err := Open(held, Setup{}); err == nil {
			v.Held = h
			v.WorkQueueArgs = h.(WorkQueueArgser).WorkQueueArgs()
			retryDelay = h.(Constant).OneDelay()
		}
		v.Schedule = fmt.Sprintf("%d retries held in the work queue %s apart, then %s", v.HeldRetries, retryDelay, v.Schedule)
	}
	if v.WorkQueueArgs != nil {
		// Past its delivery limit a quorum queue drops a message it cannot deliver,
		// unless it has a dead-letter target: the poison queue.
		v.WorkQueueArgs = WithDeadLetter(v.WorkQueueArgs, in.PoisonQueue)
	}
	if k, ok := v.Backend.(Constant); ok {
		retryDelay = k.OneDelay()
		v.Schedule = fmt.Sprintf("every retry held in the work queue %s (its delay)", retryDelay)
		v.Longest = retryDelay
	}
	v.Fix = declare.Fix{Mode: in.Topology, HoldsRetries: v.WorkQueueArgs != nil, RetryDelay: retryDelay, Backend: v.Name, PoisonQueue: in.PoisonQueue, Apply: in.Apply, Ordered: in.Ordered}
	return v
}

// Exponential is amqpretry.Exponential: the schedule that starts at initial and grows
// by multiplier at each step, each delay capped at max, ending with max.
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

// DefaultDelays is Policy.Delays' default.
func DefaultDelays() []time.Duration { return Exponential(time.Second, 2, 10*time.Minute) }

// JitterOf is the fraction p randomises each delay by: Jitter, or 0 for a negative one
// (none).
func (p Policy) JitterOf() float64 { return max(p.Jitter, 0) }

// Longest is the longest delay p can ask of the copying backend, after stages retries
// held in the work queue (delay.HeldRetries), jitter's upper bound included (never
// past the longest entry), and the entry of Delays that decides it, i ("Delays[i]"),
// the longest within reach. 0 and -1 when it asks for none. amqpretry.Config.Validate
// checks it against the backend's limits, and the middleware logs it at start.
func (p Policy) Longest(stages int) (time.Duration, int) {
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
	return min(Jittered(longest, p.JitterOf()), slices.Max(p.Delays)), at
}

// Jittered is the longest delay d gives with jitter j before the cap: the engine draws
// from [d - j·d, d + j·d], in whole nanoseconds, then caps it at the longest entry.
func Jittered(d time.Duration, j float64) time.Duration {
	return time.Duration(math.Floor(float64(d) + j*float64(d)))
}

// describe describes p's schedule, for the log at start: "1s, ×2 per retry up to
// 10m0s, jitter ±20%" (the default), or "delays [1s 5s], the last repeating", after
// "2 immediate retries, then " when it has them.
func (p Policy) describe() string {
	var s string
	switch {
	case slices.Equal(p.Delays, DefaultDelays()):
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
