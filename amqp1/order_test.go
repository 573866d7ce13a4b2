package amqp1

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/names"
)

// TestRetryKeepsOrder is the order projection over AMQP 1.0 (Config.OrderKey, the
// delivery-time backend): 6 accounts, 6 events each, one in four failing its first
// attempt; every account's events are applied in exact order, the retries held by the
// broker with the key in their annotations, and every key is released, its behind
// queue deleted.
func TestRetryKeepsOrder(t *testing.T) {
	const accounts, seqs = 6, 6
	failsOnce := func(a, seq int) bool { return (a*7+seq*3)%4 == 0 }
	var mu sync.Mutex
	last := map[string]int{}
	var outOfOrder []string
	applied, failing := 0, 0
	done := make(chan struct{})
	var blocked, released int
	cfg := amqpretry.Config{
		Policy:   amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{300 * time.Millisecond}, Jitter: -1},
		OrderKey: func(msg *message.Message) string { return msg.Metadata.Get("account") },
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
	}
	rig := newRetryRig(t, "order", cfg, func(msg *message.Message, attempt int) error {
		acc := msg.Metadata.Get("account")
		a, _ := strconv.Atoi(acc[len("acc"):])
		seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
		if failsOnce(a, seq) && attempt == 1 {
			return errors.New("lock timeout")
		}
		mu.Lock()
		defer mu.Unlock()
		if seq <= last[acc] {
			return nil // a duplicate (at-least-once)
		}
		if seq != last[acc]+1 {
			outOfOrder = append(outOfOrder, fmt.Sprintf("%s/%d after %d", acc, seq, last[acc]))
		}
		last[acc] = seq
		if applied++; applied == accounts*seqs {
			close(done)
		}
		return nil
	})
	var behind []string
	for a := range accounts {
		behind = append(behind, names.Names{Prefix: rig.prefix}.Behind(rig.topic, "acc"+strconv.Itoa(a)))
	}
	t.Cleanup(func() { deleteQueues(t, behind...) })
	for seq := 1; seq <= seqs; seq++ {
		for a := range accounts {
			if failsOnce(a, seq) {
				failing++
			}
			msg := message.NewMessage(fmt.Sprintf("acc%d-%d", a, seq), []byte("event"))
			msg.Metadata.Set("account", "acc"+strconv.Itoa(a))
			msg.Metadata.Set("seq", strconv.Itoa(seq))
			if err := rig.pub.Publish(rig.topic, msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		mu.Lock()
		defer mu.Unlock()
		t.Fatalf("%d of %d events applied within 60 s", applied, accounts*seqs)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		mu.Lock()
		b, r := blocked, released
		mu.Unlock()
		if b == r {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d keys blocked, %d released", b, r)
		case <-time.After(50 * time.Millisecond):
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(outOfOrder) > 0 {
		t.Errorf("%d events applied out of order: %v", len(outOfOrder), outOfOrder)
	}
	if blocked == 0 {
		t.Error("no key was ever blocked: the scenario did not exercise order")
	}
	if st := rig.retry.Stats(); st.Retries != int64(failing) || st.Poisoned != 0 || st.BlockedKeys != 0 {
		t.Errorf("stats %+v, want %d retries, none poisoned, no key blocked", st, failing)
	}
	for _, q := range behind {
		if queueExists(t, rig.uri, q) {
			t.Errorf("behind queue %s left after every release", q)
		}
	}
}
