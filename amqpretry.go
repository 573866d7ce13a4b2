package amqpretry

import (
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
)

// Config wires a delay backend, its topology, the marshaler and the retry middleware.
type Config struct {
	// Subscriber is the watermill-amqp config the router's subscriber is built from
	// (any of the queue or pub/sub configs). Retry reads the broker URI, TLS settings
	// and the topic-to-queue mapping from it, and SubscriberConfig returns it ready to
	// use. Required unless Delay.Backend is "memory"; with the memory backend and no
	// URI, everything stays in-process (Delay.Memory, for example a GoChannel, receives
	// the retries and the poisoned messages).
	Subscriber wamqp.Config
	// Delay chooses the delay backend by name and configures it. Default: ttl-tiers with
	// the default tiers. Delay.Handoff is filled in by New.
	Delay delay.Config
	// Policy: attempts and backoff. Defaults: see middleware.Policy.
	Policy middleware.Policy
	// Classify decides for any error. Default: middleware.DefaultClassify.
	Classify func(middleware.ClassifyParams) middleware.Decision
	// PoisonQueue receives messages that failed for good. New declares it (durable,
	// classic). Default: "<Delay.Prefix>.poison".
	PoisonQueue string
	// ConfirmTimeout bounds the wait for each publisher confirm. Default: 10s.
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
	if c.PoisonQueue == "" {
		c.PoisonQueue = c.Delay.Prefix + ".poison"
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.Delay.Logger == nil {
		c.Delay.Logger = c.Logger
	}
	if c.Subscriber.Marshaler == nil {
		c.Subscriber.Marshaler = wamqp.DefaultMarshaler{}
	}
}

// usesBroker: with a broker URI, the poison queue and the topic-to-queue mapping are
// RabbitMQ's, whatever the backend (the memory backend then delays in this process and
// publishes to the broker). Without one, only the memory backend works, in-process.
func (c Config) usesBroker() bool { return c.Subscriber.Connection.AmqpURI != "" }

// Validate reports every invalid field, each named. The Delay fields are checked by
// delay.New.
func (c Config) Validate() error {
	var errs []error
	if !c.usesBroker() && c.Delay.Backend != delay.BackendMemory {
		errs = append(errs, fmt.Errorf("Subscriber.Connection.AmqpURI: required for the %s backend", c.Delay.Backend))
	}
	if c.usesBroker() {
		s := c.Subscriber
		if s.Queue.GenerateName == nil {
			errs = append(errs, errors.New("Subscriber.Queue.GenerateName: required"))
		}
		if s.Consume.NoRequeueOnNack {
			errs = append(errs, errors.New("Subscriber.Consume.NoRequeueOnNack: must be false, or a failed hand-off would drop the message instead of requeueing it"))
		}
		switch s.Marshaler.(type) {
		case wamqp.DefaultMarshaler, xdeath.Marshaler:
		default:
			errs = append(errs, fmt.Errorf("Subscriber.Marshaler: %T cannot read dead-lettered messages; use amqp.DefaultMarshaler or xdeath.Marshaler", s.Marshaler))
		}
	}
	if err := c.Delay.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("Delay: %w", err))
	}
	if err := c.Policy.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("Policy: %w", err))
	}
	if c.ConfirmTimeout < 0 {
		errs = append(errs, fmt.Errorf("ConfirmTimeout: %s is negative", c.ConfirmTimeout))
	}
	return errors.Join(errs...)
}

// Retry is the common case in one value: build it with New, give the router's
// subscriber SubscriberConfig(), add Middleware to the router, Close it after the router.
type Retry struct {
	cfg        Config
	backend    delay.Backend
	handoff    *delay.Handoff // nil on the memory backend
	middleware *middleware.Retry
}

