package amqpretry

import (
	"errors"
	"fmt"
	"sync"
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
	// Topology says what the library does with the queues, exchanges and bindings it
	// needs (the backend's, the poison queue, each work queue's retry binding):
	// topology.ModeDeclare declares them, idempotently, and declares a deleted one
	// again when a hand-off finds it gone; topology.ModeVerify, for a user without
	// configure permission, declares no queue or exchange but checks each passively
	// (and asserts the bindings, which needs only read and write permission), failing
	// at start-up or subscribe with the `amqpretry topology apply ...` command that
	// creates what is missing; topology.ModeNone touches nothing. It sets
	// Delay.Topology. Default: topology.ModeDeclare.
	Topology topology.Mode
	// HandoffAttempts is how many hand-offs of one message may fail in a row (broker
	// trouble, a message the broker refuses, a mis-wired subscriber) before the message
	// goes to the poison queue instead, reason "handoff-failed". Between failures the
	// middleware pauses, 100ms doubling to 5s, so that nothing is redelivered at wire
	// speed. Default: 5 (middleware.DefaultHandoffAttempts).
	HandoffAttempts int
	// Observe, if set, is told every delivery, success, retry, poisoning and failed
	// hand-off (middleware.Event), for metrics: give it the Observe method of the
	// github.com/amqpretry/amqpretry/metrics module's Metrics. Default: nil.
	Observe func(middleware.Event)
	// RetryLogEvery samples the INFO line per scheduled retry: 0 or 1 logs every one,
	// N one in N, a negative value none. Default: 0.
	RetryLogEvery int
	// Logger. Default: watermill.NopLogger. Poisonings and failed hand-offs are logged
	// at ERROR (WARN for poisonings where the logger has a Warn method).
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
	if c.Delay.Topology == "" {
		c.Delay.Topology = c.Topology
	}
}

// usesBroker: with a broker URI, the poison queue and the topic-to-queue mapping are
// RabbitMQ's, whatever the backend (the memory backend then delays in this process and
// publishes to the broker). Without one, only the memory backend works, in-process.
func (c Config) usesBroker() bool { return c.Subscriber.Connection.AmqpURI != "" }

// Validate reports every invalid field, each named; zero fields are checked as their
// defaults. It touches nothing on the broker: New calls it before it connects, so an
// invalid config has no side effects. The Delay fields are checked by delay.Config's
// Validate, and the policy's longest delay against what the backend can hold.
func (c Config) Validate() error {
	c.setDefaults()
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
		if len(c.PoisonQueue) > delay.MaxNameBytes {
			errs = append(errs, fmt.Errorf("PoisonQueue: %q is %d bytes long, over AMQP's %d", c.PoisonQueue, len(c.PoisonQueue), delay.MaxNameBytes))
		}
	}
	delayErr := c.Delay.Validate()
	if delayErr != nil {
		errs = append(errs, fmt.Errorf("Delay: %w", delayErr))
	}
	policyErr := c.Policy.Validate()
	if policyErr != nil {
		errs = append(errs, fmt.Errorf("Policy: %w", policyErr))
	}
	if delayErr == nil && policyErr == nil {
		// A delay the backend refuses could never be handed off.
		longest := c.Policy.Longest()
		if _, err := c.Delay.Effective(longest); err != nil {
			errs = append(errs, fmt.Errorf("Policy: longest delay %s does not fit the %s backend: %w", longest, c.Delay.Backend, err))
		}
	}
	if c.ConfirmTimeout < 0 {
		errs = append(errs, fmt.Errorf("ConfirmTimeout: %s is negative", c.ConfirmTimeout))
	}
	if c.HandoffAttempts < 0 {
		errs = append(errs, fmt.Errorf("HandoffAttempts: %d is negative", c.HandoffAttempts))
	}
	if err := c.Topology.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("Topology: %w", err))
	} else if c.Delay.Topology.OrDefault() != c.Topology.OrDefault() {
		errs = append(errs, fmt.Errorf("Delay.Topology: %q differs from Topology %q; set Topology only", c.Delay.Topology, c.Topology))
	}
	return errors.Join(errs...)
}

// Retry is the common case in one value: build it with New, add each handler with
// AddHandler (or build its subscriber from SubscriberConfig() and add Middleware to it
// or to the router), Close it after the router.
type Retry struct {
	cfg        Config
	backend    delay.Backend
	handoff    *delay.Handoff // nil on the memory backend
	middleware *middleware.Retry
	// id tells this Retry's deliveries apart (xdeath.SubscriberKey), and bound lists
	// the queues its subscribers' topology builder bound, so that the middleware acts
	// only on what it can route back. Unused in-process.
	id    string
	bound boundQueues
}

