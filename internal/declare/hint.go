package declare

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/topology"
)

// Fix is what the fix of a topology error depends on, for one configuration: the
// middleware's start and its subscribers' topology builders give every error they
// return through its Hint.
type Fix struct {
	Mode topology.Mode
	// HoldsRetries: the work queues hold delayed retries (RabbitMQ 4.3), RetryDelay
	// apart.
	HoldsRetries bool
	RetryDelay   time.Duration
	Backend      string // a delay.Backend
	// PoisonQueue is the poison queue's name: a subscriber that declares it with its
	// own arguments is told how to read it.
	PoisonQueue string
	// Ordered: Config.OrderKey is set, and the work queues need a single active
	// consumer.
	Ordered bool
	// Apply is the `amqpretry topology apply` command that creates what the
	// configuration needs, for the work queues given (amqpretry.Config.ApplyCommand).
	Apply func(workQueues ...string) string
	// Conn, if set, is a connection over which Hint reads every argument of a work
	// queue whose declaration clashed (QueueArgs): a started Retry's hand-off
	// connection.
	Conn func() (*amqp.Connection, error)
}

// heldArgs are the arguments a work queue that holds delayed retries needs besides its
// type (backend.Derive adds the dead-letter target to the backend's).
var heldArgs = []string{DelayedRetryTypeArg, DelayedRetryMinArg, DelayedRetryMaxArg, DeadLetterExchangeArg, DeadLetterKeyArg}

// Hint adds the fix to an error of the topology checks: the command that creates what
// is missing (with queue, when there is one); for a work queue that exists without the
// arguments delayed retries need, how to give them; for a work queue that is a poison
// queue an earlier config left under its name, the command that deletes it; for a
// user refused the configure permission in topology mode declare, the least-privilege
// mode. A work queue whose declaration clashed is read (Conn, QueueArgs), so that the
// fix names all of its arguments, where RabbitMQ's refusal names one.
func (f Fix) Hint(err error, queue string) error {
	var queues []string
	if queue != "" {
		queues = []string{queue}
	}
	clash := queue != "" && amqperr.IsCode(err, amqp.PreconditionFailed)
	c, parsed := Clash{}, false
	if clash {
		c, parsed = ParseClash(amqperr.Reason(err))
	}
	var has amqp.Table // the existing work queue's arguments, when known
	if clash && queue != f.PoisonQueue && f.Conn != nil && amqperr.InequivalentArg.MatchString(amqperr.Reason(err)) {
		if conn, cerr := f.Conn(); cerr == nil {
			if args, ok := QueueArgs(conn, queue, amqp.Table{DeadLetterKeyArg: f.PoisonQueue}); ok {
				has = args
			}
		}
	}
	if has != nil && IsReviewQueue(has) {
		return fmt.Errorf("work queue %q: %w: it has %s, a poison queue's arguments: New declared it as the poison queue of a config whose PoisonQueue was %q, and it is not the work queue this subscriber config declares (%w); "+
			"delete it once nothing in it is needed (`rabbitmqctl list_queues name messages` counts its messages): `rabbitmqctl delete_queue %s`, and the subscriber declares the work queue again",
			queue, topology.ErrMismatch, FormatArgs(has), queue, err, queue)
	}
	if t, ok := QueueTypeClash(err); ok && queue != "" && f.HoldsRetries && t != QueueTypeQuorum {
		return fmt.Errorf("%s: %w (%w)", WrongQueueTypeFix(queue, t), topology.ErrMismatch, err)
	}
	delayedRetryArgs := clash && strings.Contains(err.Error(), "x-delayed-retry")
	declaredForHeld := delayedRetryArgs || has[DelayedRetryTypeArg] != nil
	lacksHeldArg := parsed && c.Has == "none" && slices.Contains(heldArgs, c.Arg)
	switch {
	case errors.Is(err, topology.ErrMissing):
		return fmt.Errorf("%w; create it with `%s` as a user with configure permission (topology mode %s declares nothing)", err, f.Apply(queues...), topology.ModeVerify)
	case f.HoldsRetries && (delayedRetryArgs || lacksHeldArg):
		ms := f.RetryDelay.Milliseconds()
		return fmt.Errorf("%w; work queue %q exists without the arguments delayed retries need (%s): delete it and let the library declare it again, or apply a policy, `rabbitmqctl set_policy amqpretry-delayed-retry '^%s$' '{\"delayed-retry-type\":\"returned\",\"delayed-retry-min\":%d,\"delayed-retry-max\":%d,\"dead-letter-exchange\":\"\",\"dead-letter-routing-key\":%q}' --apply-to quorum_queues`, and run with Config.Topology set to topology.ModeVerify so that it is not declared again",
			err, queue, strings.Join(heldArgs, ", "), regexp.QuoteMeta(queue), ms, ms, f.PoisonQueue)
	case clash && declaredForHeld && !f.HoldsRetries:
		// Moving off delayed-retry: the queue cannot lose its arguments, and the
		// retries it holds need them until they are back.
		give := "the x-delayed-retry-* values it was declared with"
		if has != nil {
			give = "the arguments it was declared with, " + FormatArgs(has)
		}
		return fmt.Errorf("%w; work queue %q was declared for delayed retries (RabbitMQ 4.3) and may still hold some: do not delete it, keep its arguments: give the subscriber config's Queue.Arguments %s, or run with Config.Topology set to topology.ModeVerify (with %s, a delayed retry of the queue only delays the redelivery of a failed hand-off); see docs/switching-backends.md",
			err, queue, give, f.Backend)
	case clash && queue == f.PoisonQueue:
		if parsed {
			return fmt.Errorf("poison queue %q: %w: it has %s %s, the subscriber config asks for %s (%w); it is not a work queue: read it with a subscriber built from Retry.PoisonSubscriberConfig(), which declares it with its own arguments",
				queue, topology.ErrMismatch, c.Arg, c.Has, c.Asked, err)
		}
	case clash && queue != "" && f.Ordered && strings.Contains(err.Error(), SingleActiveConsumerArg):
		return fmt.Errorf("work queue %q: %w: it exists without %s, which Config.OrderKey needs: competing consumers would break each key's order (%w); an existing queue's arguments cannot change: move to a new queue, or, once it is empty and no one consumes it, delete it (`rabbitmqctl delete_queue %s`) and let the subscriber declare it again",
			queue, topology.ErrMismatch, SingleActiveConsumerArg, err, queue)
	case parsed:
		give := argFix(c)
		if has != nil {
			give = FormatArgs(has) + " (the queue's own)"
		}
		return fmt.Errorf("work queue %q: %w: it has %s %s, the subscriber config asks for %s (%w); an existing queue's arguments cannot change: "+
			"give the subscriber config's Queue.Arguments %s, or set Config.Topology to topology.ModeVerify so that the queue is checked, not declared; see docs/switching-backends.md",
			queue, topology.ErrMismatch, c.Arg, c.Has, c.Asked, err, give)
	case amqperr.IsCode(err, amqp.AccessRefused) && f.Mode == topology.ModeDeclare:
		return fmt.Errorf("%w; a user without configure permission cannot declare: have an administrator run `%s`, then set Config.Topology to topology.ModeVerify", err, f.Apply(queues...))
	}
	return err
}

// argFix says what the subscriber config's queue arguments must have for the existing
// queue of clash c.
func argFix(c Clash) string {
	if c.Has == "none" {
		return "no " + c.Arg
	}
	return fmt.Sprintf("%s: %q (the queue's own)", c.Arg, c.Has)
}
