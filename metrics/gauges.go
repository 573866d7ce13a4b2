package metrics

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// Queues are the library's queues the gauges watch for one amqpretry.Config.
type Queues struct {
	// Delay are the backend's delay queues (ttl-tiers' tiers, binary-levels' levels):
	// amqpretry_waiting_retries. None for delayed-retry, whose retries wait in the
	// work queue, nor for delayed-exchange, whose retries wait in the plugin's store.
	Delay []string
	// Parking is the parking queue of the backends that have one, else "".
	Parking string
	// Poison is the poison queue.
	Poison string
}

// QueuesOf returns the queues the gauges watch for cfg, the config given to wamqp3.New
// (or wamqp2.New): the delay queues and the parking queue of its copying backend, and
// its poison queue, as the library names them. It touches no broker. The memory
// backend has nothing on the broker, and an invalid config is refused, as New would.
func QueuesOf(cfg amqpretry.Config) (Queues, error) {
	if err := cfg.Validate(); err != nil {
		return Queues{}, fmt.Errorf("metrics: invalid amqpretry config: %w", err)
	}
	cfg = cfg.WithDefaults()
	if cfg.Backend == delay.Memory {
		return Queues{}, errors.New("metrics: the memory backend has no queues on the broker")
	}
	b, err := backend.Lookup(backend.Spec{Name: cfg.Backend, Prefix: cfg.Prefix, Tiers: cfg.Tiers, Levels: cfg.Levels, RetryDelay: cfg.DelayedRetryDelay})
	if err != nil {
		return Queues{}, fmt.Errorf("metrics: %w", err)
	}
	q := Queues{Poison: cfg.PoisonQueue}
	for _, d := range b.DelayQueues() {
		q.Delay = append(q.Delay, d.Name)
	}
	parking := names.Names{Prefix: cfg.Prefix}.Parking()
	if slices.ContainsFunc(b.Topology().Queues, func(tq topology.Queue) bool { return tq.Name == parking }) {
		q.Parking = parking
	}
	return q, nil
}

// WatchQueues refreshes the gauges every interval, until ctx is done, for the queues of
// cfg (QueuesOf), from passive declarations on a connection of its own to uri, the
// broker's URI (the subscriber config's). A queue that cannot be read (deleted, or the
// broker unreachable) is left out of that refresh, and the error returned once ctx is
// done is the last such error; errors never show the URI's password. An invalid
// config is returned at once. It refreshes once before the first wait.
func (m *Metrics) WatchQueues(ctx context.Context, uri string, cfg amqpretry.Config, interval time.Duration) error {
	queues, err := QueuesOf(cfg)
	if err != nil {
		return err
	}
	var last error
	for {
		if err := m.refresh(uri, queues); err != nil {
			last = err
		}
		select {
		case <-ctx.Done():
			return last
		case <-time.After(interval):
		}
	}
}

// RefreshQueues sets the gauges once for the queues of cfg (QueuesOf), from passive
// declarations on a short-lived connection to uri. Errors never show uri's password.
func (m *Metrics) RefreshQueues(uri string, cfg amqpretry.Config) error {
	queues, err := QueuesOf(cfg)
	if err != nil {
		return err
	}
	return m.refresh(uri, queues)
}

func (m *Metrics) refresh(uri string, queues Queues) error {
	conn, err := handoff.DialConn(uri, m.dial)
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	defer conn.Close()
	var last error
	depth := func(queue string) (float64, bool) {
		ch, err := conn.Channel()
		if err != nil {
			last = fmt.Errorf("metrics: channel: %w", err)
			return 0, false
		}
		defer ch.Close()
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			last = fmt.Errorf("metrics: queue %q: %w", queue, err)
			return 0, false
		}
		return float64(q.Messages), true
	}
	for _, q := range queues.Delay {
		if n, ok := depth(q); ok {
			m.waiting.WithLabelValues(q).Set(n)
		}
	}
	if queues.Parking != "" {
		if n, ok := depth(queues.Parking); ok {
			m.parked.WithLabelValues(queues.Parking).Set(n)
		}
	}
	if n, ok := depth(queues.Poison); ok {
		m.poisonDepth.WithLabelValues(queues.Poison).Set(n)
	}
	return last
}
