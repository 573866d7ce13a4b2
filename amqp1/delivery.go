package amqp1

import (
	"fmt"
	"strings"
	"sync"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill/message"
)

// deliveryTimeAnnotation asks RabbitMQ 4.3+ (quorum queues) to hold a message settled
// modified until this absolute time, in Unix milliseconds. The broker reads an AMQP
// long, ulong or timestamp alike (measured on 4.3.6); Redeliver sends a long (int64).
const deliveryTimeAnnotation = "x-opt-delivery-time"

type deliveryKey struct{}

// delivery is one message the Subscriber received. It travels in the context of the
// Watermill message it became, which is how Redeliver, DeliveryCount and Annotations
// find it (the router derives each handler's context from the message's).
type delivery struct {
	msg *amqp.Message

	mu      sync.Mutex
	modify  *amqp.ModifyMessageOptions // set by Redeliver: Nack settles modified
	settled bool                       // the Subscriber has taken the Ack or Nack
}

func deliveryOf(msg *message.Message) (*delivery, bool) {
	if msg == nil {
		return nil, false
	}
	d, ok := msg.Context().Value(deliveryKey{}).(*delivery)
	return d, ok
}

// nackOutcome marks the delivery settled and returns how its Nack settles: nil for
// released, else the modified outcome Redeliver asked for.
func (d *delivery) nackOutcome() *amqp.ModifyMessageOptions {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.settled = true
	return d.modify
}

func (d *delivery) markSettled() {
	d.mu.Lock()
	d.settled = true
	d.mu.Unlock()
}

// Redeliver asks that msg's Nack settle it with the AMQP 1.0 modified outcome
// (delivery-failed=true, undeliverable-here=false) carrying the given message
// annotations, instead of released. Call it before msg.Nack(); the last call wins.
//
// With a non-zero at, the annotation x-opt-delivery-time is set to at in Unix
// milliseconds (an AMQP long): RabbitMQ 4.3+ keeps the message aside and delivers it
// again at that time, with its delivery count one higher. It overrides a value of the
// same key in annotations. With a zero at, the broker redelivers it at once, or after
// the queue's own delayed-retry delay (x-delayed-retry-*, 4.3+).
//
// Annotation keys must start with "x-" (custom ones conventionally "x-opt-"); values
// must be AMQP simple values: nil, bool, the Go integer and float types, string,
// []byte or time.Time. On a quorum queue the broker merges them into the message's
// annotations and keeps them on every later delivery (Annotations reads them); a
// classic queue ignores the delivery time and drops the annotations, and counts
// deliveries only as first or not (measured on RabbitMQ 4.3.6).
//
// msg must be a message the Subscriber delivered, or one whose context derives from
// its context (as the router's handlers get): otherwise Redeliver returns
// ErrNotDelivered. It is an error too once the message was acked or nacked.
func Redeliver(msg *message.Message, at time.Time, annotations map[string]any) error {
	d, ok := deliveryOf(msg)
	if !ok {
		return ErrNotDelivered
	}
	ann := make(amqp.Annotations, len(annotations)+1)
	for k, v := range annotations {
		if !strings.HasPrefix(k, "x-") {
			return fmt.Errorf("amqp1: annotation %q: key must start with \"x-\"", k)
		}
		if !simpleValue(v) {
			return fmt.Errorf("amqp1: annotation %q: unsupported value type %T", k, v)
		}
		ann[k] = v
	}
	if !at.IsZero() {
		ann[deliveryTimeAnnotation] = at.UnixMilli()
	}
	select {
	case <-msg.Acked():
		return fmt.Errorf("amqp1: message %s was already acked or nacked", msg.UUID)
	case <-msg.Nacked():
		return fmt.Errorf("amqp1: message %s was already acked or nacked", msg.UUID)
	default:
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.settled {
		return fmt.Errorf("amqp1: message %s was already acked or nacked", msg.UUID)
	}
	d.modify = &amqp.ModifyMessageOptions{DeliveryFailed: true, Annotations: ann}
	return nil
}

// DeliveryCount is the broker's count of earlier failed deliveries of msg, the AMQP 1.0
// header field delivery-count: 0 on the first delivery. A quorum queue adds one for
// each delivery settled modified with delivery-failed (Redeliver), rejected, or lost
// with its link or connection; a plain Nack (released) does not add one. A classic
// queue reports 0 for the first delivery and 1 for any later one. ok is false when msg
// was not delivered by this package's Subscriber.
func DeliveryCount(msg *message.Message) (count uint32, ok bool) {
	d, ok := deliveryOf(msg)
	if !ok {
		return 0, false
	}
	if d.msg.Header == nil {
		return 0, true
	}
	return d.msg.Header.DeliveryCount, true
}

// Annotations returns a copy of the message annotations of msg's delivery, the
// broker's (x-exchange, x-routing-key, x-delivery-count, x-acquired-count, ...) and
// those given to Redeliver on an earlier delivery, keyed by name; symbol values are
// returned as strings. It returns nil when msg was not delivered by this package's
// Subscriber.
func Annotations(msg *message.Message) map[string]any {
	d, ok := deliveryOf(msg)
	if !ok {
		return nil
	}
	out := make(map[string]any, len(d.msg.Annotations))
	for k, v := range d.msg.Annotations {
		var key string
		switch k := k.(type) {
		case string:
			key = k
		case amqp.Symbol:
			key = string(k)
		default:
			key = fmt.Sprint(k) // numeric keys are reserved by the spec; keep them readable
		}
		if s, ok := v.(amqp.Symbol); ok {
			v = string(s)
		}
		out[key] = v
	}
	return out
}

func simpleValue(v any) bool {
	switch v.(type) {
	case nil, bool, string, []byte, time.Time,
		int, int8, int16, int32, int64,
		uint, uint8, uint16, uint32, uint64,
		float32, float64:
		return true
	}
	return false
}
