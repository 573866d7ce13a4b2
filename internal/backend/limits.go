package backend

import (
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
