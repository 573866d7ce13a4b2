package amqp1

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

func TestAddresses(t *testing.T) {
	for _, tc := range []struct{ got, want string }{
		{QueueAddress("orders"), "/queues/orders"},
		{QueueAddress("a b/c:d+e~f.g_h-i"), "/queues/a%20b%2Fc%3Ad%2Be~f.g_h-i"},
		{QueueAddress("żółw"), "/queues/%C5%BC%C3%B3%C5%82w"},
		{ExchangeAddress("events", "order.created"), "/exchanges/events/order.created"},
		{ExchangeAddress("events", ""), "/exchanges/events"},
		{ExchangeAddress("", "orders"), "/exchanges/amq.default/orders"},
		{ExchangeAddress("a/b", "c d"), "/exchanges/a%2Fb/c%20d"},
	} {
		if tc.got != tc.want {
			t.Errorf("got %q, want %q", tc.got, tc.want)
		}
	}
}

// TestOddQueueName: a queue name with characters the address must encode works end to
// end, declared, published to and consumed.
func TestOddQueueName(t *testing.T) {
	uri := requireBroker(t)
	queue := queueName(t, "odd name/with:chars+żółw")
	ctx := testContext(t, 30*time.Second)
	sub, err := NewSubscriber(SubscriberConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := NewPublisher(PublisherConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	want := message.NewMessage(watermill.NewUUID(), []byte("x"))
	if err := pub.Publish(queue, want); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-messages:
		got.Ack()
		if got.UUID != want.UUID {
			t.Errorf("got %s, want %s", got.UUID, want.UUID)
		}
	case <-ctx.Done():
		t.Fatal("no message")
	}
}
