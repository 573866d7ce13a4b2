package declare

import (
	"fmt"
	"regexp"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	amqp "github.com/rabbitmq/amqp091-go"
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
// x-queue-type (a finding's Detail), or "".
func CurrentQueueType(text string) string {
	if m := queueTypeClash.FindStringSubmatch(text); m != nil {
		return m[1]
	}
	return ""
}

// QueueType checks on a throwaway channel of conn that the existing queue is a quorum
// queue, by declaring it again with x-queue-type quorum only: a no-op for a quorum
// queue (a clash on another argument tells nothing about the type), a 406 naming the
// type for another. It needs configure permission; without it (403), or when the queue
// does not exist (checked first, passively, so that nothing is created), known is
// false.
func QueueType(conn *amqp.Connection, queue string) (current string, known bool, err error) {
	err = withChannel(conn, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		return err
	})
	switch {
	case amqperr.IsCode(err, amqp.NotFound):
		return "", false, nil
	case err != nil && !isChannelErr(err):
		return "", false, err
	case err != nil:
		return "", false, nil
	}
	err = withChannel(conn, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{QueueTypeArg: QueueTypeQuorum})
		return err
	})
	if t, ok := QueueTypeClash(err); ok {
		return t, true, nil
	}
	switch {
	case err == nil, amqperr.IsCode(err, amqp.PreconditionFailed):
		return QueueTypeQuorum, true, nil
	case isChannelErr(err):
		return "", false, nil // access refused: cannot tell
	}
	return "", false, err
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
	return fmt.Sprintf("work queue %q is %s, and delayed retries (Backend delayed-retry or HeldRetries) need a quorum queue: "+
		"a queue's type cannot change, not even by a policy. Either move to a new quorum queue: declare it under another name "+
		"(`amqpretry topology apply` with that name creates it with the arguments delayed retries need), move the messages to it "+
		"(a shovel, or consume and republish), and subscribe to it; or, once %q is empty and its publishers stopped, delete it and "+
		"let the library declare it again; or keep it %s and use a copying Backend (%s or %s) without HeldRetries",
		queue, is, queue, "as it is", "ttl-tiers", "binary-levels")
}
