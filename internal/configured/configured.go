// Package configured is what the packages of this module derive from an
// amqpretry.Config beyond its exported fields: the backend it names, the one held in
// front of it, how to fix a topology error, what its work queues need, and its
// policy's schedule. The root package computes all of it, in one place (config.go,
// Config.view), and registers that when it is initialised; the middleware, its
// transports and ops read it through Of. They cannot call the root's unexported
// methods, and the root cannot import them.
package configured

import (
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
)

// View is what an amqpretry.Config, with its defaults, derives.
type View struct {
	// Backend is the backend the Config names.
	Backend backend.Spec
	// Held is the delayed-retry backend that holds the first HeldRetries retries in
	// the work queue, in front of Backend; nil without held retries.
	Held *backend.Spec
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

var view any // func(amqpretry.Config) View

// Register is called by the root package's init, with Config.view.
func Register[C any](f func(C) View) { view = f }

// Of returns what cfg, an amqpretry.Config with its defaults, derives.
func Of[C any](cfg C) View { return view.(func(C) View)(cfg) }
