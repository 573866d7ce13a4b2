package delay

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/topology"
)

// Backend names, the values of Config.Backend.
const (
	BackendTTLTiers        = "ttl-tiers"
	BackendBinaryLevels    = "binary-levels"
	BackendDelayedExchange = "delayed-exchange"
	BackendMemory          = "memory"
)

// errShutdownWindow is what New logs when the delayed-exchange backend is chosen.
var errShutdownWindow = errors.New("retries due while the broker stops may be lost")

// ErrDelayTooLong is returned (wrapped, with the delay and the backend's maximum) by
// Effective and Publish for a delay longer than the backend can hold.
var ErrDelayTooLong = errors.New("delay too long")

// Backend parks messages and brings each back to a queue after its delay.
//
// Publish(queue, msgs...) implements message.Publisher: the topic is the name of the
// queue the message must come back to (and only that queue), and the delay is read from
// Watermill's delay metadata (components/delay: delay.Message(msg, delay.For(d))), so any
// code that holds a message.Publisher can schedule a delayed message. A message without
// delay metadata is delayed by zero, which a backend may round up. Publish does not
// modify the messages, and returns only once the broker has confirmed that it holds
// every message. (The retry middleware records the delays on its copies itself:
// middleware.RequestedDelayKey, EffectiveDelayKey, DueKey.)
type Backend interface {
	message.Publisher
	topology.WorkQueueBinder

	// Name is the backend's name, as given in Config.Backend.
	Name() string
	// Topology is what the backend declares on the publishing side (New declares it).
	Topology() topology.Topology
	// Effective returns the delay the backend applies for a requested one, or an error
	// (wrapping ErrDelayTooLong for a delay past its maximum) if it cannot honour it.
	Effective(requested time.Duration) (time.Duration, error)
}

// Requested returns the delay msg asks for through Watermill's delay metadata:
// delay.DelayedForKey if set, else the time left until delay.DelayedUntilKey. A message
// without either asks for no delay; a time in the past gives zero.
func Requested(msg *message.Message) (time.Duration, error) {
	if v := msg.Metadata.Get(delay.DelayedForKey); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			return 0, fmt.Errorf("message %s: metadata %s: %w", msg.UUID, delay.DelayedForKey, err)
		}
		return max(d, 0), nil
	}
	if v := msg.Metadata.Get(delay.DelayedUntilKey); v != "" {
		t, err := time.Parse(time.RFC3339, v)
		if err != nil {
			return 0, fmt.Errorf("message %s: metadata %s: %w", msg.UUID, delay.DelayedUntilKey, err)
		}
		return max(time.Until(t), 0), nil
	}
	return 0, nil
}

// schedule is the part of Publish every backend shares: for each message it reads the
// requested delay, asks b for the effective one and parks it.
func schedule(b Backend, queue string, msgs []*message.Message, park func(msg *message.Message, requested, effective time.Duration) error) error {
	if queue == "" {
		return fmt.Errorf("%s: empty destination queue", b.Name())
	}
	for _, msg := range msgs {
		requested, err := Requested(msg)
		if err != nil {
			return err
		}
		effective, err := b.Effective(requested)
		if err != nil {
			return fmt.Errorf("message %s for queue %q: %w", msg.UUID, queue, err)
		}
		if err := park(msg, requested, effective); err != nil {
			return fmt.Errorf("park message %s for queue %q (%s backend): %w", msg.UUID, queue, b.Name(), err)
		}
	}
	return nil
}

// New validates cfg, builds the backend it names and declares what the backend needs on
// the publishing side (idempotently). For a RabbitMQ backend it first runs the
// capability check (Probe) and logs the broker's version, whether the delayed-message
// plugin is enabled and the backend chosen; the delayed-exchange backend fails with
// ErrPluginMissing where the plugin is not enabled.
func New(cfg Config) (Backend, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	if cfg.Backend == BackendMemory {
		return newMemory(cfg), nil
	}
	if cfg.Handoff == nil {
		return nil, fmt.Errorf("invalid config: Handoff: required for the %s backend", cfg.Backend)
	}
	b := build(cfg)
	c, pluginErr := checkBroker(cfg)
	if de, ok := b.(*delayedExchange); ok {
		if pluginErr == nil && !c.DelayedMessagePlugin {
			return nil, de.errPluginMissing()
		}
		cfg.Logger.Error("The delayed-exchange backend may lose retries that come due while the broker stops (the plugin routes them fire-and-forget); ttl-tiers and binary-levels do not", errShutdownWindow,
			watermill.LogFields{"delay_backend": cfg.Backend})
	}
	if err := ensure(cfg, b.Topology()); err != nil { // declare, verify or nothing (cfg.Topology)
		if de, ok := b.(*delayedExchange); ok && pluginMissing(err) {
			return nil, fmt.Errorf("%w: %w", de.errPluginMissing(), err)
		}
		return nil, fmt.Errorf("%s topology (mode %s): %w", cfg.Backend, cfg.Topology.OrDefault(), err)
	}
	return b, nil
}

// build returns the backend cfg names, without touching the broker, or nil for an
// unknown name. cfg has its defaults.
func build(cfg Config) Backend {
	n := names{cfg.Prefix}
	switch cfg.Backend {
	case BackendTTLTiers:
		tiers := slices.Clone(cfg.Tiers)
		slices.Sort(tiers)
		return &ttlTiers{h: cfg.Handoff, logger: cfg.Logger, names: n, tiers: tiers}
	case BackendBinaryLevels:
		return &binaryLevels{h: cfg.Handoff, names: n, levels: cfg.Levels}
	case BackendDelayedExchange:
		return &delayedExchange{h: cfg.Handoff, names: n, bound: map[string]bool{}}
	case BackendMemory:
		return newMemory(cfg)
	}
	return nil
}
