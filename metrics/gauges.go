package metrics

import (
	"context"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
)

// WatchQueues refreshes the gauges every interval, until ctx is done, from passive
// declarations of queues on a connection of its own to uri (Retry.Queues() names them).
// A queue that cannot be read (deleted, or the broker unreachable) is left out of that
// refresh, and the error returned once ctx is done is the last such error. It refreshes
// once before the first wait.
func (m *Metrics) WatchQueues(ctx context.Context, uri string, queues amqpretry.Queues, interval time.Duration) error {
	var last error
	for {
		if err := m.RefreshQueues(uri, queues); err != nil {
			last = err
		}
		select {
		case <-ctx.Done():
			return last
		case <-time.After(interval):
		}
	}
}

// RefreshQueues sets the gauges once, from passive declarations on a short-lived
// connection to uri.
func (m *Metrics) RefreshQueues(uri string, queues amqpretry.Queues) error {
	conn, err := amqp.Dial(uri)
	if err != nil {
		return fmt.Errorf("metrics: connect to %s: %w", delay.Redact(uri), err)
	}
	defer conn.Close()
	var last error
	depth := func(queue string) (float64, bool) {
		ch, err := conn.Channel()
		if err != nil {
			last = err
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
