package amqp1

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
)

// The interop tests exchange messages with watermill-amqp v3 (AMQP 0-9-1) through the
// same RabbitMQ node: RabbitMQ converts between the protocols, 0-9-1 headers to
// AMQP 1.0 application properties and back.

func interopMessage() *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":42}`))
	msg.Metadata.Set("name", "value")
	msg.Metadata.Set("empty", "")
	msg.Metadata.Set("unicode", "żółw 🐢")
	return msg
}

func assertSameMessage(t *testing.T, want, got *message.Message) {
	t.Helper()
	if got.UUID != want.UUID {
		t.Errorf("UUID %q, want %q", got.UUID, want.UUID)
	}
	if string(got.Payload) != string(want.Payload) {
		t.Errorf("payload %q, want %q", got.Payload, want.Payload)
	}
	for k, v := range want.Metadata {
		if got.Metadata.Get(k) != v {
			t.Errorf("metadata %q = %q, want %q", k, got.Metadata.Get(k), v)
		}
	}
	for k, v := range got.Metadata {
		if _, ok := want.Metadata[k]; !ok {
			t.Errorf("extra metadata %q = %q", k, v)
		}
	}
}

func receiveOne(t *testing.T, ctx context.Context, messages <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case msg := <-messages:
		msg.Ack()
		return msg
	case <-ctx.Done():
		t.Fatal("no message within the deadline")
		return nil
	}
}

// TestInteropFromWatermillAMQP: watermill-amqp's Publisher (NewDurableQueueConfig)
// publishes, a Subscriber consumes over AMQP 1.0.
func TestInteropFromWatermillAMQP(t *testing.T) {
	uri := requireBroker(t)
	queue := queueName(t, "interop-from-091")
	ctx := testContext(t, 30*time.Second)

	// NewDurableQueueConfig's queue is a durable classic queue; the Subscriber declares
	// the same.
	sub, err := NewSubscriber(SubscriberConfig{URI: uri, Queue: QueueConfig{Type: "classic"}}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(queue); err != nil {
		t.Fatal(err)
	}

	pub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(uri), testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	want := interopMessage()
	if err := pub.Publish(queue, want); err != nil {
		t.Fatal(err)
	}

	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	got := receiveOne(t, ctx, messages)
	assertSameMessage(t, want, got)
	t.Logf("annotations of a message from watermill-amqp: %v", Annotations(got))
}

// TestInteropToWatermillAMQP: a Publisher publishes over AMQP 1.0, watermill-amqp's
// Subscriber (NewDurableQueueConfig, which declares the queue) consumes.
func TestInteropToWatermillAMQP(t *testing.T) {
	uri := requireBroker(t)
	queue := queueName(t, "interop-to-091")
	ctx := testContext(t, 30*time.Second)

	sub, err := wamqp.NewSubscriber(wamqp.NewDurableQueueConfig(uri), testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(queue); err != nil {
		t.Fatal(err)
	}

	pub, err := NewPublisher(PublisherConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	want := interopMessage()
	if err := pub.Publish(queue, want); err != nil {
		t.Fatal(err)
	}

	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	got := receiveOne(t, ctx, messages)
	assertSameMessage(t, want, got)
}

// TestInteropQuorumQueue: watermill-amqp's durable queue config declares no queue type,
// which RabbitMQ 4 takes as classic: on a quorum queue (the Subscriber's default) its
// declaration fails with 406 PRECONDITION_FAILED. Given x-queue-type=quorum in its
// queue arguments, it declares and uses the same queue.
func TestInteropQuorumQueue(t *testing.T) {
	uri := requireBroker(t)
	queue := queueName(t, "interop-quorum")
	ctx := testContext(t, 30*time.Second)

	sub, err := NewSubscriber(SubscriberConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(queue); err != nil {
		t.Fatal(err)
	}

	plain, err := wamqp.NewSubscriber(wamqp.NewDurableQueueConfig(uri), testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	err = plain.SubscribeInitialize(queue)
	if err == nil || !strings.Contains(err.Error(), "inequivalent arg 'x-queue-type'") {
		t.Fatalf("watermill-amqp declaring a quorum queue as durable: got %v, want 406 inequivalent arg 'x-queue-type'", err)
	}

	config := wamqp.NewDurableQueueConfig(uri)
	config.Queue.Arguments = amqp091.Table{"x-queue-type": "quorum"}
	wsub, err := wamqp.NewSubscriber(config, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer wsub.Close()
	if err := wsub.SubscribeInitialize(queue); err != nil {
		t.Fatalf("watermill-amqp with x-queue-type=quorum: %v", err)
	}

	pub, err := wamqp.NewPublisher(config, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	want := interopMessage()
	if err := pub.Publish(queue, want); err != nil {
		t.Fatal(err)
	}
	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	got := receiveOne(t, ctx, messages)
	assertSameMessage(t, want, got)
	if n, ok := DeliveryCount(got); !ok || n != 0 {
		t.Errorf("DeliveryCount = %d, %v; want 0, true", n, ok)
	}
}

// A queue that exists with another type than the subscriber config asks for (back from
// a backend that made it a quorum queue, say): the refusal names the queue, what it has
// and what the config asks for, the fix and the doc (issue 33).
func TestDeclareClashNamesTheFix(t *testing.T) {
	uri := requireBroker(t)
	queue := queueName(t, "clash")
	declareQueue(t, queue, "quorum", nil)
	sub, err := NewSubscriber(SubscriberConfig{URI: uri, Queue: QueueConfig{Type: "classic"}}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	err = sub.SubscribeInitialize(queue)
	if !errors.Is(err, topology.ErrMismatch) {
		t.Fatalf("SubscribeInitialize = %v, want an error wrapping topology.ErrMismatch", err)
	}
	for _, want := range []string{
		fmt.Sprintf("work queue %q: declared with different arguments: it has x-queue-type quorum, the subscriber config asks for classic", queue),
		"an existing queue's arguments cannot change",
		`give the subscriber config the queue's own, SubscriberConfig.Queue.Type "quorum", or set SubscriberConfig.Queue.NoDeclare so that it is not declared`,
		"see docs/switching-backends.md",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error:\n%v\ndoes not say:\n%s", err, want)
		}
	}
}
