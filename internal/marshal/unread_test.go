package marshal

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/keys"
)

var errRefused = errors.New("refused")

// refusals records Reads.Refuse's calls.
type refusals struct{ n, first []int }

func (r *refusals) refuse(_ *message.Message, n int, first bool) error {
	r.n = append(r.n, n)
	if first {
		r.first = append(r.first, n)
	}
	return errRefused
}

// guarded is a retry subscriber's marshaler marking deliveries "r1", with a guard.
func guarded(reads *Reads) Marshaler {
	return Marshaler{Options{Retry: true, Guard: reads.Guard(),
		Delivered: func(msg *message.Message, _ int) { msg.Metadata[keys.Subscriber] = "r1" }}}
}

func delivery(uuid string, redelivered bool) amqp.Delivery {
	return amqp.Delivery{DeliveryTag: 1, Redelivered: redelivered, Headers: amqp.Table{DefaultUUIDKey: uuid}, Body: []byte("x")}
}

// routed runs the messages sent on it through a Watermill router's handler that fails
// them all, with no middleware: the router nacks each.
func routed(t *testing.T) chan<- *message.Message {
	t.Helper()
	in := make(chanSub)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("no-middleware", "topic", in, func(*message.Message) error { return errRefused })
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() { _ = in.Close(); _ = router.Close() })
	return in
}

// chanSub is a message.Subscriber of one channel.
type chanSub chan *message.Message

func (c chanSub) Subscribe(context.Context, string) (<-chan *message.Message, error) { return c, nil }
func (c chanSub) Close() error                                                       { return nil }

// TestGuardRefusesTheRedeliveryOfAMessageNoMiddlewareRead: a message let through,
// nacked by a router handler that has no middleware of the Retry, and redelivered while
// no middleware of the Retry has read a message of its mark is refused, every time,
// each refusal counted and the first said to be first; what the middleware reads lets
// everything through again.
func TestGuardRefusesTheRedeliveryOfAMessageNoMiddlewareRead(t *testing.T) {
	r := &refusals{}
	reads := &Reads{Refuse: func(m *message.Message, n int, first, _ bool) error { return r.refuse(m, n, first) }}
	m := guarded(reads)
	router := routed(t)
	msg, err := m.Unmarshal(delivery("bad", false))
	if err != nil {
		t.Fatal(err)
	}
	router <- msg
	<-msg.Nacked()
	for range 3 {
		if _, err := m.Unmarshal(delivery("bad", true)); !errors.Is(err, errRefused) {
			t.Fatalf("redelivery of a nacked message no middleware read: %v, want refused", err)
		}
	}
	if len(r.n) != 3 || r.n[2] != 3 || len(r.first) != 1 {
		t.Errorf("refusals %v, first %v: want 1, 2, 3, the first once", r.n, r.first)
	}
	reads.Read("r1")
	if _, err := m.Unmarshal(delivery("bad", true)); err != nil {
		t.Errorf("after a middleware read a message of its mark: %v", err)
	}
}

// TestGuardLetsThrough what it cannot tell from a loop: the redelivery of a message
// nacked by hand, with no router (as Watermill's pub/sub tests read a subscriber), of
// one that was not nacked through its message (its subscriber closed, say), a message
// published again (not redelivered), one without a UUID, and any message once its mark
// is read.
func TestGuardLetsThrough(t *testing.T) {
	r := &refusals{}
	reads := &Reads{Refuse: func(m *message.Message, n int, first, _ bool) error { return r.refuse(m, n, first) }}
	m := guarded(reads)
	msg, _ := m.Unmarshal(delivery("by-hand", false))
	msg.Nack()
	if _, err := m.Unmarshal(delivery("by-hand", true)); err != nil {
		t.Errorf("redelivery of a message nacked without a router: %v", err)
	}
	router := routed(t)
	msg, _ = m.Unmarshal(delivery("routed", false))
	router <- msg
	<-msg.Nacked()
	if _, err := m.Unmarshal(delivery("closing", false)); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Unmarshal(delivery("closing", true)); err != nil {
		t.Errorf("redelivery of a message never nacked: %v", err)
	}
	msg, _ = m.Unmarshal(delivery("again", false))
	router <- msg
	<-msg.Nacked()
	if _, err := m.Unmarshal(delivery("again", false)); err != nil {
		t.Errorf("the same UUID published again: %v", err)
	}
	msg, _ = m.Unmarshal(delivery("", false))
	router <- msg
	<-msg.Nacked()
	if _, err := m.Unmarshal(delivery("", true)); err != nil {
		t.Errorf("a message without a UUID: %v", err)
	}
	if len(r.n) != 0 {
		t.Errorf("refused %d", len(r.n))
	}
	if reads.unread.Load() != 1 {
		t.Errorf("%d marks unread, want 1", reads.unread.Load())
	}
	reads.Read("r1")
	reads.Read("r1")
	if reads.unread.Load() != 0 {
		t.Errorf("%d marks unread after a read, want 0", reads.unread.Load())
	}
}
