package amqp1

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// TestPublishOutcomes: what the broker does with a message decides Publish's error.
func TestPublishOutcomes(t *testing.T) {
	uri := requireBroker(t)
	full := queueName(t, "full") // classic: its length limit applies to each publish at once
	declareQueue(t, full, "classic", map[string]any{"x-max-length": int64(1), "x-overflow": "reject-publish"})
	missing := queueName(t, "missing")

	pub, err := NewPublisher(PublisherConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	newMsg := func() *message.Message { return message.NewMessage(watermill.NewUUID(), []byte("x")) }

	// Two messages in one call: the first fills the queue, the second is rejected.
	first, second := newMsg(), newMsg()
	err = pub.Publish(full, first, second)
	if !errors.Is(err, ErrNotAccepted) || !strings.Contains(err.Error(), "rejected") ||
		!strings.Contains(err.Error(), second.UUID) || !strings.Contains(err.Error(), fmt.Sprintf("queue %q", full)) {
		t.Errorf("queue at its limit: %v", err)
	}

	err = pub.Publish(missing, newMsg())
	if err == nil || errors.Is(err, ErrNotAccepted) || !strings.Contains(err.Error(), "not-found") {
		t.Errorf("missing queue: %v", err)
	}

	unroutable := newPublisherForAddress(t, uri, ExchangeAddress("amq.direct", "amqp1-test-"+runID+"-nobody"))
	err = unroutable.Publish("any", newMsg())
	if !errors.Is(err, ErrNotAccepted) || !strings.Contains(err.Error(), "released") {
		t.Errorf("unroutable: %v", err)
	}

	// The Publisher goes on after each failure.
	ok := queueName(t, "ok")
	declareQueue(t, ok, "quorum", nil)
	if err := pub.Publish(ok, newMsg(), newMsg(), newMsg()); err != nil {
		t.Errorf("after failures: %v", err)
	}
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(ok, newMsg()); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
	if got := drain(t, ok, time.Second); len(got) != 3 {
		t.Errorf("queue has %d messages, want 3", len(got))
	}
}

func newPublisherForAddress(t *testing.T, uri, address string) *Publisher {
	t.Helper()
	pub, err := NewPublisher(PublisherConfig{URI: uri, Address: func(string) string { return address }}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}
