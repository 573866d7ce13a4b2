package backend

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/topology"
)

// The optional interfaces of a Backend: what only some backends do, each asked with a
// type assertion (as an slog.Handler or amqp091-go's SASL mechanisms). A backend says
// what it does by implementing them; nothing else asks which backend it is.

// InProcess is implemented by a backend that keeps its retries in this process: it
// needs no broker (no URI) and has nothing on it.
type InProcess interface {
	// Local is where retries come back, and where poisoned messages go without a
	// broker; if it is a message.Subscriber, what the transport subscribes to.
	Local() message.Publisher
}

// AMQP1 is implemented by a backend that settles a failed delivery with an AMQP 1.0
// outcome: it needs the AMQP 1.0 transport (package amqp1).
type AMQP1 interface {
	// OnAMQP091 is the error of the backend configured with an AMQP 0-9-1 transport
	// (watermill-amqp), wrapping delay.ErrUnsupported and naming the fix.
	OnAMQP091() error
}

// WorkQueueArgser is implemented by a backend whose work queues hold its retries
// themselves (RabbitMQ 4.3's delayed retry): every work queue needs the arguments it
// returns, and the Config's held retries are its own.
type WorkQueueArgser interface {
	WorkQueueArgs() map[string]any
}

// Preparer is implemented by a backend that checks the broker before its topology is
// declared: its version (a gate) and what it already has. An error wrapping
// delay.ErrUnsupported means the broker cannot run it. mode is the topology mode.
type Preparer interface {
	Prepare(h Handoff, mode topology.Mode) error
}

// VersionGate is implemented by a backend that runs on some versions of RabbitMQ
// only: CheckVersion returns an error wrapping delay.ErrUnsupported (or
// delay.ErrPluginMissing) for a version it cannot run on, nil otherwise.
type VersionGate interface {
	CheckVersion(version string) error
}

// Flagger is implemented by a backend with settings: Flags are the command-line flags
// of `amqpretry topology apply` that give the settings which differ from their
// defaults (Config.ApplyCommand).
type Flagger interface {
	Flags() []string
}

// Storage is implemented by a backend whose retries wait on the broker in queues of
// its own (its delayQueues), for ops to count, list, bring back and tear down.
type Storage interface {
	// StoragePattern is a regular expression matching the names of every delay queue
	// it may have declared under its prefix, whatever its settings were: ops finds
	// the ones a change of settings left behind with it.
	StoragePattern() string
	// QueueOf is the work queue a parked copy routed with key returns to, or "".
	QueueOf(routingKey string) string
	// Unenumerable is a pattern (with '*') of its delay queues whose names no setting
	// bounds (ttl-tiers' tiers), which only a listing of the broker's queues finds; ""
	// when Widest names them all.
	Unenumerable() string
}

// Sealed is implemented by a backend whose waiting retries can only be counted, not
// read, brought back early or dropped (the delayed-message plugin): ops refuses those
// moves, and counts them through the backend, which alone knows how.
type Sealed interface {
	// SealedIn is the exchange whose plugin keeps its retries.
	SealedIn() topology.Exchange
	// Requirement is what the broker must run for the backend (name, and its role:
	// "plugin"), which ops flags missing when the backend's VersionGate refuses the
	// broker's version.
	Requirement() (name, role string)
	// CountSealed is how many retries wait in exchange of vhost, as what keeps them
	// reports (never a guess), read with eval; an error says why it is unknown.
	CountSealed(ctx context.Context, eval Eval, vhost, exchange string) (int, error)
}

// Constant is implemented by a backend that holds every retry of a work queue for one
// delay, Caps.Longest, whatever is asked (delayed-retry): the policy's schedule cannot
// apply, and a retry back long before that delay was not held.
type Constant interface {
	OneDelay() time.Duration
}

// Validator is implemented by a backend with a setting that only a running backend
// needs (a publisher): Validate refuses it missing. amqpretry.Config.Validate reports
// its error with the others.
type Validator interface {
	Validate() error
}

// Widest is implemented by a backend whose names on the broker depend on its
// settings: Widest is the same backend with the settings that declare the most names
// (binary-levels with MaxLevels levels), for ops's teardown of any earlier settings.
type Widest interface {
	Widest() Backend
}
