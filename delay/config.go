package delay

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/topology"
)

// DefaultPrefix starts the name of every queue and exchange a backend declares.
const DefaultPrefix = "amqpretry"

// DefaultTiers is the default ladder of the ttl-tiers backend: the R10 preferred
// numbers (each step about 25% above the last) from 1 s to 10 min, then 15, 20, 30 and
// 45 min and 1 h. The steps are no wider than the default policy's ±20% jitter, so the
// jitter survives snapping up to a tier: retries that failed together come back over
// two tiers, about half on each, rather than mostly on one, and never more than 28%
// later than asked.
var DefaultTiers = r10Tiers()

func r10Tiers() []time.Duration {
	var tiers []time.Duration
	for decade := time.Second; decade < 10*time.Minute; decade *= 10 {
		for _, m := range []time.Duration{100, 125, 160, 200, 250, 315, 400, 500, 630, 800} {
			if t := decade * m / 100; t < 10*time.Minute {
				tiers = append(tiers, t)
			}
		}
	}
	return append(tiers, 10*time.Minute, 15*time.Minute, 20*time.Minute, 30*time.Minute, 45*time.Minute, time.Hour)
}

// maxTTL is the longest TTL RabbitMQ accepts (315,360,000,000 ms, ten years).
const maxTTL = 315_360_000_000 * time.Millisecond

// Config chooses and configures a delay backend. Switching backends is a change of the
// Backend string only.
type Config struct {
	// Backend names the backend: "ttl-tiers", "binary-levels", "delayed-exchange" (needs
	// the rabbitmq_delayed_message_exchange plugin) or "memory" (tests only).
	// Default: "ttl-tiers".
	Backend string
	// Prefix starts the name of every queue and exchange the backend declares, so that
	// several applications can share a vhost. Default: "amqpretry".
	Prefix string
	// Tiers is the ladder of the ttl-tiers backend: one queue per delay. Each must be a
	// whole number of milliseconds, at least 1 ms, at most ten years; no duplicates.
	// Default (nil): DefaultTiers (1s 1.25s 1.6s 2s 2.5s ... 8m 10m 15m 20m 30m 45m 1h,
	// 34 tiers). An empty, non-nil list is refused.
	Tiers []time.Duration
	// Levels is the number of levels of the binary-levels backend, which holds delays
	// up to 2^Levels - 1 seconds. 1 to 29 (a 30th level would hold messages 2^29 s,
	// longer than RabbitMQ's ten-year maximum TTL). To change it, change Prefix too.
	// Default: DefaultLevels (28: about 8.5 years).
	Levels int

	// Handoff is the confirmed publishing connection the RabbitMQ backends use.
	// Required for every backend but memory.
	Handoff *Handoff
	// Memory is where the memory backend publishes a message when its delay is over,
	// with the queue name as topic (for example a GoChannel). Required for memory.
	Memory message.Publisher

	// Topology says what New and the backends do with the topology they need:
	// topology.ModeDeclare (default) declares it; topology.ModeVerify declares no queue
	// or exchange but checks each passively (and asserts the bindings, which needs no
	// configure permission), failing with the `amqpretry topology apply ...` command
	// that creates what is missing; topology.ModeNone does neither. In the verify and
	// none modes the capability probe, which needs configure permission, is skipped.
	Topology topology.Mode

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
	if c.Tiers == nil {
		c.Tiers = DefaultTiers
	}
	if c.Levels == 0 {
		c.Levels = DefaultLevels
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports every invalid field, each named. Zero fields are checked as their
// defaults. Handoff is not checked here (callers may validate before they connect); New
// requires it for the RabbitMQ backends.
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	switch c.Backend {
	case BackendMemory:
		if c.Memory == nil {
			errs = append(errs, errors.New("Memory: required for the memory backend"))
		}
	case BackendTTLTiers, BackendBinaryLevels, BackendDelayedExchange:
	default:
		errs = append(errs, fmt.Errorf("Backend: unknown backend %q (known: %s)", c.Backend, strings.Join(Backends(), ", ")))
	}
	switch {
	case c.Backend == BackendTTLTiers && len(c.Tiers) == 0:
		errs = append(errs, errors.New("Tiers: empty; leave it nil for the default ladder"))
	case c.Backend == BackendTTLTiers:
		errs = append(errs, validateTiers(c.Tiers))
	case c.Backend == BackendBinaryLevels && (c.Levels < 1 || c.Levels > maxLevels):
		errs = append(errs, fmt.Errorf("Levels: %d is outside 1 to %d (a level holding 2^%d s would need a TTL longer than RabbitMQ's ten-year maximum)", c.Levels, maxLevels, maxLevels))
	}
	if err := c.Topology.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("Topology: %w", err))
	}
	if strings.ContainsAny(c.Prefix, "*# ") {
		errs = append(errs, fmt.Errorf("Prefix: %q must not contain '*', '#' or spaces", c.Prefix))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if b := build(c); b != nil {
		return validateNames("Prefix", b.Topology())
	}
	return nil
}

// MaxNameBytes is the longest queue or exchange name AMQP carries. amqp091-go does
// not refuse a longer one: it wraps the length byte and sends another name.
const MaxNameBytes = 255

// validateNames refuses a topology with a name over MaxNameBytes, blaming field.
func validateNames(field string, t topology.Topology) error {
	names := make([]string, 0, len(t.Exchanges)+len(t.Queues))
	for _, e := range t.Exchanges {
		names = append(names, e.Name)
	}
	for _, q := range t.Queues {
		names = append(names, q.Name)
	}
	for _, n := range names {
		if len(n) > MaxNameBytes {
			return fmt.Errorf("%s: makes the name %q %d bytes long, over AMQP's %d", field, n, len(n), MaxNameBytes)
		}
	}
	return nil
}

// Effective returns the delay the configured backend applies for requested, or an
// error wrapping ErrDelayTooLong, without touching the broker: a policy can be checked
// against the backend before anything is declared. Call it on a valid Config.
func (c Config) Effective(requested time.Duration) (time.Duration, error) {
	c.setDefaults()
	b := build(c)
	if b == nil {
		return 0, fmt.Errorf("Backend: unknown backend %q", c.Backend)
	}
	return b.Effective(requested)
}

// Backends lists the backend names Config.Backend accepts.
func Backends() []string {
	return []string{BackendTTLTiers, BackendBinaryLevels, BackendDelayedExchange, BackendMemory}
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
