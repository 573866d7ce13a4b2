package amqp1

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// redeliverSetup publishes one message to a fresh queue and subscribes to it.
func redeliverSetup(t *testing.T, name string, queue QueueConfig) (<-chan *message.Message, *message.Message, context.Context) {
	t.Helper()
	uri := requireBroker43(t)
	q := queueName(t, name)
	ctx := testContext(t, 60*time.Second)
	sub, err := NewSubscriber(SubscriberConfig{URI: uri, Queue: queue}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	messages, err := sub.Subscribe(ctx, q)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := NewPublisher(PublisherConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	sent := message.NewMessage(watermill.NewUUID(), []byte("redeliver me"))
	if err := pub.Publish(q, sent); err != nil {
		t.Fatal(err)
	}
	return messages, sent, ctx
}

func next(t *testing.T, ctx context.Context, messages <-chan *message.Message) (*message.Message, time.Time) {
	t.Helper()
	select {
	case msg := <-messages:
		return msg, time.Now()
	case <-ctx.Done():
		t.Fatal("no message within the deadline")
		return nil, time.Time{}
	}
}

// TestRedeliver: Redeliver(now+2s) then Nack on a quorum queue without any
// delayed-retry argument: the message comes back after 2s, its delivery count one
// higher, with the annotations given; a plain Nack then brings it back at once with
// the same delivery count.
func TestRedeliver(t *testing.T) {
	messages, sent, ctx := redeliverSetup(t, "redeliver", QueueConfig{})

	first, _ := next(t, ctx, messages)
	if first.UUID != sent.UUID {
		t.Fatalf("got %s, want %s", first.UUID, sent.UUID)
	}
	if n, ok := DeliveryCount(first); !ok || n != 0 {
		t.Fatalf("first delivery: DeliveryCount = %d, %v; want 0, true", n, ok)
	}
	at := time.Now().Add(2 * time.Second)
	err := Redeliver(first, at, map[string]any{
		"x-opt-delivery-time":  at.Add(time.Hour).UnixMilli(), // at wins
		"x-opt-amqpretry-test": "v",
	})
	if err != nil {
		t.Fatal(err)
	}
	first.Nack()

	second, arrived := next(t, ctx, messages)
	lateness := arrived.Sub(at)
	t.Logf("back after the delivery time by %v; annotations: %v", lateness, Annotations(second))
	if second.UUID != sent.UUID {
		t.Fatalf("got %s, want %s", second.UUID, sent.UUID)
	}
	if lateness < -2*time.Millisecond || lateness > time.Second {
		t.Errorf("lateness %v, want within [-2ms, 1s] (x-opt-delivery-time has millisecond precision)", lateness)
	}
	if n, ok := DeliveryCount(second); !ok || n != 1 {
		t.Errorf("after Redeliver: DeliveryCount = %d, %v; want 1, true", n, ok)
	}
	ann := Annotations(second)
	if ann["x-opt-amqpretry-test"] != "v" {
		t.Errorf("annotation x-opt-amqpretry-test = %#v, want \"v\"", ann["x-opt-amqpretry-test"])
	}
	if ann["x-opt-delivery-time"] != at.UnixMilli() {
		t.Errorf("annotation x-opt-delivery-time = %#v, want %d", ann["x-opt-delivery-time"], at.UnixMilli())
	}

	start := time.Now()
	second.Nack() // released
	third, arrived := next(t, ctx, messages)
	t.Logf("after a plain Nack: back in %v; annotations: %v", arrived.Sub(start), Annotations(third))
	if n, ok := DeliveryCount(third); !ok || n != 1 {
		t.Errorf("after a plain Nack: DeliveryCount = %d, %v; want 1 (released does not count)", n, ok)
	}
	if arrived.Sub(start) > time.Second {
		t.Errorf("a plain Nack took %v to come back", arrived.Sub(start))
	}
	if Annotations(third)["x-opt-amqpretry-test"] != "v" {
		t.Errorf("the annotation did not survive a release: %v", Annotations(third))
	}
	third.Ack()
}

// TestRedeliverOverridesDelayedRetry: on a queue with delayed retries of its own
// (x-delayed-retry-type failed, 10s), the delivery time given to Redeliver wins.
func TestRedeliverOverridesDelayedRetry(t *testing.T) {
	messages, _, ctx := redeliverSetup(t, "redeliver-delayed-retry", QueueConfig{Arguments: map[string]any{
		"x-delayed-retry-type": "failed",
		"x-delayed-retry-min":  int64(10000),
		"x-delayed-retry-max":  int64(10000),
	}})
	first, _ := next(t, ctx, messages)
	at := time.Now().Add(500 * time.Millisecond)
	if err := Redeliver(first, at, nil); err != nil {
		t.Fatal(err)
	}
	first.Nack()
	second, arrived := next(t, ctx, messages)
	t.Logf("back after the delivery time by %v", arrived.Sub(at))
	if d := arrived.Sub(at); d < -2*time.Millisecond || d > time.Second {
		t.Errorf("lateness %v, want within [-2ms, 1s]", d)
	}
	second.Ack()
}

// TestRedeliverClassicQueue documents what a classic queue does with the modified
// outcome: it redelivers at once, ignoring x-opt-delivery-time, drops the annotations,
// and counts deliveries only as first or not.
func TestRedeliverClassicQueue(t *testing.T) {
	messages, _, ctx := redeliverSetup(t, "redeliver-classic", QueueConfig{Type: "classic"})
	first, _ := next(t, ctx, messages)
	start := time.Now()
	if err := Redeliver(first, start.Add(5*time.Second), map[string]any{"x-opt-amqpretry-test": "v"}); err != nil {
		t.Fatal(err)
	}
	first.Nack()
	second, arrived := next(t, ctx, messages)
	t.Logf("classic queue: back in %v; annotations: %v", arrived.Sub(start), Annotations(second))
	if arrived.Sub(start) > 2*time.Second {
		t.Errorf("classic queue delayed the message %v", arrived.Sub(start))
	}
	if _, ok := Annotations(second)["x-opt-amqpretry-test"]; ok {
		t.Errorf("classic queue kept the annotation: %v", Annotations(second))
	}
	if n, _ := DeliveryCount(second); n != 1 {
		t.Errorf("classic queue: DeliveryCount = %d, want 1", n)
	}
	second.Ack()
}

// TestRedeliverThroughRouter: a handler behind Watermill's router calls Redeliver with
// the message it is given and returns an error; the router's Nack settles it
// modified, and it comes back once, later.
func TestRedeliverThroughRouter(t *testing.T) {
	uri := requireBroker43(t)
	q := queueName(t, "redeliver-router")
	ctx := testContext(t, 60*time.Second)

	sub, err := NewSubscriber(SubscriberConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	pub, err := NewPublisher(PublisherConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	type attempt struct {
		count uint32
		at    time.Time
	}
	attempts := make(chan attempt, 10)
	delay := 300 * time.Millisecond
	router.AddConsumerHandler("redeliver", q, sub, func(msg *message.Message) error {
		n, ok := DeliveryCount(msg)
		if !ok {
			return errors.New("DeliveryCount: message not from the Subscriber")
		}
		attempts <- attempt{n, time.Now()}
		if n == 0 {
			if err := Redeliver(msg, time.Now().Add(delay), nil); err != nil {
				return err
			}
			return errors.New("first attempt fails")
		}
		return nil
	})
	go func() { _ = router.Run(ctx) }()
	defer router.Close()
	select {
	case <-router.Running():
	case <-ctx.Done():
		t.Fatal("router did not start")
	}

	if err := pub.Publish(q, message.NewMessage(watermill.NewUUID(), []byte("x"))); err != nil {
		t.Fatal(err)
	}
	var got []attempt
	for len(got) < 2 {
		select {
		case a := <-attempts:
			got = append(got, a)
		case <-ctx.Done():
			t.Fatalf("attempts so far: %v", got)
		}
	}
	if got[0].count != 0 || got[1].count != 1 {
		t.Errorf("delivery counts %d, %d; want 0, 1", got[0].count, got[1].count)
	}
	if d := got[1].at.Sub(got[0].at); d < delay-5*time.Millisecond {
		t.Errorf("second attempt after %v, want >= %v", d, delay)
	}
	select {
	case a := <-attempts:
		t.Errorf("a third attempt: %v", a)
	case <-time.After(500 * time.Millisecond):
	}
}

// TestDeliveryTimeTypes: RabbitMQ 4.3 reads x-opt-delivery-time given as an AMQP long
// (int64, what Redeliver sends for at), ulong (uint64) or timestamp (time.Time).
func TestDeliveryTimeTypes(t *testing.T) {
	messages, _, ctx := redeliverSetup(t, "delivery-time-types", QueueConfig{})
	msg, _ := next(t, ctx, messages)
	for _, tc := range []struct {
		name  string
		value func(time.Time) any
	}{
		{"long", func(at time.Time) any { return at.UnixMilli() }},
		{"ulong", func(at time.Time) any { return uint64(at.UnixMilli()) }},
		{"timestamp", func(at time.Time) any { return at }},
	} {
		at := time.Now().Add(400 * time.Millisecond)
		if err := Redeliver(msg, time.Time{}, map[string]any{"x-opt-delivery-time": tc.value(at)}); err != nil {
			t.Fatal(err)
		}
		msg.Nack()
		var arrived time.Time
		msg, arrived = next(t, ctx, messages)
		d := arrived.Sub(at)
		t.Logf("%s: back after the delivery time by %v", tc.name, d)
		if d < -2*time.Millisecond || d > time.Second {
			t.Errorf("%s: lateness %v, want within [-2ms, 1s]", tc.name, d)
		}
	}
	msg.Ack()
}
