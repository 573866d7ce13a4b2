package backend

import "time"

// Caps is what every backend tells of itself. What only some backends do is a small
// optional interface of their own (traits.go). The middleware, its transports and ops
// decide from those alone: none of them asks a backend its name or its type.
type Caps struct {
	// Keeps is how the backend keeps a retry.
	Keeps Keeping
	// Longest is the longest delay it keeps (for a Constant backend, the one delay); 0
	// for no limit.
	Longest time.Duration
	// PastLongest is what becomes of a delay longer than Longest.
	PastLongest PastLongest
	// CarriesEnvelope tells that a retry comes back carrying the failure envelope.
	// Without it the broker redelivers the failed delivery unchanged, and the
	// middleware keeps the envelope in this process until it comes back.
	CarriesEnvelope bool
	// Fix is how to raise Longest, or "".
	Fix string
	// Text describes what it keeps, for the log at start.
	Text string
	// Risk, if set, is what it may lose: a sentence logged at start.
	Risk string
}

// Keeping is how a backend keeps a retry.
type Keeping int

const (
	// KeepsCopy: a copy is parked in delay storage, confirmed before the failed
	// delivery is acked (Backend.Park).
	KeepsCopy Keeping = iota
	// KeepsDelivery: the broker holds the failed delivery itself, in its work queue
	// (Holder.Settle): no copy.
	KeepsDelivery
)

// PastLongest is what becomes of a delay longer than a backend's longest.
type PastLongest int

const (
	// NoLongest: the backend has no longest delay.
	NoLongest PastLongest = iota
	// Refuse: a longer delay is refused (delay.ErrDelayTooLong).
	Refuse
	// Repark: kept for Longest, then re-parked when it comes back, until it is due
	// (keys.ParkUntil): a RetryAfter and the policy's delays alike, never early.
	Repark
	// HoldAgain: the failed delivery is held again, as many times as it takes, until
	// it is due.
	HoldAgain
)
