package amqp1

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill/message"
)

// delivered returns a message carrying a delivery, as the Subscriber hands it out.
func delivered(m *amqp.Message) (*message.Message, *delivery) {
	d := &delivery{msg: m}
	msg := message.NewMessage("u", nil)
	msg.SetContext(context.WithValue(context.Background(), deliveryKey{}, d))
	return msg, d
}

func TestRedeliverRecordsModified(t *testing.T) {
	msg, d := delivered(&amqp.Message{})
	// The router derives handler contexts from the message's.
	type key struct{}
	msg.SetContext(context.WithValue(msg.Context(), key{}, 1))
	at := time.UnixMilli(1_800_000_000_123)
	if err := Redeliver(msg, at, map[string]any{"x-opt-a": "b", "x-opt-delivery-time": int64(1)}); err != nil {
		t.Fatal(err)
	}
	mod := d.nackOutcome()
	if mod == nil || !mod.DeliveryFailed || mod.UndeliverableHere {
		t.Fatalf("outcome %+v", mod)
	}
	if mod.Annotations["x-opt-a"] != "b" || mod.Annotations["x-opt-delivery-time"] != int64(1_800_000_000_123) {
		t.Fatalf("annotations %v", mod.Annotations)
	}
	if err := Redeliver(msg, at, nil); err == nil || !strings.Contains(err.Error(), "already acked or nacked") {
		t.Fatalf("Redeliver after the Nack was taken: %v", err)
	}

	msg, _ = delivered(&amqp.Message{})
	msg.Ack()
	if err := Redeliver(msg, at, nil); err == nil {
		t.Fatal("Redeliver after Ack: no error")
	}

	msg, d = delivered(&amqp.Message{})
	if err := Redeliver(msg, time.Time{}, nil); err != nil {
		t.Fatal(err)
	}
	if mod := d.nackOutcome(); len(mod.Annotations) != 0 {
		t.Fatalf("zero at set annotations %v", mod.Annotations)
	}
}

func TestRedeliverRefuses(t *testing.T) {
	if err := Redeliver(message.NewMessage("u", nil), time.Now(), nil); !errors.Is(err, ErrNotDelivered) {
		t.Errorf("foreign message: %v", err)
	}
	if err := Redeliver(nil, time.Now(), nil); !errors.Is(err, ErrNotDelivered) {
		t.Errorf("nil message: %v", err)
	}
	msg, d := delivered(&amqp.Message{})
	// A key without x- makes RabbitMQ 4.3.6 end the session (internal-error).
	if err := Redeliver(msg, time.Now(), map[string]any{"opt-a": "b"}); err == nil || !strings.Contains(err.Error(), `"opt-a"`) {
		t.Errorf("key without x-: %v", err)
	}
	if err := Redeliver(msg, time.Now(), map[string]any{"x-a": map[string]any{}}); err == nil || !strings.Contains(err.Error(), "unsupported value type") {
		t.Errorf("map value: %v", err)
	}
	if d.nackOutcome() != nil {
		t.Error("a refused Redeliver recorded an outcome")
	}
}

func TestDeliveryCountAndAnnotations(t *testing.T) {
	if _, ok := DeliveryCount(message.NewMessage("u", nil)); ok {
		t.Error("DeliveryCount of a foreign message: ok")
	}
	if Annotations(message.NewMessage("u", nil)) != nil {
		t.Error("Annotations of a foreign message: not nil")
	}
	msg, _ := delivered(&amqp.Message{})
	if n, ok := DeliveryCount(msg); n != 0 || !ok {
		t.Errorf("no header: %d %v", n, ok)
	}
	msg, _ = delivered(&amqp.Message{
		Header:      &amqp.MessageHeader{DeliveryCount: 3},
		Annotations: amqp.Annotations{"x-a": amqp.Symbol("s"), amqp.Symbol("x-b"): int64(2)},
	})
	if n, ok := DeliveryCount(msg); n != 3 || !ok {
		t.Errorf("DeliveryCount %d %v", n, ok)
	}
	ann := Annotations(msg)
	if ann["x-a"] != "s" || ann["x-b"] != int64(2) {
		t.Errorf("Annotations %#v", ann)
	}
	ann["x-a"] = "changed"
	if Annotations(msg)["x-a"] != "s" {
		t.Error("Annotations returned the delivery's own map")
	}
}
