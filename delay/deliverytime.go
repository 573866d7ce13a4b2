package delay

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/topology"
)

// deliveryTime leaves a failed delivery, received over AMQP 1.0, in its quorum work
// queue: the middleware settles it with the modified outcome (delivery-failed) carrying
// the annotation x-opt-delivery-time, and RabbitMQ 4.3 holds it until that time, then
// delivers it again with its delivery count one higher. Any delay, per message, in 1
// ms steps; no copy, no publish, nothing declared. The failure envelope travels as
// x-opt-amqpretry-* message annotations, which the broker keeps on later deliveries.
type deliveryTime struct {
	redeliver func(msg *message.Message, at time.Time, annotations map[string]any) error
}

// annotationPrefix starts the message annotations the failure envelope travels in on
// delivery-time: the prefix of AMQP 1.0's non-standard annotations, then the
// envelope's metadata key. The AMQP 1.0 transport reads them back with it.
const annotationPrefix = "x-opt-"

// DeliveryTime ("delivery-time") has RabbitMQ 4.3+ hold a failed delivery received
// over AMQP 1.0 in its quorum queue until an exact time (the modified outcome with
// x-opt-delivery-time): any delay per message, no copy. It needs the AMQP 1.0
// transport, github.com/amqpretry/amqpretry/amqp1. It has no settings.
func DeliveryTime() Backend { return deliveryTimeValue{} }

// deliveryTimeValue is DeliveryTime as configured.
type deliveryTimeValue struct{ lib }

// Name is "delivery-time".
func (deliveryTimeValue) Name() string { return "delivery-time" }

func (b deliveryTimeValue) String() string { return b.Name() }

// Open opens the backend, settling through s.Env.Redeliver.
func (deliveryTimeValue) Open(s backend.Setup) (backend.Backend, error) {
	return deliveryTime{redeliver: s.Env.Redeliver}, nil
}

func (deliveryTime) Name() string { return deliveryTimeValue{}.Name() }

func (deliveryTime) Caps() backend.Caps {
	return backend.Caps{Keeps: backend.KeepsDelivery, CarriesEnvelope: true, Text: "1ms steps, any delay"}
}

// OnAMQP091: it settles with the AMQP 1.0 modified outcome, which AMQP 0-9-1 lacks.
func (b deliveryTime) OnAMQP091() error { return needsAMQP1(b.Name()) }

// CheckVersion refuses RabbitMQ older than 4.3, which does not hold such a delivery.
func (b deliveryTime) CheckVersion(v string) error { return needs43(b.Name(), v) }

// Effective rounds requested up to whole milliseconds, at least 1 ms.
func (deliveryTime) Effective(requested time.Duration) (time.Duration, error) {
	return wholeMillis(requested), nil
}

func (deliveryTime) Topology() topology.Topology        { return topology.Topology{} }
func (deliveryTime) WorkQueue(string) topology.Topology { return topology.Topology{} }
func (deliveryTime) DelayQueues() []backend.DelayQueue  { return nil }

func (deliveryTime) Park(context.Context, string, *message.Message, time.Duration) error {
	return fmt.Errorf("%s: holds the failed delivery, it parks no copy", deliveryTimeValue{})
}

// needsAMQP1 is the error of a backend (name) that needs the AMQP 1.0 transport (the
// AMQP1 trait) configured with an AMQP 0-9-1 one (watermill-amqp).
func needsAMQP1(name string) error {
	return fmt.Errorf("Backend: %s is %w on the AMQP 0-9-1 transport (watermill-amqp): it settles a failed delivery with an AMQP 1.0 outcome; use the AMQP 1.0 transport, package github.com/amqpretry/amqpretry/amqp1, or another Backend (%s, %s, %s)",
		name, ErrUnsupported, ttlTiersValue{}, binaryLevelsValue{}, delayedRetryValue{})
}

var errNoTransport = fmt.Errorf("%s is %w on the AMQP 0-9-1 transport: it needs the AMQP 1.0 transport, package github.com/amqpretry/amqpretry/amqp1", deliveryTimeValue{}, ErrUnsupported)

// Settle asks the transport to settle msg modified, due after effective, with the
// envelope as annotations, when the middleware nacks it.
func (b deliveryTime) Settle(msg *message.Message, effective time.Duration, envelope message.Metadata) error {
	if b.redeliver == nil {
		return errNoTransport
	}
	ann := make(map[string]any, len(envelope))
	for k, v := range envelope {
		ann[annotationPrefix+k] = v
	}
	if err := b.redeliver(msg, time.Now().Add(effective), ann); err != nil {
		return fmt.Errorf("%s: settle message %s: %w", deliveryTimeValue{}, msg.UUID, err)
	}
	return nil
}

func (deliveryTime) Close() error { return nil }
