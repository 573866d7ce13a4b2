package ops

import (
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
)

// DefaultURI is the broker URI the command uses when AMQP_URI is unset.
const DefaultURI = "amqp://guest:guest@127.0.0.1:5672/"

// PoisonSuffix ends the default name of the poison queue: "<prefix>.poison", as
// amqpretry.Config.PoisonQueue defaults.
const PoisonSuffix = ".poison"

// Config configures New. Every zero value means the library's default.
type Config struct {
	// URI of the broker, amqp:// or amqps://. Required. It never appears in output or
	// errors with its password.
	URI string
	// AMQP is passed to amqp091-go's DialConfig (TLS, heartbeat). Default: amqp091-go's.
	AMQP amqp.Config
	// Delay names the backend and its prefix, tiers or levels, as the application
	// configures them. Delay.Handoff, Delay.Memory and Delay.Topology are ignored; the
	// memory backend has nothing on the broker and is refused.
	Delay delay.Config
	// PoisonQueue is the application's poison queue. Default: "<Delay.Prefix>.poison".
	PoisonQueue string
	// ConfirmTimeout bounds each publisher confirm of a redrive. Default: 10s.
	ConfirmTimeout time.Duration
	// Logger. Default: watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	if c.Delay.Backend == "" {
		c.Delay.Backend = delay.BackendTTLTiers
	}
	if c.Delay.Prefix == "" {
		c.Delay.Prefix = delay.DefaultPrefix
	}
	if c.Delay.Tiers == nil {
		c.Delay.Tiers = delay.DefaultTiers
	}
	if c.Delay.Levels == 0 {
		c.Delay.Levels = delay.DefaultLevels
	}
	if c.PoisonQueue == "" {
		c.PoisonQueue = c.Delay.Prefix + PoisonSuffix
	}
	if c.ConfirmTimeout == 0 {
		c.ConfirmTimeout = delay.DefaultConfirmTimeout
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports every invalid field, each named. URI is checked by New (planning
// needs no broker).
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	if _, err := delay.NewPlanner(c.Delay); err != nil {
		errs = append(errs, fmt.Errorf("Delay: %w", err))
	}
	if c.ConfirmTimeout < 0 {
		errs = append(errs, fmt.Errorf("ConfirmTimeout: %s is negative", c.ConfirmTimeout))
	}
	return errors.Join(errs...)
}

// Ops runs the operations on one broker: status, topology, poison and parking queues.
// It holds two connections: one to read (basic.get) and one to publish (the library's
// confirmed hand-off), so that a publish error never closes the channel holding the
// messages read. Methods are safe to call one at a time; Close it when done.
type Ops struct {
	cfg     Config
	planner delay.Planner
	handoff *delay.Handoff
	conn    *amqp.Connection
}

// New validates cfg and connects.
func New(cfg Config) (*Ops, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	if cfg.URI == "" {
		return nil, errors.New("invalid config: URI: required")
	}
	planner, err := delay.NewPlanner(cfg.Delay)
	if err != nil {
		return nil, err
	}
	amqpCfg := cfg.AMQP
	if amqpCfg.Locale == "" {
		amqpCfg.Locale = "en_US"
	}
	h, err := delay.Dial(delay.HandoffConfig{URI: cfg.URI, AMQP: amqpCfg, ConfirmTimeout: cfg.ConfirmTimeout, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	conn, err := amqp.DialConfig(cfg.URI, amqpCfg)
	if err != nil {
		_ = h.Close()
		return nil, fmt.Errorf("connect to %s: %w", delay.Redact(cfg.URI), redactErr(err, cfg.URI))
	}
	return &Ops{cfg: cfg, planner: planner, handoff: h, conn: conn}, nil
}

// redactErr keeps an error from carrying the URI's password.
func redactErr(err error, uri string) error {
	if err == nil {
		return nil
	}
	return errors.New(redactString(err.Error(), uri))
}

// Close closes both connections.
func (o *Ops) Close() error {
	return errors.Join(o.conn.Close(), o.handoff.Close())
}

// PoisonQueue is the poison queue this Ops works on.
func (o *Ops) PoisonQueue() string { return o.cfg.PoisonQueue }

// ParkingQueue is the parking queue of the backend's prefix.
func (o *Ops) ParkingQueue() string { return delay.ParkingQueue(o.cfg.Delay.Prefix) }

// Config returns the configuration with its defaults.
func (o *Ops) Config() Config { return o.cfg }

// channel opens a channel on the reading connection.
func (o *Ops) channel() (*amqp.Channel, error) {
	ch, err := o.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	return ch, nil
}

// queueDepth declares queue passively: its ready messages and consumers, or exists=false.
func (o *Ops) queueDepth(queue string) (q amqp.Queue, exists bool, err error) {
	ch, err := o.channel()
	if err != nil {
		return q, false, err
	}
	defer ch.Close() //nolint:errcheck // closed by the broker on 404
	q, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	var amqpErr *amqp.Error
	switch {
	case err == nil:
		return q, true, nil
	case errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound:
		return q, false, nil
	}
	return q, false, fmt.Errorf("queue %q: %w", queue, err)
}
