package ops_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// TestRealRetriesThenRedrive: a router on wamqp3 whose handler fails retries a message
// through the broker until it is poisoned; ops lists it with the envelope the
// middleware wrote, redrives it, and the handler gets it back and succeeds.
func TestRealRetriesThenRedrive(t *testing.T) {
	r := newRig(t, "orders")
	r.apply()
	queue := r.queues[0]
	retry, err := wamqp3.New(amqp3.NewDurableQueueConfig(r.cfg.URI), amqpretry.Config{
		Prefix: r.prefix, Backend: delay.TTLTiers(testTiers...), Policy: amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{time.Second}, Jitter: -1},
	})
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	attempts := 0
	redriven := make(chan middleware.Envelope, 1)
	if _, err := retry.AddHandler(router, "orders", queue, func(msg *message.Message) error {
		env := middleware.ReadEnvelope(msg.Metadata)
		if env.Redriven > 0 {
			redriven <- env
			return nil
		}
		mu.Lock()
		attempts++
		mu.Unlock()
		return errors.New("warehouse offline")
	}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(ctx) }()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("router did not stop")
		}
		_ = retry.Close()
	}()
	<-router.Running()
	pub, err := amqp3.NewPublisher(amqp3.NewDurableQueueConfig(r.cfg.URI), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Publish(queue, message.NewMessage("real-1", []byte("order 1042"))); err != nil {
		t.Fatal(err)
	}
	var m ops.Message
	waitFor(t, 30*time.Second, func() bool {
		res, err := r.ops.List(context.Background(), ops.Poison, ops.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Messages) == 1 {
			m = res.Messages[0]
		}
		return len(res.Messages) == 1
	})
	if m.UUID != "real-1" || m.Queue != queue || m.Topic != queue || m.Handler != "orders" || m.Reason != amqpretry.ReasonMaxAttempts ||
		m.Attempt != 2 || m.MaxAttempts != 2 || m.Error != "warehouse offline" || m.FirstFailure.IsZero() || !m.LastFailure.After(m.FirstFailure) {
		t.Errorf("poisoned by the middleware: %+v", m)
	}
	res, err := r.ops.Redrive(context.Background(), ops.Poison, ops.MoveOptions{ResetAttempts: true})
	if err != nil || res.Done != 1 {
		t.Fatalf("redrive: %v %+v", err, res)
	}
	select {
	case env := <-redriven:
		if env.Redriven != 1 || env.RedrivenFrom != r.poisonQueue() || env.Attempt != 0 || env.Reason != "" {
			t.Errorf("redriven envelope: %+v", env)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the redriven message never came back to the handler")
	}
	mu.Lock()
	defer mu.Unlock()
	if attempts != 2 {
		t.Errorf("%d failed attempts before the poisoning, want 2", attempts)
	}
}
