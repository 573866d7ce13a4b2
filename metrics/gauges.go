package metrics

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/ops"
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
// its poison queue, as its plan names them (cfg.Plan, topology.Queue.Role). It touches
// no broker. The memory backend has nothing on the broker, and an invalid config is
// refused, as New would.
func QueuesOf(cfg amqpretry.Config) (Queues, error) {
	if err := cfg.Validate(); err != nil {
		return Queues{}, fmt.Errorf("metrics: invalid amqpretry config: %w", err)
	}
	plan, err := cfg.Plan() // refuses the memory backend, which has nothing on the broker

	if err != nil {
		return Queues{}, fmt.Errorf("metrics: %w", err)
	}
	var q Queues
	for _, pq := range plan.Queues {
		switch pq.Role {
		case "delay":
			q.Delay = append(q.Delay, pq.Name)
		case "parking":
			q.Parking = pq.Name
		case "poison":
			q.Poison = pq.Name
		}
	}
	return q, nil
}

// WatchQueues refreshes the gauges every interval, until ctx is done, for the queues of
// cfg (QueuesOf), from passive declarations (ops.Status, nothing peeked) on
// connections of its own to uri, the broker's URI (the subscriber config's). A queue that cannot be read (deleted, or the
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
		if err := m.refresh(uri, cfg, queues); err != nil {
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
// declarations (ops.Status) on short-lived connections to uri. Errors never show
// uri's password.
func (m *Metrics) RefreshQueues(uri string, cfg amqpretry.Config) error {
	queues, err := QueuesOf(cfg)
	if err != nil {
		return err
	}
	return m.refresh(uri, cfg, queues)
}

func (m *Metrics) refresh(uri string, cfg amqpretry.Config, queues Queues) error {
	// ops reads the queues (passive declarations, nothing peeked) on connections of
	// its own, its errors redacted.
	o, err := ops.New(ops.Config{URI: uri, AMQP: m.dial, Retry: cfg})
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	defer o.Close()
	s, err := o.Status(context.Background(), ops.StatusOptions{Peek: "never"})
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	var last error
	for _, qs := range s.Queues {
		if !qs.Exists {
			last = fmt.Errorf("metrics: queue %q: %w", qs.Name, topology.ErrMissing)
			continue
		}
		n := float64(qs.Ready)
		switch {
		case qs.Role == "delay" && slices.Contains(queues.Delay, qs.Name):
			m.waiting.WithLabelValues(qs.Name).Set(n)
		case qs.Role == "parking" && qs.Name == queues.Parking:
			m.parked.WithLabelValues(qs.Name).Set(n)
		case qs.Role == "poison" && qs.Name == queues.Poison:
			m.poisonDepth.WithLabelValues(qs.Name).Set(n)
		}
	}
	return last
}
