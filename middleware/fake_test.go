package middleware

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/derived"
	"github.com/amqpretry/amqpretry/topology"
)

// fakeBackend is an in-memory backend.Backend: it applies every delay as asked (or as
// effective says) and keeps what it is given to park, or fails as park says. It can
// what caps says (zero: keeps a copy, any delay, no longest).
type fakeBackend struct {
	name      string
	caps      backend.Caps
	effective func(time.Duration) (time.Duration, error)
	park      func(msg *message.Message) error // nil: accept

	mu     sync.Mutex
	parked []parked
}

type parked struct {
	queue     string
	msg       *message.Message
	effective time.Duration
	ctxErr    error // of the context Park was given, when it was called
}

var _ backend.Backend = (*fakeBackend)(nil)

func (b *fakeBackend) Name() string {
	if b.name == "" {
		return "fake"
	}
	return b.name
}

func (b *fakeBackend) Caps() backend.Caps { return b.caps }

func (b *fakeBackend) Effective(d time.Duration) (time.Duration, error) {
	if b.effective != nil {
		return b.effective(d)
	}
	return d, nil
}

func (b *fakeBackend) Topology() topology.Topology        { return topology.Topology{} }
func (b *fakeBackend) WorkQueue(string) topology.Topology { return topology.Topology{} }
func (b *fakeBackend) DelayQueues() []backend.DelayQueue  { return nil }
func (b *fakeBackend) Close() error                       { return nil }
func (b *fakeBackend) Park(ctx context.Context, queue string, msg *message.Message, effective time.Duration) error {
	if b.park != nil {
		if err := b.park(msg); err != nil {
			return err
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.parked = append(b.parked, parked{queue: queue, msg: msg.Copy(), effective: effective, ctxErr: ctx.Err()})
	return nil
}

func (b *fakeBackend) msgs() []*message.Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []*message.Message
	for _, p := range b.parked {
		out = append(out, p.msg)
	}
	return out
}

// poisonQueue records what the engine poisons, or fails as publish says.
type poisonQueue struct {
	publish func(msg *message.Message) error // nil: accept

	mu   sync.Mutex
	msgs []*message.Message
}

func (p *poisonQueue) send(ctx context.Context, msg *message.Message) error {
	if err := ctx.Err(); err != nil {
		return err // as the hand-off does
	}
	if p.publish != nil {
		if err := p.publish(msg); err != nil {
			return err
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msg.Copy())
	return nil
}

func (p *poisonQueue) got() []*message.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*message.Message(nil), p.msgs...)
}

// newEngine builds an engine on b, with cfg and its defaults, poisoning into a
// recorder, every message from queue "work". The poison queue is "poison".
func newEngine(t testing.TB, cfg amqpretry.Config, b backend.Backend) (*engine, *poisonQueue) {
	t.Helper()
	if cfg.PoisonQueue == "" {
		cfg.PoisonQueue = "poison"
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	p := &poisonQueue{}
	e := &engine{cfg: cfg.WithDefaults(), heldRetries: derived.Of(cfg).HeldRetries, debug: debugs(cfg.WithDefaults().Logger), poisonQ: p.send, wiring: wiring{Queue: func(string) string { return "work" }}}
	e.outages = newOutages(e.cfg.Outage)
	e.dedup = newDedup(e.cfg)
	if b != nil {
		e.backend = keep(b)
	}
	return e, p
}

func failing(err error) message.HandlerFunc {
	return func(*message.Message) ([]*message.Message, error) { return nil, err }
}

// hurried returns a message whose context is done: the pauses after a failed hand-off
// return at once, so that tests of what they lead to take no time.
func hurried(uuid string) *message.Message {
	msg := message.NewMessage(uuid, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msg.SetContext(ctx)
	return msg
}

// tooLarge refuses, as the hand-off does past frame_max, a message with a metadata
// entry longer than limit bytes.
func tooLarge(limit int) func(*message.Message) error {
	return func(msg *message.Message) error {
		for k, v := range msg.Metadata {
			if len(k)+len(v) > limit {
				return fmt.Errorf("publish: %w: %s", backend.ErrTooLarge, k)
			}
		}
		return nil
	}
}

// startTest is start with what cfg derives.
func startTest(cfg amqpretry.Config, t Transport) (*retry, error) {
	return start(cfg, derived.Of(cfg), t)
}
