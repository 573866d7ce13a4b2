package middleware

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/topology"
)

// inOrder is a projection of keys' events, numbered from 1: it records each event
// applied that is not the next of its key.
type inOrder struct {
	mu         sync.Mutex
	last       map[string]int
	outOfOrder []string
	count      int
	done       chan struct{}
	total      int
}

func (p *inOrder) apply(key string, seq int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if seq <= p.last[key] {
		return // a duplicate
	}
	if seq != p.last[key]+1 {
		p.outOfOrder = append(p.outOfOrder, fmt.Sprintf("%s/%d after %d", key, seq, p.last[key]))
	}
	p.last[key] = seq
	if p.count++; p.count == p.total {
		close(p.done)
	}
}

// TestOrderInProcess: the memory backend keeps each key's order in this process, one
// in four events failing once, and through an outage of the queue: while its
// dependency is down every message waits, probes fail and take the retry path as their
// key's head, and once it is back every key's events are applied in order.
func TestOrderInProcess(t *testing.T) {
	const keys, seqs = 5, 12
	// In order on delivery: each publish waits for the message's ack.
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer pubsub.Close()
	var blocked, released int
	var mu sync.Mutex
	retry, err := New(amqpretry.Config{
		Backend:  delay.Memory(pubsub),
		Policy:   amqpretry.Policy{MaxAttempts: 30, Delays: []time.Duration{20 * time.Millisecond}},
		Outage:   amqpretry.Outage{Consecutive: 3, ProbeInterval: 5 * time.Millisecond},
		OrderKey: func(msg *message.Message) string { return msg.Metadata.Get("key") },
		Observe: func(ev amqpretry.Event) {
			mu.Lock()
			defer mu.Unlock()
			switch ev.Kind {
			case amqpretry.EventKeyBlocked:
				blocked++
			case amqpretry.EventKeyReleased:
				released++
			}
		},
	}, Transport{})
	if err != nil {
		t.Fatal(err)
	}
	defer retry.Close()
	p := &inOrder{last: map[string]int{}, done: make(chan struct{}), total: keys * seqs}
	var down sync.Map // "down" while the dependency is down
	var downRuns int
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("projection", "events", pubsub, func(msg *message.Message) error {
		key := msg.Metadata.Get("key")
		seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
		if _, ok := down.Load("down"); ok {
			mu.Lock()
			downRuns++
			mu.Unlock()
			return errors.New("database unreachable")
		}
		if (seq*3+len(key))%4 == 0 && amqpretry.Attempt(msg) == 1 {
			return errors.New("lock timeout")
		}
		p.apply(key, seq)
		return nil
	}).AddMiddleware(retry.Middleware)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	go func() {
		for seq := 1; seq <= seqs; seq++ {
			if seq == seqs/2 {
				down.Store("down", true)
				go func() {
					time.Sleep(300 * time.Millisecond) // the dependency's outage, not a wait on the code under test
					down.Delete("down")
				}()
			}
			for k := range keys {
				msg := message.NewMessage(fmt.Sprintf("k%d-%d", k, seq), nil)
				msg.Metadata.Set("key", "k"+strconv.Itoa(k))
				msg.Metadata.Set("seq", strconv.Itoa(seq))
				if err := pubsub.Publish("events", msg); err != nil {
					t.Error(err)
				}
			}
		}
	}()
	select {
	case <-p.done:
	case <-time.After(60 * time.Second):
		p.mu.Lock()
		defer p.mu.Unlock()
		t.Fatalf("%d of %d applied", p.count, p.total)
	}
	deadline := time.After(10 * time.Second)
	for {
		mu.Lock()
		b, r := blocked, released
		mu.Unlock()
		if b == r && b > 0 {
			break
		}
		select {
		case <-deadline:
			t.Fatalf("%d keys blocked, %d released", b, r)
		case <-time.After(10 * time.Millisecond):
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.outOfOrder) > 0 {
		t.Errorf("out of order: %v", p.outOfOrder)
	}
	if st := retry.Stats(); st.Poisoned != 0 || st.BlockedKeys != 0 || st.Behind != 0 || st.Outages == 0 {
		t.Errorf("stats %+v, want an outage, nothing poisoned, no key left blocked", st)
	}
	mu.Lock()
	defer mu.Unlock()
	if downRuns == 0 {
		t.Error("the dependency's outage was never met: the scenario did not exercise it")
	}
}

// TestOrderConfigRefused: an order key needs topology mode declare, and BlockOnPoison
// needs an order key; each refusal names the field and the fix.
func TestOrderConfigRefused(t *testing.T) {
	key := func(*message.Message) string { return "" }
	for _, tc := range []struct {
		cfg  amqpretry.Config
		want string
	}{
		{amqpretry.Config{OrderKey: key, Topology: topology.ModeVerify}, "OrderKey: not with topology mode verify"},
		{amqpretry.Config{OrderKey: key, Topology: topology.ModeNone}, "OrderKey: not with topology mode none"},
		{amqpretry.Config{BlockOnPoison: true}, "BlockOnPoison: set without OrderKey"},
	} {
		err := tc.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate() = %v, want %q", err, tc.want)
		}
	}
}

// TestOrderKeyPanics: an OrderKey that panics leaves the message unordered, logged
// once, and the handler runs.
func TestOrderKeyPanics(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubsub.Close()
	logs := watermill.NewCaptureLogger()
	retry, err := New(amqpretry.Config{
		Backend:  delay.Memory(pubsub),
		OrderKey: func(*message.Message) string { panic("no key") },
		Logger:   logs,
	}, Transport{})
	if err != nil {
		t.Fatal(err)
	}
	defer retry.Close()
	ran := 0
	h := retry.Middleware(func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil })
	for i := range 3 {
		msg := message.NewMessage(strconv.Itoa(i), nil)
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	}
	if ran != 3 {
		t.Errorf("handler ran %d times, want 3", ran)
	}
	if n := len(logs.Captured()[watermill.ErrorLogLevel]); n != 1 {
		t.Errorf("%d ERROR lines, want 1", n)
	}
}
