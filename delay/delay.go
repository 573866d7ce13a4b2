package delay

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Backend is a delay backend as configured, the type of amqpretry.Config.Backend: the
// value of a constructor of this package, TTLTiers (the default), BinaryLevels,
// DelayedExchange, DelayedRetry, DeliveryTime, Memory or HeldRetries, with its own
// settings,
//
//	Backend: delay.BinaryLevels(20)
//
// or, for a name read from configuration, of Parse. The interface is sealed: the
// backends are the library's, and only this package implements Backend. A backend is
// more than a publisher: what it declares on the broker, how it sizes a delay, what
// the middleware settles, what ops counts, brings back and tears down, and how a
// change of backend leaves nothing behind are one contract between this package and
// the rest of the library, which it keeps internal so that it can change without a
// breaking release. The value validates its settings when the Retry starts (New and
// Config.Validate name the argument at fault); printed with fmt, it describes itself
// with its settings, for logs.
type Backend interface {
	// Name is the backend's name, as Parse takes it: for configuration, logs, events
	// and errors.
	Name() string

	isBackend()
}

// Parse returns the backend named name: "ttl-tiers" (also for ""), "binary-levels",
// "delayed-exchange", "delayed-retry", "delivery-time" or "memory", with the settings
// it has among those given (its defaults for the others), behind s.HeldRetries held
// retries if that is set. It is how a deployment switches backends by configuration
// alone:
//
//	Backend: must(delay.Parse(os.Getenv("DELAY_BACKEND"))),
func Parse(name string, settings ...Settings) (Backend, error) {
	if name == "" {
		name = backends[0].Name()
	}
	for _, b := range backends {
		if b.Name() != name {
			continue
		}
		held := 0
		var heldDelay time.Duration
		for _, s := range settings {
			if t, ok := b.(interface{ with(Settings) Backend }); ok {
				b = t.with(s)
			}
			held, heldDelay = s.HeldRetries, s.Delay
		}
		if held != 0 {
			b = HeldRetries(held, heldDelay, b)
		}
		return b, nil
	}
	return nil, fmt.Errorf("Backend: unknown backend %q (known: %s)", name, strings.Join(knownNames(), ", "))
}

// Settings are backend settings read from configuration by name (a command line, the
// environment), for Parse: the backend named takes those it has, and ignores the
// others. A zero field is the default.
type Settings struct {
	Tiers     []time.Duration   // TTLTiers' tiers
	Levels    int               // BinaryLevels' levels
	Delay     time.Duration     // DelayedRetry's delay, and that of the HeldRetries
	Publisher message.Publisher // Memory's publisher
	// HeldRetries, if set, holds the first retries in the work queue, Delay apart, in
	// front of the backend named (the HeldRetries constructor).
	HeldRetries int
}

var (
	// ErrDelayTooLong is wrapped by the error for a delay longer than the backend can
	// wait.
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
