package middleware

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
)

// TestOrderReadsWhatOthersPutBehind: a key this process blocked, with nothing it put
// behind it, is released without reading what is behind it; a message put there by
// someone else meanwhile (an operator's redrive sends a poisoned head behind its key)
// keeps the key blocked (its queue is not empty), and runs, in order, before the key's
// next message.
func TestOrderReadsWhatOthersPutBehind(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer pubsub.Close()
	blockedCh := make(chan struct{}, 1)
	var mu sync.Mutex
	var blocked, released int
	retry, err := New(amqpretry.Config{
		Backend:  delay.Memory(pubsub),
		Policy:   amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{200 * time.Millisecond}},
		OrderKey: func(msg *message.Message) string { return msg.Metadata.Get("key") },
		Observe: func(ev amqpretry.Event) {
			mu.Lock()
			defer mu.Unlock()
			switch ev.Kind {
			case amqpretry.EventKeyBlocked:
				blocked++
				blockedCh <- struct{}{}
			case amqpretry.EventKeyReleased:
				released++
			}
		},
	}, Transport{})
	if err != nil {
		t.Fatal(err)
	}
	defer retry.Close()
	event := func(seq int) *message.Message {
		msg := message.NewMessage("k-"+strconv.Itoa(seq), nil)
		msg.Metadata.Set("key", "k")
		msg.Metadata.Set("seq", strconv.Itoa(seq))
		return msg
	}
	p := &inOrder{last: map[string]int{}, done: make(chan struct{}), total: 3}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("projection", "events", pubsub, func(msg *message.Message) error {
		seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
		if seq == 1 && amqpretry.Attempt(msg) == 1 {
			return errors.New("lock timeout")
		}
		p.apply(msg.Metadata.Get("key"), seq)
		return nil
	}).AddMiddleware(retry.Middleware)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	if err := pubsub.Publish("events", event(1)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-blockedCh:
	case <-time.After(10 * time.Second):
		t.Fatal("the key was not blocked when its first event failed")
	}
	// Event 2 is put behind the key by someone else, while its head waits.
	lines := retry.r.order.lines.(*memoryLines)
	lines.mu.Lock()
	k := orderKey{"events", "k"}
	lines.seq++
	lines.line[k] = append(lines.line[k], behindMsg{seq: lines.seq, msg: event(2)})
	lines.mu.Unlock()

	// Event 3 comes once the key is released, after event 2 ran.
	deadline := time.After(30 * time.Second)
	for {
		mu.Lock()
		r := released
		mu.Unlock()
		if r > 0 {
			break
		}
		select {
		case <-deadline:
			t.Fatal("the key was not released")
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := pubsub.Publish("events", event(3)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.done:
	case <-deadline:
		p.mu.Lock()
		defer p.mu.Unlock()
		t.Fatalf("%d of 3 events applied", p.count)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.outOfOrder) > 0 {
		t.Errorf("out of order: %v", p.outOfOrder)
	}
	mu.Lock()
	defer mu.Unlock()
	if blocked != 1 || released != 1 {
		t.Errorf("%d blocks, %d releases, want 1 each", blocked, released)
	}
}
