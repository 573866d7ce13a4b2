package amqp1

import (
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// TestReconnectBrokerSideClose closes the Publisher's and the Subscriber's connections
// from the broker's side (rabbitmqctl close_connection, only this test's connections)
// twice while messages flow, and checks that every message whose Publish returned nil
// is received, and that both resumed after each close.
func TestReconnectBrokerSideClose(t *testing.T) {
	uri := requireBroker(t)
	ctl := rabbitmqctl(t)
	queue := queueName(t, "reconnect")
	prefix := "amqp1-test-" + runID + "-reconnect-"
	ctx := testContext(t, 3*time.Minute)

	sub, err := NewSubscriber(SubscriberConfig{
		URI:                      uri,
		ContainerID:              prefix + "sub",
		Credit:                   10,
		ReconnectInitialInterval: 50 * time.Millisecond,
		ReconnectMaxInterval:     time.Second,
	}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	pub, err := NewPublisher(PublisherConfig{URI: uri, ContainerID: prefix + "pub", PublishTimeout: 10 * time.Second}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()

	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}

	const total = 1500
	var (
		mu        sync.Mutex
		published = map[string]bool{}
		received  = map[string]int{}
	)
	publishDone := make(chan struct{})
	go func() {
		defer close(publishDone)
		for i := 0; i < total && ctx.Err() == nil; i++ {
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			for ctx.Err() == nil {
				err := pub.Publish(queue, msg)
				if err == nil {
					break
				}
				if !errors.Is(err, ErrNotConfirmed) && !errors.Is(err, ErrNotAccepted) {
					t.Logf("publish: %v (trying again)", err)
				}
				time.Sleep(20 * time.Millisecond)
			}
			mu.Lock()
			published[msg.UUID] = true
			mu.Unlock()
			time.Sleep(3 * time.Millisecond) // keep the flow going over a few seconds
		}
	}()

	var closedAt [][]string
	closeAt := map[int]bool{total / 3: true, 2 * total / 3: true}
	var after int // messages received after the last close
	// wake is publishDone until it has woken the loop once: the last message may arrive
	// before the publisher is done, and nothing else would wake the loop then.
	wake := publishDone
	for {
		mu.Lock()
		n := len(received)
		done := false
		select {
		case <-publishDone:
			done = len(published) > 0
			for id := range published {
				if received[id] == 0 {
					done = false
					break
				}
			}
		default:
		}
		mu.Unlock()
		if done {
			break
		}
		if closeAt[n] {
			delete(closeAt, n)
			mu.Lock()
			p := len(published)
			mu.Unlock()
			c, err := closeConnections(ctl, prefix)
			if err != nil {
				t.Fatalf("close connections: %v", err)
			}
			closedAt = append(closedAt, c)
			t.Logf("after %d messages received, %d published: closed %v from the broker's side", n, p, c)
			after = 0
		}
		select {
		case msg, ok := <-messages:
			if !ok {
				t.Fatal("messages channel closed")
			}
			mu.Lock()
			received[msg.UUID]++
			mu.Unlock()
			after++
			msg.Ack()
		case <-wake:
			wake = nil
		case <-ctx.Done():
			mu.Lock()
			t.Fatalf("timed out: received %d of %d published", len(received), len(published))
			mu.Unlock()
		}
	}

	mu.Lock()
	defer mu.Unlock()
	duplicates := 0
	for _, c := range received {
		duplicates += c - 1
	}
	t.Logf("published %d, received %d distinct (%d duplicates), %d received after the last close",
		len(published), len(received), duplicates, after)
	if len(closedAt) != 2 {
		t.Fatalf("closed connections %d times, want 2", len(closedAt))
	}
	for _, c := range closedAt {
		if !slices.Contains(c, prefix+"sub") || !slices.Contains(c, prefix+"pub") {
			t.Fatalf("a close did not find both the publisher's and the subscriber's connection: %v", closedAt)
		}
	}
	if after == 0 {
		t.Fatal("nothing received after the last close: the subscriber did not resume")
	}
	for id := range published {
		if received[id] == 0 {
			t.Errorf("message %s lost", id)
		}
	}
}

// TestConnectionLossCountsAsFailure: a message unsettled when the connection is lost comes
// back, after the Subscriber reconnects, with its delivery count one higher.
func TestConnectionLossCountsAsFailure(t *testing.T) {
	ctl := rabbitmqctl(t)
	prefix := "amqp1-test-" + runID + "-connloss-"
	sub, queue, ids := lifecycleSetup(t, "connection-loss", 1, SubscriberConfig{
		ContainerID:              prefix + "sub",
		ReconnectInitialInterval: 50 * time.Millisecond,
	})
	ctx := testContext(t, 60*time.Second)
	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	var first *message.Message
	select {
	case first = <-messages:
	case <-ctx.Done():
		t.Fatal("no message")
	}
	closed, err := closeConnections(ctl, prefix)
	if err != nil || len(closed) != 1 {
		t.Fatalf("close connections: %v %v", closed, err)
	}
	first.Ack() // too late: the link is gone with its connection
	select {
	case again := <-messages:
		n, _ := DeliveryCount(again)
		if again.UUID != ids[0] || n != 1 {
			t.Errorf("got %s with delivery count %d, want %s with 1", again.UUID, n, ids[0])
		}
		again.Ack()
	case <-ctx.Done():
		t.Fatal("the message did not come back after the reconnection")
	}
}

// TestPublisherReconnects: a Publisher whose connection the broker closed while it was
// idle connects again on the next Publish, which succeeds.
func TestPublisherReconnects(t *testing.T) {
	uri := requireBroker(t)
	ctl := rabbitmqctl(t)
	prefix := "amqp1-test-" + runID + "-pubreconnect-"
	queue := queueName(t, "pub-reconnect")
	declareQueue(t, queue, "quorum", nil)
	pub, err := NewPublisher(PublisherConfig{URI: uri, ContainerID: prefix + "pub"}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Publish(queue, message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	closed, err := closeConnections(ctl, prefix)
	if err != nil || len(closed) != 1 {
		t.Fatalf("close connections: %v %v", closed, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := pub.Publish(queue, message.NewMessage(watermill.NewUUID(), nil))
		if err == nil {
			break
		}
		// The close frame may still be on its way: one ErrNotConfirmed is allowed.
		if !errors.Is(err, ErrNotConfirmed) || time.Now().After(deadline) {
			t.Fatalf("Publish after the broker closed the connection: %v", err)
		}
		t.Logf("first Publish after the close: %v", err)
		time.Sleep(100 * time.Millisecond)
	}
	if got := drain(t, queue, time.Second); len(got) != 2 {
		t.Errorf("queue has %d messages, want 2", len(got))
	}
}
