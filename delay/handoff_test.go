package delay_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
	"github.com/amqpretry/amqpretry/topology"
)

func dialHandoff(t *testing.T) (*delay.Handoff, string) {
	t.Helper()
	h := dialTestHandoff(t)
	q := brokertest.Prefix(t) + ".q"
	if err := h.Declare(topology.Topology{Queues: []topology.Queue{{Name: q}}}); err != nil {
		t.Fatal(err)
	}
	brokertest.Cleanup(t, []string{q}, nil)
	return h, q
}

func TestHandoffFailuresAreReportedAndRecovered(t *testing.T) {
	h, q := dialHandoff(t)
	ctx := context.Background()
	msg := func() *message.Message { return message.NewMessage("m", []byte("body")) }

	// Unroutable: the broker returns the mandatory publish before it acks it.
	err := h.PublishMessage(ctx, "", q+".nowhere", msg(), nil)
	if !errors.Is(err, delay.ErrReturned) {
		t.Fatalf("publish to a missing queue: %v, want ErrReturned", err)
	}
	// A missing exchange makes the broker close the channel: no confirm ever comes.
	err = h.PublishMessage(ctx, q+".no-such-exchange", q, msg(), nil)
	if !errors.Is(err, delay.ErrNotConfirmed) {
		t.Fatalf("publish to a missing exchange: %v, want ErrNotConfirmed", err)
	}
	// The next publish opens a new channel and goes through.
	if err := h.PublishMessage(ctx, "", q, msg(), nil); err != nil {
		t.Fatalf("publish after a closed channel: %v", err)
	}
	if n := brokertest.QueueLength(t, q); n != 1 {
		t.Fatalf("queue %s holds %d messages, want exactly the confirmed one", q, n)
	}
}

func TestHandoffPublishesSafeCopies(t *testing.T) {
	h, q := dialHandoff(t)
	ctx := context.Background()
	const n = 50
	var wg sync.WaitGroup
	errs := make(chan error, 2*n)
	for range n { // concurrent publishes share the confirm channel
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := message.NewMessage("same-uuid", []byte("body"))
			m.Metadata.Set("x-death", "stale")
			m.Metadata.Set("user-key", "kept")
			errs <- delay.PublishRaw(ctx, h, "", q, amqp.Publishing{Body: m.Payload, Expiration: "60000"})
			errs <- h.PublishMessage(ctx, "", q, m, nil)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	fromMessages := 0
	for range 2 * n {
		d, ok, err := ch.Get(q, true)
		if err != nil || !ok {
			t.Fatalf("get: ok=%v err=%v", ok, err)
		}
		if d.DeliveryMode != amqp.Persistent || d.Expiration != "" || d.MessageId == "" || ids[d.MessageId] {
			t.Fatalf("unsafe copy: mode=%d expiration=%q id=%q (seen before: %v)", d.DeliveryMode, d.Expiration, d.MessageId, ids[d.MessageId])
		}
		ids[d.MessageId] = true
		if _, ok := d.Headers["x-death"]; ok {
			t.Errorf("broker-owned header x-death was sent back")
		}
		if _, ok := d.Headers["_watermill_message_uuid"]; ok { // published from the message
			fromMessages++
			if d.Headers["user-key"] != "kept" {
				t.Errorf("user header lost: %v", d.Headers)
			}
		}
	}
	if fromMessages != n {
		t.Errorf("%d copies of the message, want %d", fromMessages, n)
	}
}
