// Package ops is the operations side of amqpretry as a Go API, for applications that
// want an admin endpoint; the amqpretry command is a thin layer over it.
//
//   - Status: depth and age of the oldest message of every delay queue, the parking
//     queue and the poison queue; the broker's version, the delayed-message plugin and
//     the capability warnings; flags a stuck delay queue (its head past its due time,
//     or expired messages held for dead lettering that do not move, which only the
//     broker's own counts show: StatusOptions.Counts) and a non-empty parking queue. See
//     PeekMode for how a quorum delay queue is read without spending its delivery-limit.
//   - PlanTopology, Apply, Verify: the declarations of a backend and its work queues,
//     built from the backends' own Topology and WorkQueue (delay.NewPlanner); Apply
//     declares them idempotently, Verify checks them without declaring anything.
//   - List, Redrive, Purge on the poison and parking queues, with a Filter. Redrive
//     sends each message back to the queue it failed on through the library's confirmed
//     hand-off and acks it only after the confirm: at-least-once, nothing lost.
//     Messages that do not match, or whose queue is gone, stay in place and in order.
//
// Reading a queue: AMQP 0-9-1 cannot browse, so List, Redrive and Purge take messages
// with basic.get and hold them unacknowledged, then give back those they leave with
// basic.nack(requeue), which puts them back in their places. At most Window messages
// are held at once (DefaultWindow); a run stops when the window is full and says so.
// If the process dies, the broker gives every held message back itself.
package ops
