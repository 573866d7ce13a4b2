package delay

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// DefaultPrefix starts the name of every queue and exchange a backend declares.
const DefaultPrefix = "amqpretry"

// DefaultTiers is the default ladder of the ttl-tiers backend.
var DefaultTiers = []time.Duration{
	time.Second, 5 * time.Second, 30 * time.Second, 2 * time.Minute, 10 * time.Minute, time.Hour,
}

// maxTTL is the longest TTL RabbitMQ accepts (315,360,000,000 ms, ten years).
const maxTTL = 315_360_000_000 * time.Millisecond

// Config chooses and configures a delay backend. Switching backends is a change of the
// Backend string only.
type Config struct {
	// Backend names the backend. Default: "ttl-tiers".
	Backend string
	// Prefix starts the name of every queue and exchange the backend declares, so that
	// several applications can share a vhost. Default: "amqpretry".
	Prefix string
	// Tiers is the ladder of the ttl-tiers backend: one queue per delay. Each must be a
	// whole number of milliseconds, at least 1 ms, at most ten years; no duplicates.
	// Default: DefaultTiers (1s 5s 30s 2m 10m 1h).
	Tiers []time.Duration

	// Handoff is the confirmed publishing connection the RabbitMQ backends use.
	// Required for every backend but memory.
	Handoff *Handoff
	// Memory is where the memory backend publishes a message when its delay is over,
	// with the queue name as topic (for example a GoChannel). Required for memory.
	Memory message.Publisher

	// Logger. Default: watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	if c.Backend == "" {
		c.Backend = BackendTTLTiers
	}
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if len(c.Tiers) == 0 {
		c.Tiers = DefaultTiers
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports every invalid field, each named.
func (c Config) Validate() error {
	var errs []error
	switch c.Backend {
	case BackendMemory:
		if c.Memory == nil {
			errs = append(errs, errors.New("Memory: required for the memory backend"))
		}
	case BackendTTLTiers:
		if c.Handoff == nil {
			errs = append(errs, fmt.Errorf("Handoff: required for the %s backend", c.Backend))
		}
		errs = append(errs, validateTiers(c.Tiers))
	default:
		errs = append(errs, fmt.Errorf("Backend: unknown backend %q (known: %s)", c.Backend, strings.Join(Backends(), ", ")))
	}
	if strings.ContainsAny(c.Prefix, "*# ") {
		errs = append(errs, fmt.Errorf("Prefix: %q must not contain '*', '#' or spaces", c.Prefix))
	}
	return errors.Join(errs...)
}

// Backends lists the backend names Config.Backend accepts.
func Backends() []string {
	return []string{BackendTTLTiers, BackendMemory}
}

func validateTiers(tiers []time.Duration) error {
	for i, t := range tiers {
		switch {
		case t < time.Millisecond || t > maxTTL:
			return fmt.Errorf("Tiers[%d]: %s is outside 1ms to %s", i, t, maxTTL)
		case t%time.Millisecond != 0:
			return fmt.Errorf("Tiers[%d]: %s is not a whole number of milliseconds", i, t)
		case slices.Contains(tiers[:i], t):
			return fmt.Errorf("Tiers[%d]: %s appears twice", i, t)
		}
	}
	return nil
}

// New validates cfg, builds the backend it names and declares what the backend needs on
// the publishing side (idempotently).
func New(cfg Config) (Backend, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	switch cfg.Backend {
	case BackendMemory:
		return newMemory(cfg), nil
	default: // BackendTTLTiers
		return newTTLTiers(cfg)
	}
}
