// Package backend is the contract between the delay backends and the hand-off, which
// package delay implements (one file per backend; a delay.Backend value, through
// Opener, opens a backend, and internal/handoff dials a hand-off), and the packages that use them: the
// middleware, its transports, the root package's Config (validation, plan) and ops.
// What a backend can do is its Caps (caps.go) and the optional interfaces it
// implements (traits.go): its users decide from those alone, never from its name or
// type. A backend's name is for logs, events and errors.
package backend

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/topology"
)

// Defaults of the backend settings: amqpretry.Config documents them.
const (
	DefaultLevels = 28
	// MaxLevels is the most levels binary-levels can have: level 29 would keep
	// messages 2^29 s, longer than RabbitMQ's longest TTL (ten years).
	MaxLevels         = 29
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

// Setup is what a backend value (a delay.Backend) is opened with: the names' prefix
// and how to reach the broker.
type Setup struct {
	Prefix string
	Env    Env
}

// DelayQueue is one queue in which a backend keeps messages for a fixed TTL.
type DelayQueue struct {
	Name string
	TTL  time.Duration
}

// Backend is a delay backend, opened from a delay.Backend value. Opened without an
// Env's hand-off it only plans and sizes; with one it also parks.
type Backend interface {
	// Name is the backend's name (package delay), for logs, events and errors.
	Name() string
	// Caps is what the backend can do.
	Caps() Caps
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
	// queue, and returns once the broker has confirmed it. msg is the backend's from
	// then on: the caller made it for Park and does not change it once parked. A backend that keeps the
	// failed delivery (KeepsDelivery, Holder) does not park.
	Park(ctx context.Context, queue string, msg *message.Message, effective time.Duration) error
	Close() error
}

// Holder is implemented by a backend that retries without a copy: the middleware
// nacks the failed delivery so that the broker itself holds it and redelivers it
// after the delay.
type Holder interface {
	// Settle arranges how msg, the delivery that failed, is settled when the
	// middleware nacks it, to come back after effective; it does not settle it
	// itself. envelope is the failure envelope, for a transport that can carry it.
	Settle(msg *message.Message, effective time.Duration, envelope message.Metadata) error
}

// Env is what a backend is given to reach the broker.
type Env struct {
	Handoff Handoff
	// Redeliver asks the AMQP 1.0 transport to settle msg, when it is nacked, so that
	// the broker holds it until at, with the given message annotations (delivery-time).
	Redeliver func(msg *message.Message, at time.Time, annotations map[string]any) error
	Logger    watermill.LoggerAdapter
}

// Plan is everything b needs on the broker for the work queues: its own topology,
// then each queue's way back, without duplicates.
func Plan(b Backend, workQueues ...string) topology.Topology {
	ts := []topology.Topology{b.Topology()}
	for _, q := range workQueues {
		ts = append(ts, b.WorkQueue(q))
	}
	return declare.Unique(declare.Merge(ts...))
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
	if s.Backend.Caps().Keeps == KeepsDelivery {
		return fmt.Errorf("%s: holds failed deliveries and cannot schedule a new message; use a copying backend", s.Backend.Name())
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
