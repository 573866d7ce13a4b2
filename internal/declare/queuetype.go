package declare

import (
	"fmt"
	"regexp"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/topology"
)

// queueTypeClash reads RabbitMQ's 406 for a queue declared with another type than the
// existing one's: "inequivalent arg 'x-queue-type' for queue 'q' in vhost '/':
// received 'quorum' but current is 'classic'".
var queueTypeClash = regexp.MustCompile(`inequivalent arg '` + QueueTypeArg + `'.*but current is (?:the value )?'([^']+)'`)

// QueueTypeClash tells, for an error of a queue declaration, the type of the existing
// queue when the clash is its type (406 on x-queue-type).
func QueueTypeClash(err error) (current string, ok bool) {
	if err == nil || !amqperr.IsCode(err, amqp.PreconditionFailed) {
		return "", false
	}
	current = CurrentQueueType(amqperr.Reason(err))
	return current, current != ""
}

// CurrentQueueType reads the existing queue's type from the text of RabbitMQ's 406 on
// x-queue-type (an Outcome's Detail), or "".
func CurrentQueueType(text string) string {
	if m := queueTypeClash.FindStringSubmatch(text); m != nil {
		return m[1]
	}
	return ""
}

// QueueType checks on conn that the existing queue is a quorum queue, by checking it
// (CheckQueue) with x-queue-type quorum as its only argument: a quorum queue matches (a
// clash on another argument tells nothing about the type), another type is a mismatch
// on x-queue-type whose text names the type. Comparing needs configure permission;
// without it, or when the queue does not exist (nothing is created), known is false.
func QueueType(conn *amqp.Connection, queue string) (current string, known bool, err error) {
	o, err := CheckQueue(conn, topology.Queue{Name: queue, Args: amqp.Table{QueueTypeArg: QueueTypeQuorum}}, true)
	if err != nil {
		return "", false, err
	}
	switch o.Status {
	case OK:
		return QueueTypeQuorum, true, nil
	case Mismatch:
		if t := CurrentQueueType(o.Detail); t != "" {
			return t, true, nil
		}
		return QueueTypeQuorum, true, nil
	}
	return "", false, nil // missing, or refused: cannot tell
}

// NotQuorum is the type of a queue known only not to be a quorum queue (the broker's
// counts give members for quorum queues only).
const NotQuorum = "not quorum"

// WrongQueueTypeFix says how to move work queue queue, a queue of type current, to
// delayed retries, which need a quorum queue: a queue's type never changes, not even
// by a policy.
func WrongQueueTypeFix(queue, current string) string {
	is := "a " + current + " queue"
	if current == NotQuorum {
		is = "not a quorum queue"
	}
	return fmt.Sprintf("work queue %q is %s, and delayed retries (Backend delayed-retry or delay.HeldRetries) need a quorum queue: "+
		"a queue's type cannot change, not even by a policy. Either move to a new quorum queue: declare it under another name "+
		"(`amqpretry topology apply` with that name creates it with the arguments delayed retries need), move the messages to it "+
		"(a shovel, or consume and republish), and subscribe to it; or, once %q is empty and its publishers stopped, delete it and "+
		"let the library declare it again; or keep it as it is and use a copying Backend (ttl-tiers or binary-levels) without delay.HeldRetries",
		queue, is, queue)
}
