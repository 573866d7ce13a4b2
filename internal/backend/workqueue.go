package backend

import (
	"fmt"
	"maps"
	"slices"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/declare"
)

// WorkQueueArgs are the arguments a work queue needs for RabbitMQ 4.3 to hold its
// returned deliveries for d: a quorum queue with delayed retry of returns.
func WorkQueueArgs(d time.Duration) amqp.Table {
	return amqp.Table{
		declare.QueueTypeArg:        declare.QueueTypeQuorum,
		declare.DelayedRetryTypeArg: declare.DelayedRetryReturned,
		declare.DelayedRetryMinArg:  d.Milliseconds(),
		declare.DelayedRetryMaxArg:  d.Milliseconds(),
	}
}

// WithDeadLetter returns args, a work queue's, with poisonQueue as its dead-letter
// target, as a new table.
func WithDeadLetter(args amqp.Table, poisonQueue string) amqp.Table {
	out := maps.Clone(args)
	if out == nil {
		out = amqp.Table{}
	}
	out[declare.DeadLetterExchangeArg] = ""
	out[declare.DeadLetterKeyArg] = poisonQueue
	return out
}

// MergeWorkQueueArgs returns the arguments a work queue is declared with: user's (the
// subscriber config's Queue.Arguments) with what needed (Derived.WorkQueueArgs) adds,
// as a new table. The dead-letter target is needed's only where user names no
// dead-letter exchange: a target of the user's own is kept. conflicts names, as
// `name value`, each other argument that user gives another value than needed.
func MergeWorkQueueArgs(user, needed amqp.Table) (args amqp.Table, conflicts []string) {
	args = maps.Clone(user)
	if args == nil {
		args = amqp.Table{}
	}
	_, ownTarget := user[declare.DeadLetterExchangeArg]
	for _, k := range slices.Sorted(maps.Keys(needed)) {
		v := needed[k]
		u, set := user[k]
		switch {
		case k == declare.DeadLetterExchangeArg || k == declare.DeadLetterKeyArg:
			if !ownTarget && !set {
				args[k] = v
			}
		case !set:
			args[k] = v
		case !declare.SameValue(u, v):
			conflicts = append(conflicts, fmt.Sprintf("%s %v", k, u))
			args[k] = v
		}
	}
	return args, conflicts
}

// CheckRetryDelay refuses a delay of retries held in the work queue that the broker
// cannot take, given in field: it is given in whole milliseconds, at least one.
func CheckRetryDelay(field string, d time.Duration) error {
	if d < time.Millisecond || d%time.Millisecond != 0 {
		return fmt.Errorf("%s: %s must be a whole number of milliseconds, at least 1ms", field, d)
	}
	return nil
}
