package amqp1

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// lifecycleSetup publishes n messages to a fresh queue and returns a Subscriber for it.
func lifecycleSetup(t *testing.T, name string, n int, config SubscriberConfig) (*Subscriber, string, []string) {
	t.Helper()
	uri := requireBroker(t)
	queue := queueName(t, name)
	config.URI = uri
	sub, err := NewSubscriber(config, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	if err := sub.SubscribeInitialize(queue); err != nil {
		t.Fatal(err)
	}
	pub, err := NewPublisher(PublisherConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	var ids []string
	for i := 0; i < n; i++ {
		msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
		ids = append(ids, msg.UUID)
		if err := pub.Publish(queue, msg); err != nil {
			t.Fatal(err)
		}
	}
	return sub, queue, ids
}

// drain returns the UUIDs a fresh Subscriber receives from queue within wait, acking.
func drain(t *testing.T, queue string, wait time.Duration) map[string]uint32 {
	t.Helper()
	sub, err := NewSubscriber(SubscriberConfig{URI: testURI()}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]uint32{}
	for msg := range messages {
		got[msg.UUID], _ = DeliveryCount(msg)
		msg.Ack()
	}
	return got
}

// TestCloseWaitsForAck: Close cancels the context of the message handed out, waits for
// its Ack, settles it, and only then returns; the message is gone from the queue, the
// one behind it is still there, not counted as failed.
func TestCloseWaitsForAck(t *testing.T) {
	sub, queue, ids := lifecycleSetup(t, "close-waits", 2, SubscriberConfig{Credit: 5})
	ctx := testContext(t, 30*time.Second)
	messages, err := sub.Subscribe(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	var msg *message.Message
	select {
	case msg = <-messages:
	case <-ctx.Done():
		t.Fatal("no message")
	}
	closed := make(chan error)
	go func() { closed <- sub.Close() }()
	select {
	case <-msg.Context().Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not cancel the message's context")
	}
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) before the message was acked", err)
	case <-time.After(300 * time.Millisecond):
	}
	msg.Ack()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return after the Ack")
	}
	if _, open := <-messages; open {
		t.Fatal("messages channel still open after Close")
	}
	if err := sub.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := sub.Subscribe(context.Background(), queue); !errors.Is(err, ErrClosed) {
		t.Fatalf("Subscribe after Close: %v, want ErrClosed", err)
	}

	left := drain(t, queue, time.Second)
	if _, ok := left[msg.UUID]; ok {
		t.Errorf("the acked message %s is still in the queue", msg.UUID)
	}
	other := ids[0]
	if other == msg.UUID {
		other = ids[1]
	}
	if n, ok := left[other]; !ok || n != 0 {
		t.Errorf("the message not handed out: present %v, delivery count %d; want present, 0", ok, n)
	}
}

// TestCloseTimeout: a message neither acked nor nacked delays Close for CloseTimeout
// only, then goes back to the queue.
func TestCloseTimeout(t *testing.T) {
	sub, queue, ids := lifecycleSetup(t, "close-timeout", 1, SubscriberConfig{CloseTimeout: 300 * time.Millisecond})
	ctx := testContext(t, 30*time.Second)
	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-messages:
	case <-ctx.Done():
		t.Fatal("no message")
	}
	start := time.Now()
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	t.Logf("Close took %v with CloseTimeout 300ms", took)
	if took < 250*time.Millisecond || took > 5*time.Second {
		t.Errorf("Close took %v", took)
	}
	left := drain(t, queue, time.Second)
	if n, ok := left[ids[0]]; !ok || n != 0 {
		t.Errorf("the message never settled: back %v, delivery count %d; want back, 0 (a detach is no failure)", ok, n)
	}
}

