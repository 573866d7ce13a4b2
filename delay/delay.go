package delay

import "errors"

// Backend is the name of a delay backend, the type of amqpretry.Config.Backend:
// TTLTiers ("ttl-tiers", the default), BinaryLevels ("binary-levels"),
// DelayedExchange ("delayed-exchange"), DelayedRetry ("delayed-retry"), DeliveryTime
// ("delivery-time", over AMQP 1.0) or Memory ("memory"). A name read from
// configuration converts with Backend(s); an unknown one is refused by New. The name
// is for configuration, logs and errors: what a backend can do is its Caps.
type Backend string

// Names of the delay backends: the values of amqpretry.Config.Backend.
const (
	// TTLTiers (the default) parks a retry in one of a ladder of quorum queues with
	// queue-level TTLs; a delay snaps up to the next tier.
	TTLTiers Backend = "ttl-tiers"
	// BinaryLevels parks a retry in a cascade of quorum queues of 2^L seconds: any
	// delay up to 2^Levels - 1 s, in 1 s steps, without a plugin.
	BinaryLevels Backend = "binary-levels"
	// DelayedExchange hands a retry to the rabbitmq_delayed_message_exchange plugin:
	// 1 ms steps up to 49.7 days, stored on one node. The plugin cannot run on
	// RabbitMQ 4.3 or later.
	DelayedExchange Backend = "delayed-exchange"
	// DelayedRetry has RabbitMQ 4.3+ hold the failed delivery in the work queue itself
	// (its delayed retry of quorum queues): no copy, no publish, one constant delay per
	// work queue, without jitter. The Policy's schedule fields left zero mean that
	// delay; a value set that it would ignore (Delays other than DelayedRetryDelay,
	// another InitialInterval, a Multiplier other than 1, a MaxInterval shorter than
	// the delay, a Jitter, Immediate) is refused, even one that is the default on a
	// copying backend (Multiplier 2, Jitter 0.2). The work queue must be a quorum
	// queue: an existing queue of another type is refused by the transport's
	// AddHandler, or else at the first subscribe.
	DelayedRetry Backend = "delayed-retry"
	// DeliveryTime has RabbitMQ 4.3+ hold a failed delivery received over AMQP 1.0 in
	// its quorum queue until an exact time (the modified outcome with
	// x-opt-delivery-time): any delay per message, no copy. It needs the AMQP 1.0
	// transport, github.com/amqpretry/amqpretry/amqp1.
	DeliveryTime Backend = "delivery-time"
	// Memory holds a retry in a timer of this process: not durable, for tests and
	// demos only.
	Memory Backend = "memory"
)

// Backends lists the names of the delay backends, the default first: TTLTiers,
// BinaryLevels, DelayedExchange, DelayedRetry, DeliveryTime, Memory. Every one is a
// valid amqpretry.Config.Backend.
func Backends() []Backend {
	out := make([]Backend, len(backends))
	for i, e := range backends {
		out[i] = e.name
	}
	return out
}

var (
	// ErrDelayTooLong is wrapped by the error for a delay longer than the backend can
	// hold.
	ErrDelayTooLong = errors.New("delay too long")
	// ErrPluginMissing is wrapped by the start-up error of the delayed-exchange backend
	// on a broker without the rabbitmq_delayed_message_exchange plugin.
	ErrPluginMissing = errors.New("rabbitmq_delayed_message_exchange plugin not enabled")
	// ErrUnsupported is wrapped by the start-up error of a backend the broker or the
	// transport cannot run: delayed-retry or delivery-time on RabbitMQ older than 4.3,
	// delivery-time on an AMQP 0-9-1 transport. The error names which of them is at
	// fault.
	ErrUnsupported = errors.New("not supported")
)
