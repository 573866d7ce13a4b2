package delay_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
)

// step is a backend value defined in a test inside the module (delay.Backend is sealed:
// it embeds one for its unexported method, and implements the internal
// backend.Opener): it opens stepBackend, which keeps a copy in this process for one
// step of 20ms, and refuses a delay past one second. The middleware takes it through
// its Caps and the traits it implements alone.
type stepValue struct {
	delay.Backend
	pub message.Publisher
}

func (v stepValue) Backends() []backend.Opener { return nil }

func (stepValue) Name() string   { return "step" }
func (stepValue) String() string { return "step" }
func (v stepValue) Open(backend.Setup) (backend.Backend, error) {
	return stepBackend{v.pub}, nil
}

type stepBackend struct{ pub message.Publisher }

const step = 20 * time.Millisecond

func (stepBackend) Name() string { return "step" }
func (stepBackend) Caps() backend.Caps {
	return backend.Caps{Keeps: backend.KeepsCopy, Longest: time.Second, PastLongest: backend.Refuse,
		CarriesEnvelope: true, Text: "20ms, up to 1s"}
}
func (b stepBackend) Local() message.Publisher { return b.pub }
func (stepBackend) Effective(d time.Duration) (time.Duration, error) {
	if d > time.Second {
		return 0, fmt.Errorf("step: %w: %s", delay.ErrDelayTooLong, d)
	}
	return step, nil
}
func (stepBackend) Topology() topology.Topology        { return topology.Topology{} }
func (stepBackend) WorkQueue(string) topology.Topology { return topology.Topology{} }
func (stepBackend) DelayQueues() []backend.DelayQueue  { return nil }
func (stepBackend) Close() error                       { return nil }
func (b stepBackend) Park(_ context.Context, queue string, msg *message.Message, effective time.Duration) error {
	cp := msg.Copy()
	time.AfterFunc(effective, func() { _ = b.pub.Publish(queue, cp) })
	return nil
}

// TestBackendDefinedInATest: a new backend is a value type; the Config, its validation
// and the middleware take it without a change: a failure comes back through it
// carrying its envelope, and a delay past its longest is poisoned, as its Caps say.
func TestBackendDefinedInATest(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
	defer pubsub.Close()
	cfg := amqpretry.Config{Backend: stepValue{pub: pubsub}, Policy: amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{10 * time.Millisecond}, Jitter: -1}}
	r, err := middleware.New(cfg, middleware.Transport{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	poisoned, err := pubsub.Subscribe(ctx, cfg.WithDefaults().PoisonQueue)
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(r.Middleware)
	seen := make(chan middleware.Envelope, 4)
	router.AddConsumerHandler("h", "work", pubsub, func(msg *message.Message) error {
		env := middleware.ReadEnvelope(msg.Metadata)
		seen <- env
		if env.Attempt < 2 {
			return errors.New("first attempt fails")
		}
		return amqpretry.RetryAfter(errors.New("second asks for an hour"), time.Hour)
	})
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()
	if err := pubsub.Publish("work", message.NewMessage("m", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	for want := 1; want <= 2; want++ {
		select {
		case env := <-seen:
			if max(env.Attempt, 1) != want {
				t.Fatalf("delivery %d: attempt %d", want, env.Attempt)
			}
			if want == 2 && (env.RequestedDelay != 10*time.Millisecond || env.EffectiveDelay != step || env.Queue != "work") {
				t.Errorf("retry's envelope %+v, want requested 10ms, effective %s (the backend's step), queue work", env, step)
			}
		case <-ctx.Done():
			t.Fatalf("delivery %d never came", want)
		}
	}
	select {
	case msg := <-poisoned:
		msg.Ack()
		if env := middleware.ReadEnvelope(msg.Metadata); env.Reason != amqpretry.ReasonDelayTooLong || env.Attempt != 2 {
			t.Errorf("poisoned with %q after attempt %d, want %q after 2", env.Reason, env.Attempt, amqpretry.ReasonDelayTooLong)
		}
	case <-ctx.Done():
		t.Fatal("the delay past the backend's longest was never poisoned")
	}
}
