package middleware

import "time"

// Stats counts what a Retry did since it was built.
type Stats struct {
	// Retries handed off and confirmed, or held (the broker keeps the failed delivery).
	Retries int64
	// Poisoned messages.
	Poisoned int64
	// HandoffFailures: hand-offs that failed (each nacked, or followed by a
	// poisoning).
	HandoffFailures int64
	// PoisonPending: messages that failed for good but whose poison publish keeps
	// failing (the poison queue is missing, say). Each stays in its work queue, nacked
	// for redelivery; this process remembers it and retries only its poison publish,
	// paced, never the handler. Not zero means the poison queue needs attention. The
	// memory is the process's: after a restart such a message runs through the
	// handler once more before its poisoning is tried again.
	PoisonPending int64
	// Outages begun (Config.Outage), and Probes run during them; InOutage, the work
	// queues in an outage now (their messages wait in this process, spending no
	// attempt, until a probe succeeds).
	Outages, Probes, InOutage int64
	// BlockedKeys are the order keys (Config.OrderKey) blocked now, as this process
	// knows them (it learns of a key blocked by another when it next sees one of its
	// messages); Behind, the messages it put behind them that wait; LongestBlocked, how
	// long the oldest has been blocked. The amqpretry command reads the broker's.
	BlockedKeys, Behind int64
	LongestBlocked      time.Duration
	// Duplicates: messages acked without running the handler, as duplicates of one
	// handled before (amqpretry.Config.Dedup).
	Duplicates int64
}
