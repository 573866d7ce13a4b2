package delay

import (
	"fmt"

	"github.com/amqpretry/amqpretry/internal/backend"
)

// limitsOf returns b's limits (backend.LimitsOf).
func limitsOf(b backend.Backend) backend.Limits {
	switch b := b.(type) {
	case *ttlTiers:
		longest := b.tiers[len(b.tiers)-1]
		return backend.Limits{Longest: longest, Fix: "add a longer tier to Tiers",
			Text: fmt.Sprintf("%d tiers from %s to %s, a delay snaps up to the next, a longer one is held %s", len(b.tiers), b.tiers[0], longest, longest)}
	case *binaryLevels:
		return backend.Limits{Longest: b.maxDelay(), Refuses: true, Fix: "raise Levels (Prefix with it)",
			Text: fmt.Sprintf("1s steps up to %s (Levels %d), a longer delay is refused", b.maxDelay(), b.levels)}
	case *delayedExchange:
		return backend.Limits{Longest: maxPluginDelay, Refuses: true, Text: fmt.Sprintf("1ms steps up to %s (the plugin's 2^32-1 ms), a longer delay is refused", maxPluginDelay)}
	case delayedRetry:
		return backend.Limits{Text: fmt.Sprintf("one constant delay, %s (DelayedRetryDelay), whatever is asked", b.delay)}
	case deliveryTime:
		return backend.Limits{Text: "1ms steps, any delay"}
	case *memory:
		return backend.Limits{Text: "any delay, held in this process"}
	}
	return backend.Limits{Text: "unknown"}
}