// boundQueues is the set of queues whose retry bindings a subscriber declared.
type boundQueues struct {
	mu     sync.Mutex
	queues map[string]bool
}

func (b *boundQueues) add(queue string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.queues == nil {
		b.queues = map[string]bool{}
	}
	b.queues[queue] = true
}

func (b *boundQueues) has(queue string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.queues[queue]
}

// New validates cfg, then (and only if it is valid) connects to the broker unless the
// backend is memory, declares the backend's topology and the poison queue, and builds
// the middleware.
func New(cfg Config) (*Retry, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	r := &Retry{id: watermill.NewShortUUID()}
	poison := cfg.Delay.Memory
	queueOf := func(topic string) string { return topic }
	if cfg.usesBroker() {
		if cfg.Delay.Handoff == nil {
			h, err := delay.Dial(delay.HandoffConfig{
				URI:            cfg.Subscriber.Connection.AmqpURI,
				AMQP:           amqpConfig(cfg.Subscriber.Connection),
				ConfirmTimeout: cfg.ConfirmTimeout,
				Topology:       cfg.Topology,
				Logger:         cfg.Logger,
			})
			if err != nil {
				return nil, err
			}
			r.handoff = h
			cfg.Delay.Handoff = h
		}
		if err := cfg.Delay.Handoff.Ensure(cfg.Topology, topology.Topology{Queues: []topology.Queue{{Name: cfg.PoisonQueue}}}); err != nil {
			if errors.Is(err, topology.ErrMissing) {
				err = fmt.Errorf("%w; create it with `%s --poison-queue %s` as a user with configure permission", err, delay.ApplyCommand(cfg.Delay), cfg.PoisonQueue)
			}
			return nil, errors.Join(fmt.Errorf("poison queue (topology mode %s): %w", cfg.Topology.OrDefault(), err), r.Close())
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
	mwCfg := middleware.RetryConfig{
		Policy:          cfg.Policy,
		Classify:        cfg.Classify,
		Delay:           backend,
		Poison:          poison,
		PoisonTopic:     cfg.PoisonQueue,
		Queue:           queueOf,
		HandoffAttempts: cfg.HandoffAttempts,
		Observe:         cfg.Observe,
		RetryLogEvery:   cfg.RetryLogEvery,
		Logger:          cfg.Logger,
	}
	if cfg.usesBroker() {
		mwCfg.Subscriber = r.id
		mwCfg.Owner = func(msg *message.Message) string { return msg.Metadata.Get(xdeath.SubscriberKey) }
		mwCfg.Origin = func(msg *message.Message) (string, string) {
			return msg.Metadata.Get(xdeath.DeliveryExchangeKey), msg.Metadata.Get(xdeath.DeliveryRoutingKeyKey)
		}
		mwCfg.CheckQueue = r.checkQueue
	}
	r.middleware, err = middleware.NewRetry(mwCfg)
	if err != nil {
		return nil, errors.Join(err, r.Close())
	}
	longest := cfg.Policy.Longest()
	if effective, _ := backend.Effective(longest); effective < longest {
		cfg.Logger.Info("The policy's longest delay is longer than the backend holds; those retries come back early", watermill.LogFields{
			"delay_backend": backend.Name(), "policy_longest_delay": longest.String(), "effective_delay": effective.String(),
		})
	}
	r.warnWorkQueue()
	cfg.Logger.Info("Broker-side retry ready", watermill.LogFields{
		"delay_backend": backend.Name(), "poison_queue": cfg.PoisonQueue, "max_attempts": r.middleware.Policy().MaxAttempts,
	})
	return r, nil
}

// checkQueue tells whether retries can come back to queue: a subscriber built from
// SubscriberConfig must have bound it.
func (r *Retry) checkQueue(queue string) error {
	if r.bound.has(queue) {
		return nil
	}
	return fmt.Errorf("queue %q was never bound for retries by a subscriber built from this Retry's SubscriberConfig(), so a retry could not come back to it", queue)
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
//
// The marshaler also records this Retry's identity on every message
// (xdeath.SubscriberKey), and the topology builder the queues it binds: the middleware
// acts only on messages that a subscriber built from this config delivered. AddHandler
// does all of this in one call.
func (r *Retry) SubscriberConfig() wamqp.Config {
	c := r.cfg.Subscriber
	switch m := c.Marshaler.(type) {
	case wamqp.DefaultMarshaler:
		c.Marshaler = xdeath.Marshaler{Inner: m, Subscriber: r.id}
	case xdeath.Marshaler:
		m.Subscriber = r.id
		c.Marshaler = m
	}
	inner := c.TopologyBuilder
	if _, ok := inner.(topology.Builder); !ok && r.backend != nil {
		inner = topology.Builder{Inner: inner, Binder: r.backend, Mode: r.cfg.Topology}
	}
	c.TopologyBuilder = recordingBuilder{TopologyBuilder: inner, bound: &r.bound}
	return c
}

// recordingBuilder records each queue whose topology it built.
type recordingBuilder struct {
	wamqp.TopologyBuilder
	bound *boundQueues
}

func (b recordingBuilder) BuildTopology(ch *amqp.Channel, queue, exchange string, cfg wamqp.Config, logger watermill.LoggerAdapter) error {
	if err := b.TopologyBuilder.BuildTopology(ch, queue, exchange, cfg, logger); err != nil {
		return err
	}
	b.bound.add(queue)
	return nil
}

// AddHandler adds to router a handler named handlerName that consumes topic through a
// new subscriber built from SubscriberConfig(), with this Retry's Middleware on it: the
// one call that wires subscriber, handler and middleware so that they cannot be
// mismatched. The router closes the subscriber when it stops. In-process (the memory
// backend without a broker URI), the subscriber is Delay.Memory, which must then be a
// message.Subscriber too (a GoChannel is).
func (r *Retry) AddHandler(router *message.Router, handlerName, topic string, handler message.NoPublishHandlerFunc) (*message.Handler, error) {
	var sub message.Subscriber
	if r.cfg.usesBroker() {
		s, err := wamqp.NewSubscriber(r.SubscriberConfig(), r.cfg.Logger)
		if err != nil {
			return nil, fmt.Errorf("subscriber for handler %q: %w", handlerName, err)
		}
		sub = s
	} else {
		s, ok := r.cfg.Delay.Memory.(message.Subscriber)
		if !ok {
			return nil, fmt.Errorf("handler %q: Delay.Memory (%T) is not a message.Subscriber", handlerName, r.cfg.Delay.Memory)
		}
		sub = s
	}
	h := router.AddConsumerHandler(handlerName, topic, sub, handler)
	h.AddMiddleware(r.Middleware)
	return h, nil
}

// PoisonQueue is the queue (or, in-process, the topic) of poisoned messages.
func (r *Retry) PoisonQueue() string { return r.cfg.PoisonQueue }

// Backend returns the delay backend, a message.Publisher that any code can use to
// schedule a delayed message to a queue.
func (r *Retry) Backend() delay.Backend { return r.backend }

// Close closes the backend and the hand-off connection, and logs what this Retry did
// since New: retries, poisoned messages, failed hand-offs. Close the router first.
func (r *Retry) Close() error {
	if r.middleware != nil {
		st := r.middleware.Stats()
		r.cfg.Logger.Info("Broker-side retry closed", watermill.LogFields{
			"retries": st.Retries, "poisoned": st.Poisoned, "handoff_failures": st.HandoffFailure,
		})
	}
	var errs []error
	if r.backend != nil {
		errs = append(errs, r.backend.Close())
	}
	if r.handoff != nil {
		errs = append(errs, r.handoff.Close())
	}
	return errors.Join(errs...)
}

// Stats returns what the middleware did since New.
func (r *Retry) Stats() middleware.Stats { return r.middleware.Stats() }

// Queues names the queues where this Retry's messages wait: for monitoring (see the
// metrics module's WatchQueues).
type Queues struct {
	// Delay are the backend's delay queues (tiers or levels); none for
	// delayed-exchange and memory.
	Delay []string
	// Parking is the parking queue, "" for the backends without one.
	Parking string
	// Poison is the poison queue.
	Poison string
}

// Queues names the queues where this Retry's messages wait.
func (r *Retry) Queues() Queues {
	q := Queues{Poison: r.cfg.PoisonQueue}
	parking := r.cfg.Delay.Prefix + ".parking"
	for _, dq := range r.backend.Topology().Queues {
		if dq.Name == parking {
			q.Parking = parking
			continue
		}
		q.Delay = append(q.Delay, dq.Name)
	}
	return q
}
