package delay

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/topology"
)

// memory keeps each message in a timer of this process and publishes it to its Publisher
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

// Memory ("memory") keeps a retry in a timer of this process and publishes it to pub,
// with the queue as topic, when its delay is over: not durable, for tests and demos
// only. In-process (no broker URI), pub is also where poisoned messages go, and, if it
// is a message.Subscriber (a GoChannel), what AddHandler subscribes to. pub is
// required (Config.Validate refuses nil).
func Memory(pub message.Publisher) Backend { return memoryValue{pub: pub} }

// memoryValue is Memory as configured.
type memoryValue struct {
	lib
	pub message.Publisher
}

// Name is "memory".
func (memoryValue) Name() string { return "memory" }

func (b memoryValue) String() string { return b.Name() }

// Open opens the backend; without a publisher it only plans (Validate refuses it).
func (b memoryValue) Open(s backend.Setup) (backend.Backend, error) {
	return newMemory(b.pub, s.Env.Logger), nil
}

func newMemory(pub message.Publisher, logger watermill.LoggerAdapter) *memory {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &memory{pub: pub, logger: logger, timers: map[*time.Timer]struct{}{}}
}

var errMemoryClosed = errors.New("memory delay backend is closed")

func (m *memory) Name() string { return memoryValue{}.Name() }

func (m *memory) Caps() backend.Caps {
	return backend.Caps{Keeps: backend.KeepsCopy, CarriesEnvelope: true, Text: "any delay, kept in this process"}
}

// Validate refuses a memory backend without a publisher.
func (m *memory) Validate() error {
	if m.pub == nil {
		return errors.New("Backend.Publisher: required for the memory backend: set delay.Memory(pub)")
	}
	return nil
}

// Local is the publisher retries come back through: nothing is on a broker.
func (m *memory) Local() message.Publisher { return m.pub }

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

func (b memoryValue) with(s Settings) Backend {
	if s.Publisher != nil {
		b.pub = s.Publisher
	}
	return b
}
