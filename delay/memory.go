package delay

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// memory holds each message in a timer of this process and publishes it to Config.Memory
// when its delay is over. It is NOT durable: messages waiting when the process stops
// (or Close is called) are lost. It exists for tests and for the quickstart on
// Watermill's GoChannel; never use it in production.
type memory struct {
	pub    message.Publisher
	logger watermill.LoggerAdapter

	mu     sync.Mutex
	timers map[*time.Timer]struct{}
	closed bool
}

func newMemory(env backend.Env) *memory {
	return &memory{pub: env.Memory, logger: env.Logger, timers: map[*time.Timer]struct{}{}}
}

var errMemoryClosed = errors.New("memory delay backend is closed")

func openMemory(_ backend.Spec, env backend.Env, _ names.Names) (backend.Backend, error) {
	return newMemory(env), nil
}

func (m *memory) Name() string { return string(Memory) }

func (m *memory) Caps() backend.Caps {
	return backend.Caps{Keeps: backend.KeepsCopy, Delays: backend.AnyDelay, CarriesEnvelope: true, InProcess: true, Text: "any delay, held in this process"}
}

// Effective is requested: timers have no tiers.
func (m *memory) Effective(requested time.Duration) (time.Duration, error) { return requested, nil }

// Topology is empty: the memory backend declares nothing.
func (m *memory) Topology() topology.Topology { return topology.Topology{} }

// WorkQueue needs nothing: the memory backend publishes straight to the topic.
func (m *memory) WorkQueue(string) topology.Topology { return topology.Topology{} }

func (m *memory) DelayQueues() []backend.DelayQueue { return nil }

// Park publishes a copy of msg to queue on the memory publisher once effective has
// passed.
func (m *memory) Park(_ context.Context, queue string, msg *message.Message, d time.Duration) error {
	if m.pub == nil {
		return errDetached
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return errMemoryClosed
	}
	var t *time.Timer
	t = time.AfterFunc(d, func() {
		m.mu.Lock()
		delete(m.timers, t)
		m.mu.Unlock()
		if err := m.pub.Publish(queue, msg); err != nil {
			m.logger.Error("Memory delay backend could not deliver a message, it is lost", err,
				watermill.LogFields{"message_uuid": msg.UUID, "topic": queue})
		}
	})
	m.timers[t] = struct{}{}
	return nil
}

// Close stops every pending timer: those messages are lost.
func (m *memory) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
	for t := range m.timers {
		t.Stop()
	}
	if len(m.timers) > 0 {
		m.logger.Info("Memory delay backend closed with messages still waiting; they are lost",
			watermill.LogFields{"waiting": len(m.timers)})
	}
	m.timers = nil
	return nil
}