// TestSubscribeContext: ending the Subscribe context closes the channel once the
// message handed out is acked; the Subscriber stays usable.
func TestSubscribeContext(t *testing.T) {
	sub, queue, _ := lifecycleSetup(t, "subscribe-ctx", 3, SubscriberConfig{})
	deadline := testContext(t, 30*time.Second)
	ctx, cancel := context.WithCancel(deadline)
	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	var msg *message.Message
	select {
	case msg = <-messages:
	case <-deadline.Done():
		t.Fatal("no message")
	}
	cancel()
	select {
	case <-msg.Context().Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the end of the Subscribe context did not cancel the message's context")
	}
	select {
	case _, open := <-messages:
		t.Fatalf("channel delivered or closed (open=%v) before the Ack", open)
	case <-time.After(200 * time.Millisecond):
	}
	msg.Nack()
	select {
	case _, open := <-messages:
		if open {
			t.Fatal("a message after the context ended")
		}
	case <-deadline.Done():
		t.Fatal("channel not closed")
	}
	// The Subscriber goes on with other subscriptions.
	messages, err = sub.Subscribe(deadline, queue)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		select {
		case m := <-messages:
			m.Ack()
		case <-deadline.Done():
			t.Fatalf("received %d of 3", i)
		}
	}
}

// TestNoGoroutineLeak: after Close, the goroutines of the Publisher, the Subscriber
// and go-amqp are gone.
func TestNoGoroutineLeak(t *testing.T) {
	uri := requireBroker(t)
	queue := queueName(t, "leak")
	before := runtime.NumGoroutine()
	func() {
		ctx := testContext(t, 30*time.Second)
		sub, err := NewSubscriber(SubscriberConfig{URI: uri}, testLogger())
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Close()
		pub, err := NewPublisher(PublisherConfig{URI: uri}, testLogger())
		if err != nil {
			t.Fatal(err)
		}
		defer pub.Close()
		var chans []<-chan *message.Message
		for i := 0; i < 3; i++ {
			ch, err := sub.Subscribe(ctx, queue)
			if err != nil {
				t.Fatal(err)
			}
			chans = append(chans, ch)
		}
		if err := pub.Publish(queue, message.NewMessage(watermill.NewUUID(), nil)); err != nil {
			t.Fatal(err)
		}
		select {
		case m := <-chans[0]:
			m.Ack()
		case m := <-chans[1]:
			m.Ack()
		case m := <-chans[2]:
			m.Ack()
		case <-ctx.Done():
			t.Fatal("no message")
		}
	}()
	var after int
	for i := 0; i < 50; i++ {
		after = runtime.NumGoroutine()
		if after <= before {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	buf := make([]byte, 1<<20)
	t.Fatalf("%d goroutines before, %d after Close:\n%s", before, after, buf[:runtime.Stack(buf, true)])
}

// TestCredentialsNeverLogged: a refused login and an unreachable broker: neither the
// errors nor the logs carry the password.
func TestCredentialsNeverLogged(t *testing.T) {
	uri := requireBroker(t)
	e, _ := parseURI(uri, nil)
	const secret = "wrong-s3cr3t"
	for _, bad := range []string{
		strings.Replace(e.addr, "://", "://guest:"+secret+"@", 1) + "/",
		"amqp://guest:" + secret + "@127.0.0.1:1/",
	} {
		logger := watermill.NewCaptureLogger()
		pub, err := NewPublisher(PublisherConfig{URI: bad, PublishTimeout: 5 * time.Second}, logger)
		if err != nil {
			t.Fatal(err)
		}
		perr := pub.Publish("nowhere", message.NewMessage(watermill.NewUUID(), nil))
		_ = pub.Close()
		sub, err := NewSubscriber(SubscriberConfig{URI: bad}, logger)
		if err != nil {
			t.Fatal(err)
		}
		_, serr := sub.Subscribe(context.Background(), "nowhere")
		ierr := sub.SubscribeInitialize("nowhere")
		_ = sub.Close()
		for _, err := range []error{perr, serr, ierr} {
			if err == nil {
				t.Errorf("no error with a bad URI")
				continue
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("error shows the password: %v", err)
			}
		}
		t.Logf("errors: %v | %v", perr, serr)
		for _, msgs := range logger.Captured() {
			for _, m := range msgs {
				if s := fmt.Sprint(m); strings.Contains(s, secret) {
					t.Errorf("log shows the password: %s", s)
				}
			}
		}
	}
}
