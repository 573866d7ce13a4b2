package backend

import (
	"fmt"
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

// CheckRetryDelay refuses a delay of retries held in the work queue that the broker
// cannot take, given in field: it is given in whole milliseconds, at least one.
func CheckRetryDelay(field string, d time.Duration) error {
	if d < time.Millisecond || d%time.Millisecond != 0 {
		return fmt.Errorf("%s: %s must be a whole number of milliseconds, at least 1ms", field, d)
	}
	return nil
}
