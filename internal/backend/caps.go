package backend

import "time"

// Caps is what a backend can do. The middleware, its transports and ops decide from it
// alone: none of them asks a backend its name.
type Caps struct {
	// Keeps is how the backend keeps a retry.
	Keeps Keeping
	// Delays is which delays it keeps.
	Delays Delays
	// Longest is the longest delay it keeps (for ConstantDelay, the one delay); 0 for
	// no limit.
	Longest time.Duration
	// PastLongest is what becomes of a delay longer than Longest.
	PastLongest PastLongest
	// CarriesEnvelope tells that a retry comes back carrying the failure envelope.
	// Without it the broker redelivers the failed delivery unchanged, and the
	// middleware keeps the envelope in this process until it comes back.
	CarriesEnvelope bool
	// InProcess tells that it keeps retries in this process: it needs no broker (no
	// URI), and nothing of it is on the broker.
	InProcess bool
	// AMQP1 tells that it needs the AMQP 1.0 transport (package amqp1): it settles a
	// failed delivery with an AMQP 1.0 outcome.
	AMQP1 bool
	// Sealed tells that its waiting retries cannot be read, brought back early or
	// dropped: only counted (the delayed-message plugin). ops refuses those moves.
	Sealed bool
	// KeyPrefix is how many bytes of a parked copy's routing key come before the name
	// of its work queue (binary-levels routes on the delay's bits), 0 for none.
	KeyPrefix int
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

// Delays is which delays a backend keeps.
type Delays int

const (
	// AnyDelay: the delay asked for, at the backend's precision.
	AnyDelay Delays = iota
	// LadderDelays: a delay snaps up to the next step of a ladder.
	LadderDelays
	// ConstantDelay: one delay, Caps.Longest, whatever is asked.
	ConstantDelay
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
