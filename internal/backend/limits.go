package backend

import (
	"fmt"
	"time"
)

// Limits are the delays a backend holds.
type Limits struct {
	// Longest is the longest delay it holds; 0 for no limit.
	Longest time.Duration
	// Refuses tells whether a longer delay is refused (delay.ErrDelayTooLong), rather
	// than held for Longest (ttl-tiers' longest tier).
	Refuses bool
	// Fix is how to raise Longest, or "".
	Fix string
	// Text describes the limits, for the log at start.
	Text string
}

// LimitsOf returns b's limits.
func LimitsOf(b Backend) Limits {
	switch b := b.(type) {
	case *ttlTiers:
		longest := b.tiers[len(b.tiers)-1]
		return Limits{Longest: longest, Fix: "add a longer tier to Tiers",
			Text: fmt.Sprintf("%d tiers from %s to %s, a delay snaps up to the next, a longer one is held %s", len(b.tiers), b.tiers[0], longest, longest)}
	case *binaryLevels:
		return Limits{Longest: b.maxDelay(), Refuses: true, Fix: "raise Levels (Prefix with it)",
			Text: fmt.Sprintf("1s steps up to %s (Levels %d), a longer delay is refused", b.maxDelay(), b.levels)}
	case *delayedExchange:
		return Limits{Longest: maxPluginDelay, Refuses: true, Text: fmt.Sprintf("1ms steps up to %s (the plugin's 2^32-1 ms), a longer delay is refused", maxPluginDelay)}
	case delayedRetry:
		return Limits{Text: fmt.Sprintf("one constant delay, %s (DelayedRetryDelay), whatever is asked", b.delay)}
	case deliveryTime:
		return Limits{Text: "1ms steps, any delay"}
	case *memory:
		return Limits{Text: "any delay, held in this process"}
	}
	return Limits{Text: "unknown"}
}
