// Package backend implements the delay backends named in package delay: what each
// declares, how it sizes a delay, and how it parks a message (or, for delayed-retry,
// leaves it in place). Lookup is the one place a backend name is switched on.
package backend

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// Defaults of the backend settings: amqpretry.Config documents them.
const (
	DefaultLevels     = 28
	maxLevels         = 29 // level 29 would hold messages 2^29 s, longer than maxTTL
	DefaultRetryDelay = time.Second
)

// DefaultTiers returns the default ladder of ttl-tiers: the R10 preferred numbers
// (each step about 25% above the last) from 1 s to 10 min, then 15, 20, 30 and 45 min
// and 1 h, 34 tiers. The steps are no wider than the default policy's ±20% jitter, so
// the jitter survives snapping up to a tier.
func DefaultTiers() []time.Duration {
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

// Spec is a backend as configured, defaults applied.
type Spec struct {
	Name   delay.Backend
	Prefix string
	Tiers  []time.Duration // ttl-tiers
	Levels int             // binary-levels
	// RetryDelay is delayed-retry's constant delay (the work queue's
	// x-delayed-retry-min and -max).
	RetryDelay time.Duration
}

// DelayQueue is one queue in which a backend holds messages for a fixed TTL.
type DelayQueue struct {
	Name string
	TTL  time.Duration
}

// Backend is a delay backend. Built by Lookup it only plans and sizes; built by New
// it also parks.
type Backend interface {
	// Name is the backend's name (package delay).
	Name() delay.Backend
	// Effective returns the delay the backend applies for requested, or an error
	// wrapping delay.ErrDelayTooLong.
	Effective(requested time.Duration) (time.Duration, error)
	// Topology is what the backend declares on the publishing side.
	Topology() topology.Topology
	// WorkQueue is what a work queue needs for retries to come back to it.
	WorkQueue(queue string) topology.Topology
	// DelayQueues are the queues where retries wait, for monitoring.
	DelayQueues() []DelayQueue
	// Park hands msg, stamped, to the broker to wait effective and come back to
	// queue, and returns once the broker has confirmed it. The in-place backends
	// (InPlace) do not park.
	Park(ctx context.Context, queue string, msg *message.Message, effective time.Duration) error
	Close() error
}

// InPlace is implemented by a backend that retries without a copy: the middleware
// settles the failed delivery so that the broker itself holds it and redelivers it
// after the delay.
type InPlace interface {
	// Settle settles msg, the delivery that failed, to come back after effective.
	// envelope is the failure envelope, for a transport that can carry it.
	Settle(msg *message.Message, effective time.Duration, envelope message.Metadata) error
}

// Env is what New gives a backend to reach the broker.
type Env struct {
	Handoff *handoff.Handoff
	// Memory receives the memory backend's messages when their delay is over.
	Memory message.Publisher
	// Redeliver asks the AMQP 1.0 transport to settle msg, when it is nacked, so that
	// the broker holds it until at, with the given message annotations (delivery-time).
	Redeliver func(msg *message.Message, at time.Time, annotations map[string]any) error
	Logger    watermill.LoggerAdapter
}

var errDetached = errors.New("backend built for planning cannot park messages")

// Names lists the backend names Lookup knows.
func Names() []delay.Backend { return delay.Backends() }

// Lookup validates s and returns its backend, without a broker: it plans and sizes.
// Errors name the configuration field at fault.
func Lookup(s Spec) (Backend, error) { return New(s, Env{}) }

// New validates s and returns its backend, parking through env.
func New(s Spec, env Env) (Backend, error) {
	if env.Logger == nil {
		env.Logger = watermill.NopLogger{}
	}
	if strings.ContainsAny(s.Prefix, "*# ") {
		return nil, fmt.Errorf("Prefix: %q must not contain '*', '#' or spaces", s.Prefix)
	}
	n := names.Names{Prefix: s.Prefix}
	var b Backend
	switch s.Name {
	case delay.TTLTiers:
		if err := validateTiers(s.Tiers); err != nil {
			return nil, err
		}
		tiers := slices.Clone(s.Tiers)
		slices.Sort(tiers)
		b = &ttlTiers{env: env, names: n, tiers: tiers}
	case delay.BinaryLevels:
		if s.Levels < 1 || s.Levels > maxLevels {
			return nil, fmt.Errorf("Levels: %d is outside 1 to %d (a level holding 2^%d s would need a TTL longer than RabbitMQ's ten-year maximum)", s.Levels, maxLevels, maxLevels)
		}
		b = &binaryLevels{env: env, names: n, levels: s.Levels}
	case delay.DelayedExchange:
		b = &delayedExchange{env: env, names: n, bound: map[string]bool{}}
	case delay.DelayedRetry:
		if err := CheckRetryDelay(s.RetryDelay); err != nil {
			return nil, err
		}
		b = delayedRetry{delay: s.RetryDelay}
	case delay.DeliveryTime:
		b = deliveryTime{redeliver: env.Redeliver}
	case delay.Memory:
		b = newMemory(env)
	default:
		known := make([]string, 0, len(Names()))
		for _, name := range Names() {
			known = append(known, string(name))
		}
		return nil, fmt.Errorf("Backend: unknown backend %q (known: %s)", s.Name, strings.Join(known, ", "))
	}
	for _, name := range allNames(b.Topology()) {
		if len(name) > names.MaxBytes {
			return nil, fmt.Errorf("Prefix: makes the name %q %d bytes long, over AMQP's %d", name, len(name), names.MaxBytes)
		}
	}
	return b, nil
}

func allNames(t topology.Topology) []string {
	var out []string
	for _, e := range t.Exchanges {
		out = append(out, e.Name)
	}
	for _, q := range t.Queues {
		out = append(out, q.Name)
	}
	return out
}

func validateTiers(tiers []time.Duration) error {
	if len(tiers) == 0 {
		return errors.New("Tiers: empty; leave it nil for the default ladder")
	}
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

// Plan is everything s needs on the broker for the work queues: its own topology,
// then each queue's way back, without duplicates.
func Plan(b Backend, workQueues ...string) topology.Topology {
	ts := []topology.Topology{b.Topology()}
	for _, q := range workQueues {
		ts = append(ts, b.WorkQueue(q))
	}
	return declare.Unique(declare.Merge(ts...))
}

// delivery is a delivery exchange of the given name and kind, with the parking
// exchange and queue as its alternate exchange: a dead letter that matches no binding
// is parked, never stuck at the head of a delay queue (at-least-once dead lettering
// would retry it forever).
func delivery(n names.Names, exchange, kind string) topology.Topology {
	return topology.Topology{
		Exchanges: []topology.Exchange{
			{Name: n.Parking(), Kind: "fanout"},
			{Name: exchange, Kind: kind, Args: map[string]interface{}{declare.AlternateExchangeArg: n.Parking()}},
		},
		Queues:   []topology.Queue{declare.HoldingQueue(n.Parking(), "parking")},
		Bindings: []topology.Binding{{Exchange: n.Parking(), Destination: n.Parking()}},
	}
}

// delayQueueArgs are the arguments of a queue that holds messages for ttl and then
// dead-letters them, at least once, to dlx.
func delayQueueArgs(ttl time.Duration, dlx string) map[string]interface{} {
	return map[string]interface{}{
		declare.QueueTypeArg:          declare.QueueTypeQuorum,
		declare.MessageTTLArg:         ttl.Milliseconds(),
		declare.DeadLetterExchangeArg: dlx,
		declare.DeadLetterStrategyArg: declare.DeadLetterAtLeastOnce,
		declare.OverflowArg:           declare.OverflowRejectPublish,
	}
}

// Scheduler is the message.Publisher through which any code schedules a delayed
// message to a queue: it reads the delay from Watermill's delay metadata
// (components/delay), sizes it with the backend and parks a copy without that
// metadata, which would delay the message again wherever it is republished. It is the
// only reader of that metadata in the library.
type Scheduler struct{ Backend Backend }

// Publish parks each message for the queue named by topic.
func (s Scheduler) Publish(queue string, msgs ...*message.Message) error {
	if queue == "" {
		return fmt.Errorf("%s: empty destination queue", s.Backend.Name())
	}
	if _, ok := s.Backend.(InPlace); ok {
		return fmt.Errorf("%s: retries in place and cannot schedule a new message; use a copying backend", s.Backend.Name())
	}
	for _, msg := range msgs {
		requested, err := requested(msg)
		if err != nil {
			return err
		}
		effective, err := s.Backend.Effective(requested)
		if err != nil {
			return fmt.Errorf("message %s for queue %q: %w", msg.UUID, queue, err)
		}
		cp := msg.Copy()
		cp.SetContext(msg.Context())
		delete(cp.Metadata, wdelay.DelayedForKey)
		delete(cp.Metadata, wdelay.DelayedUntilKey)
		if err := s.Backend.Park(msg.Context(), queue, cp, effective); err != nil {
			return fmt.Errorf("park message %s for queue %q (%s backend): %w", msg.UUID, queue, s.Backend.Name(), err)
		}
	}
	return nil
}

// Close does nothing: the Retry owns the backend.
func (Scheduler) Close() error { return nil }

// requested returns the delay msg asks for through Watermill's delay metadata:
// DelayedForKey if set, else the time left until DelayedUntilKey. A message without
// either asks for none; a time in the past gives zero.
func requested(msg *message.Message) (time.Duration, error) {
	if v := msg.Metadata.Get(wdelay.DelayedForKey); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			return 0, fmt.Errorf("message %s: metadata %s: %w", msg.UUID, wdelay.DelayedForKey, err)
		}
		return max(d, 0), nil
	}
	if v := msg.Metadata.Get(wdelay.DelayedUntilKey); v != "" {
		t, err := time.Parse(time.RFC3339, v)
		if err != nil {
			return 0, fmt.Errorf("message %s: metadata %s: %w", msg.UUID, wdelay.DelayedUntilKey, err)
		}
		return max(time.Until(t), 0), nil
	}
	return 0, nil
}

// wholeMillis rounds d up to whole milliseconds, at least 1 ms: the precision of the
// backends that take a delay in milliseconds.
func wholeMillis(d time.Duration) time.Duration {
	ms := d / time.Millisecond
	if d%time.Millisecond > 0 {
		ms++
	}
	return max(ms, 1) * time.Millisecond
}
