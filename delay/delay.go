package delay

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/backend"
)

// Backend is a delay backend as configured, the type of amqpretry.Config.Backend: a
// value of TTLTiers (the default), BinaryLevels, DelayedExchange, DelayedRetry,
// DeliveryTime or Memory, each with its own settings:
//
//	Backend: delay.BinaryLevels{Levels: 20}
//
// A name read from configuration gives its value, with default settings, through
// Parse. The value owns its decisions: it validates its settings, and the backend it
// opens says what it can do (its Caps, and the optional interfaces of the library's
// internal/backend it implements), so that nothing else asks which backend it is.
// Only this module's types implement it.
type Backend interface {
	// Name is the backend's name, as Parse takes it: for configuration, logs, events
	// and errors.
	Name() string
	// Open validates the settings (errors name the field at fault) and opens the
	// backend under s.Prefix, parking through s.Env. Use the function Open, which
	// also checks the prefix and the names.
	Open(s backend.Setup) (backend.Backend, error)
}

// Parse returns the backend named name: "ttl-tiers" (also for ""), "binary-levels",
// "delayed-exchange", "delayed-retry", "delivery-time" or "memory", with the settings
// it has among those given (its defaults for the others). It is how a deployment
// switches backends by configuration alone:
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
		for _, s := range settings {
			if t, ok := b.(interface{ with(Settings) Backend }); ok {
				b = t.with(s)
			}
		}
		return b, nil
	}
	return nil, fmt.Errorf("Backend: unknown backend %q (known: %s)", name, strings.Join(Names(), ", "))
}

// Settings are backend settings read from configuration by name (a command line, the
// environment), for Parse: the backend named takes those it has, and ignores the
// others. A zero field is the backend's default.
type Settings struct {
	Tiers     []time.Duration   // TTLTiers.Tiers
	Levels    int               // BinaryLevels.Levels
	Delay     time.Duration     // DelayedRetry.Delay
	Publisher message.Publisher // Memory.Publisher
}

// Backends lists the delay backends, each with its default settings, the default
// first: TTLTiers, BinaryLevels, DelayedExchange, DelayedRetry, DeliveryTime, Memory.
func Backends() []Backend { return append([]Backend(nil), backends...) }

// Names lists the names of the delay backends, the default first: what Parse takes.
func Names() []string {
	out := make([]string, len(backends))
	for i, b := range backends {
		out[i] = b.Name()
	}
	return out
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