// New validates cfg, connects to the broker (unless the backend is memory), declares the
// backend's topology and the poison queue, and builds the middleware.
func New(cfg Config) (*Retry, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	r := &Retry{}
	poison := cfg.Delay.Memory
	queueOf := func(topic string) string { return topic }
	if cfg.usesBroker() {
		if cfg.Delay.Handoff == nil {
			h, err := delay.Dial(delay.HandoffConfig{
				URI:            cfg.Subscriber.Connection.AmqpURI,
				AMQP:           amqpConfig(cfg.Subscriber.Connection),
				ConfirmTimeout: cfg.ConfirmTimeout,
				Logger:         cfg.Logger,
			})
			if err != nil {
				return nil, err
			}
			r.handoff = h
			cfg.Delay.Handoff = h
		}
		if err := cfg.Delay.Handoff.Declare(topology.Topology{Queues: []topology.Queue{{Name: cfg.PoisonQueue}}}); err != nil {
			return nil, errors.Join(err, r.Close())
		}
		poison = cfg.Delay.Handoff.QueuePublisher()
		queueOf = cfg.Subscriber.Queue.GenerateName
	}
	backend, err := delay.New(cfg.Delay)
	if err != nil {
		return nil, errors.Join(err, r.Close())
	}
	r.backend = backend
	r.cfg = cfg // with the hand-off in Delay.Handoff
	if err := checkPolicyFits(cfg, backend); err != nil {
		return nil, errors.Join(err, r.Close())
	}
	r.middleware, err = middleware.NewRetry(middleware.RetryConfig{
		Policy:      cfg.Policy,
		Classify:    cfg.Classify,
		Delay:       backend,
		Poison:      poison,
		PoisonTopic: cfg.PoisonQueue,
		Queue:       queueOf,
		Logger:      cfg.Logger,
	})
	if err != nil {
		return nil, errors.Join(err, r.Close())
	}
	r.warnWorkQueue()
	cfg.Logger.Info("Broker-side retry ready", watermill.LogFields{
		"delay_backend": backend.Name(), "poison_queue": cfg.PoisonQueue, "max_attempts": r.middleware.Policy().MaxAttempts,
	})
	return r, nil
}

// checkPolicyFits refuses a policy whose longest delay the backend cannot hold (a
// refused delay could never be handed off), and logs where the backend shortens it.
func checkPolicyFits(cfg Config, backend delay.Backend) error {
	longest := cfg.Policy.Longest()
	effective, err := backend.Effective(longest)
	if err != nil {
		return fmt.Errorf("invalid config: Policy: longest delay %s does not fit the %s backend: %w", longest, backend.Name(), err)
	}
	if effective < longest {
		cfg.Logger.Info("The policy's longest delay is longer than the backend holds; those retries come back early", watermill.LogFields{
			"delay_backend": backend.Name(), "policy_longest_delay": longest.String(), "effective_delay": effective.String(),
		})
	}
	return nil
}

// warnWorkQueue logs what could cut retries short on the user's work queues.
func (r *Retry) warnWorkQueue() {
	if r.cfg.Delay.Handoff == nil {
		return
	}
	conn, err := r.cfg.Delay.Handoff.Connection()
	if err != nil {
		return
	}
	version, _ := conn.Properties["version"].(string)
	if w := delay.WorkQueueWarning(version, r.cfg.Subscriber.Queue.Arguments, r.middleware.Policy().MaxAttempts); w != "" {
		r.cfg.Logger.Error("Work queues may lose retries", errors.New(w), watermill.LogFields{"rabbitmq_version": version})
	}
}

func amqpConfig(c wamqp.ConnectionConfig) amqp.Config {
	if c.AmqpConfig != nil {
		return *c.AmqpConfig
	}
	return amqp.Config{TLSClientConfig: c.TLSConfig, Heartbeat: 10 * time.Second}
}

// Middleware implements message.HandlerMiddleware: add it to the router.
func (r *Retry) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return r.middleware.Middleware(h)
}

// SubscriberConfig returns Config.Subscriber ready for amqp.NewSubscriber: its
// marshaler reads dead-lettered messages (xdeath.Marshaler) and its topology builder
// also binds each subscribed queue so that retries come back to it.
func (r *Retry) SubscriberConfig() wamqp.Config {
	c := r.cfg.Subscriber
	if m, ok := c.Marshaler.(wamqp.DefaultMarshaler); ok {
		c.Marshaler = xdeath.Marshaler{Inner: m}
	}
	if _, ok := c.TopologyBuilder.(topology.Builder); !ok && r.backend != nil {
		c.TopologyBuilder = topology.Builder{Inner: c.TopologyBuilder, Binder: r.backend}
	}
	return c
}

// PoisonQueue is the queue (or, in-process, the topic) of poisoned messages.
func (r *Retry) PoisonQueue() string { return r.cfg.PoisonQueue }

// Backend returns the delay backend, a message.Publisher that any code can use to
// schedule a delayed message to a queue.
func (r *Retry) Backend() delay.Backend { return r.backend }

// Close closes the backend and the hand-off connection. Close the router first.
func (r *Retry) Close() error {
	var errs []error
	if r.backend != nil {
		errs = append(errs, r.backend.Close())
	}
	if r.handoff != nil {
		errs = append(errs, r.handoff.Close())
	}
	return errors.Join(errs...)
}
