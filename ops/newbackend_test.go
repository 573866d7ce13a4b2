package ops_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// ladder is a backend defined outside packages delay and middleware, in this file
// only: ttl-tiers' machinery under a name of its own and names of its own on the broker
// (<prefix>.ladder.delay.<tier>, <prefix>.ladder.deliver, ...). Nothing else in the
// module knows it: the Config, its validation, the middleware and ops take it as the
// value it is, through what its backend implements. (delay.Backend is sealed: a test
// inside the module embeds one for its unexported method, and implements the internal
// backend.Opener.)
type ladder struct {
	delay.Backend
	Tiers []time.Duration
}

func (ladder) Name() string               { return "ladder" }
func (ladder) String() string             { return "ladder" }
func (ladder) Backends() []backend.Opener { return backend.All(delay.TTLTiers()) }

func (l ladder) Open(s backend.Setup) (backend.Backend, error) {
	s.Prefix += ".ladder"
	b, err := backend.Open(delay.TTLTiers(l.Tiers...), s)
	if err != nil {
		return nil, err
	}
	return ladderBackend{b}, nil
}

// ladderBackend is ttl-tiers' backend under the ladder's name, with the storage ops
// reads (backend.Storage).
type ladderBackend struct{ backend.Backend }

func (ladderBackend) Name() string                { return "ladder" }
func (b ladderBackend) StoragePattern() string    { return b.Backend.(backend.Storage).StoragePattern() }
func (b ladderBackend) QueueOf(key string) string { return b.Backend.(backend.Storage).QueueOf(key) }
func (b ladderBackend) Unenumerable() string      { return b.Backend.(backend.Storage).Unenumerable() }

// TestBackendDefinedOutsideDelay: a backend that is one value type defined in a test
// is validated through the Config, retries a real failure through the broker with
// wamqp3's middleware, and ops counts it in its status, lists it waiting, brings it
// back now, and tears its storage down, all under the names it chose.
func TestBackendDefinedOutsideDelay(t *testing.T) {
	t.Parallel()
	skipShort(t)
	if err := (amqpretry.Config{Backend: ladder{Tiers: []time.Duration{time.Microsecond}}}).Validate(); err == nil || !strings.Contains(err.Error(), "Tiers[0]") {
		t.Errorf("Validate of a ladder without tiers: %v, want its own refusal", err)
	}
	cfg := amqpretry.Config{Backend: ladder{Tiers: []time.Duration{time.Second, waitDelay}},
		Policy: amqpretry.Policy{MaxAttempts: 4, Delays: []time.Duration{time.Second}, Jitter: -1}}
	r := waitingRig(t, cfg, "orders")
	queue := r.queues[0]
	tier := r.prefix + ".ladder.delay.10m"
	if err := r.cfg.Retry.Validate(); err != nil {
		t.Fatal(err)
	}

	retry, err := wamqp3.New(amqp3.NewDurableQueueConfig(r.cfg.URI), r.cfg.Retry)
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	seen := make(chan middleware.Envelope, 4)
	if _, err := retry.AddHandler(router, "orders", queue, func(msg *message.Message) error {
		env := middleware.ReadEnvelope(msg.Metadata)
		seen <- env
		switch max(env.Attempt, 1) {
		case 1:
			return errors.New("warehouse offline") // the policy's 1s tier
		case 2:
			return amqpretry.RetryAfter(errors.New("come back later"), waitDelay) // the 10m tier
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(ctx) }()
	stop := func() {
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("router did not stop")
		}
		_ = retry.Close()
	}
	defer func() {
		if ctx.Err() == nil {
			stop()
		}
	}()
	<-router.Running()
	pub, err := amqp3.NewPublisher(amqp3.NewDurableQueueConfig(r.cfg.URI), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Publish(queue, message.NewMessage("ladder-1", []byte("order 7"))); err != nil {
		t.Fatal(err)
	}
	next := func(attempt int) middleware.Envelope {
		t.Helper()
		select {
		case env := <-seen:
			if max(env.Attempt, 1) != attempt {
				t.Fatalf("delivery of attempt %d, want %d", env.Attempt, attempt)
			}
			return env
		case <-time.After(30 * time.Second):
			t.Fatalf("attempt %d never came", attempt)
		}
		return middleware.Envelope{}
	}
	next(1)
	if env := next(2); env.EffectiveDelay != time.Second || env.Queue != queue {
		t.Errorf("the retry through the ladder: %+v, want effective 1s, queue %s", env, queue)
	}

	// ops: status counts it in the ladder's own tier queue, the waiting list finds it
	// there with its work queue, retry-now brings it back.
	waitFor(t, 30*time.Second, func() bool {
		s, err := r.ops.Status(context.Background(), ops.StatusOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if s.Backend != "ladder" {
			t.Fatalf("status backend %q, want ladder", s.Backend)
		}
		i := slices.IndexFunc(s.Queues, func(q ops.QueueStatus) bool { return q.Name == tier })
		return i >= 0 && s.Queues[i].Exists && s.Queues[i].Ready == 1
	})
	r.waitWaiting(1)
	res := r.listWaiting(ops.Filter{})
	if m := res.Messages[0]; m.UUID != "ladder-1" || m.DelayQueue != tier || m.Queue != queue || m.Attempt != 3 {
		t.Errorf("waiting: %+v, want ladder-1 of %s in %s, its attempt 3 next", m, queue, tier)
	}
	if moved, err := r.ops.Redrive(context.Background(), ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: queue}}); err != nil || moved.Done != 1 {
		t.Fatalf("retry now: %v %+v", err, moved)
	}
	next(3)
	stop()

	// Teardown finds the ladder's storage by its plan and removes it once nothing waits.
	var td ops.TeardownResult
	waitFor(t, 30*time.Second, func() bool {
		td, err = r.ops.Teardown(context.Background(), ops.TeardownOptions{DryRun: true})
		return err == nil
	})
	if !slices.Contains(td.Queues, tier) || !slices.Contains(td.Exchanges, r.prefix+".ladder.deliver") {
		t.Fatalf("teardown dry run: %+v, want the ladder's tier queue and delivery exchange", td)
	}
	if _, err := r.ops.Teardown(context.Background(), ops.TeardownOptions{}); err != nil {
		t.Fatal(err)
	}
	if exists(t, tier, false) || exists(t, r.prefix+".ladder.deliver", true) {
		t.Error("the ladder's storage survived its teardown")
	}
}
