// Package ops is the operations side of amqpretry as a Go API that returns data, for
// applications that want an admin endpoint; the amqpretry command
// (github.com/amqpretry/amqpretry/cmd/amqpretry) renders it.
//
//   - Status: depth and age of the oldest message of every delay queue, the parking
//     queue, the poison queue and the work queues named; with the broker's own counts
//     (StatusOptions.Counts), the expired messages a delay queue keeps for dead lettering, the
//     retries a RabbitMQ 4.3 work queue holds in delayed retry, and the broker's file
//     descriptors and sockets, and a work queue whose consumers keep deliveries without
//     acking any between two samples of those counts (QueueStatus.PossibleOutage: its
//     application may be in an outage). What needs attention is a Flag: typed data, no
//     prose. Status.Overview puts it in the order to read it, the same for every view:
//     the poison and parking queues, the work queues in a possible outage, those with a
//     backlog and no consumer, what is flagged, the other work queues, then the delay
//     queues summed up in one line.
//   - Apply, Verify: the topology amqpretry.Config.Plan returns, declared idempotently or
//     checked without declaring anything (a Finding per declaration).
//   - List, Redrive (retry now), Purge on the retries waiting in the delay backend
//     (Source Waiting), read without changing anything through Config.Rabbitmqctl
//     (refused on delayed-exchange: its plugin offers no way; Status counts what it
//     keeps); Teardown of the storage every backend declared under the prefix once
//     nothing waits there, removing and counting only what it finds, and naming what
//     it left and why (TeardownResult.Left: shared, kept, or, with rabbitmqctl, the
//     application's work queues and their exchanges; docs/waiting.md).
//   - List, Redrive, Purge on the poison and parking queues (Source), with a Filter.
//     Redrive sends each message back to the queue it failed on through the library's
//     confirmed hand-off and acks it only after the confirm: at-least-once, nothing
//     lost. Messages that do not match, or whose queue is gone, stay in place and in
//     order. A dry run of Redrive checks each queue passively, as the publish would
//     find it, and reports the same unroutable messages (MoveResult.Unrouted).
//     A message the broker dead-lettered to the poison queue past its work
//     queue's x-delivery-limit (no envelope; x-death reason delivery_limit), such as one
//     no client can read, is listed with Reason amqpretry.ReasonDeliveryLimit and its
//     work queue as Queue.
//
// Reading a queue: AMQP 0-9-1 cannot browse, so List, Redrive and Purge take messages
// with basic.get and keep them unacknowledged, then give back those they leave with one
// basic.nack(multiple, requeue). A run that stops early (a limit, an interrupt) first
// takes the rest of the messages present at its start, so that it gives back all of
// them at once, which keeps their order (see below why giving back part of a quorum
// queue does not). At most ListOptions.Window (MoveOptions.Window) messages are kept at
// once, 10,000 by default; a run stops when the window is full and says so: only then
// may what it gives back end up behind what it never took. A run never looks past the
// messages present when it started. If the process dies, the broker gives every kept
// message back itself.
//
// Reading for Status: AMQP 0-9-1 cannot browse, so the only way to learn the age of a
// message is to take it (basic.get) and give it back (basic.nack with requeue). Two
// costs, measured on RabbitMQ 3.10.8 and 4.3.6:
//
//   - order: a quorum queue (the delay queues; the poison and parking queues too) puts
//     a message it gets back behind the others, not in its place: 3.10.8 at every
//     return, 4.3.6 from the second return of the same message. Giving back every
//     message at once keeps their order; giving back the head alone moves it to the
//     end. In a delay queue that is a late retry: the message expires only when it
//     reaches the head again, up to one TTL later.
//   - deliveries: RabbitMQ 4.0 to 4.2 count every return against the quorum queue's
//     delivery-limit, 20 by default for the delay queues (a million for the poison
//     and parking queues); past it the broker dead-letters the message: for a delay
//     queue, an early retry. 3.x has no default limit; 4.3 does not count nacks.
//
// So StatusOptions.Peek "auto" (the default) reads every message of the parking and
// poison queues (up to 1,000; past that their age is unknown) and gives them all back
// at once, and reads no delay queue: a stalled delay queue shows in the broker's counts
// instead (StatusOptions.Counts), as expired messages that do not move. "always" also
// peeks the head of each delay queue, one basic.get and one basic.nack(requeue) on a
// channel of its own, never a reject nor a closed channel (both count as failed
// deliveries on 4.3), at most once per delay queue per call, at the costs above; the
// head's x-delivery-count is reported (QueueStatus.HeadDeliveryCount). "never" reads
// nothing. Work queues are never read. After reading, and after a run, Status, List,
// Redrive and Purge wait (two seconds at most) until the broker shows what they gave
// back as ready again: it requeues asynchronously, and a call right after would see
// the queue shorter.
//
// Every error that could quote the broker URI is redacted: the password never appears.
package ops
