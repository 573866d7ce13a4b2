package backend

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/declare"
)

// Derived is what an amqpretry.Config, with its defaults, derives beyond its exported
// fields: the backend it names, opened once, the one held in front of it, how to fix a
// topology error, what its work queues need, and its policy's schedule. Derive computes
// all of it, in one place, from the Config's exported fields: the root package for
// Validate, Plan and ApplyCommand, the middleware (once per New), its transports and
// ops through internal/derived.Of. Its invalid fields are Config.Validate's.
type Derived struct {
	// Name is the backend's name, for logs and errors.
	Name string
	// Backend is the backend the Config names, opened for planning and sizing (it
	// parks nothing), and Caps what it can do; nil and zero when the Config names no
	// valid backend (Err says why).
	Backend Backend
	Caps    Caps
	Err     error
	// Open opens the Config's backend again to park through env (the hand-off, the
	// transport's Redeliver, the logger).
	Open func(env Env) (Backend, error)
	// Setup is what the Config opens its backend with, for planning: ops opens the
	// other backends with it to find what they declared under the prefix.
	Setup Setup
	// InProcess: the backend keeps its retries in this process (the InProcess trait),
	// Local is where they come back. AMQP1: it needs the AMQP 1.0 transport.
	InProcess, AMQP1 bool
	Local            message.Publisher
	// Held is the backend that holds the first delay.HeldRetries retries in the work queue,
	// in front of Backend (delay.HeldRetries); nil and 0 without held retries.
	Held        Backend
	HeldRetries int
	// Fix is how to fix a topology error of this Config.
	Fix declare.Fix
	// WorkQueueArgs are the arguments every work queue needs, or nil: with delayed
	// retries, a quorum queue that holds returned deliveries.
	WorkQueueArgs amqp.Table
	// Longest is the longest delay the policy asks of the backend (jitter's upper
	// bound included; a constant delay), 0 when it asks for none.
	Longest time.Duration
	// Schedule describes the retries, for the log at start.
	Schedule string
}
