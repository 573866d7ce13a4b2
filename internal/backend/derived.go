package backend

import (
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/declare"
)

// Derived is what an amqpretry.Config, with its defaults, derives beyond its exported
// fields: the backend it names, the one held in front of it, how to fix a topology
// error, what its work queues need, and its policy's schedule. The root package
// computes all of it, in one place (amqpretry.Config.Derived); the middleware, its
// transports and ops read it there.
type Derived struct {
	// Backend is the backend the Config names, and Caps what it can do (zero when the
	// Config names no valid backend).
	Backend Spec
	Caps    Caps
	// Held is the delayed-retry backend that holds the first HeldRetries retries in
	// the work queue, in front of Backend; nil without held retries.
	Held *Spec
	// Fix is how to fix a topology error of this Config.
	Fix declare.Fix
	// WorkQueueArgs are the arguments every work queue needs, or nil: with delayed
	// retries, a quorum queue that holds returned deliveries.
	WorkQueueArgs amqp.Table
	// Longest is the longest delay the policy asks of the backend (jitter's upper
	// bound included; delayed-retry's constant delay), 0 when it asks for none.
	Longest time.Duration
	// Schedule describes the retries, for the log at start.
	Schedule string
}
