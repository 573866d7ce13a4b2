package metrics

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/amqpretry/amqpretry/ops"
	"github.com/prometheus/client_golang/prometheus"
)

// blockedKeys collects, per work queue, how long the key blocked longest has been
// (amqpretry_longest_blocked_seconds), from the EventKeyBlocked and EventKeyReleased
// this process saw: a key another process blocked is not in it. A queue has no series
// until a key of it is blocked, and 0 once none is.
type blockedKeys struct {
	longest *prometheus.Desc

	mu sync.Mutex
	q  map[string]map[string]time.Time // queue, key: blocked since
}

func newBlockedKeys(ns string) *blockedKeys {
	return &blockedKeys{
		longest: prometheus.NewDesc(ns+"_longest_blocked_seconds",
			"How long the order key blocked longest in the work queue has been, as this process saw it block; 0 when none is.", []string{"queue"}, nil),
		q: map[string]map[string]time.Time{},
	}
}

func (b *blockedKeys) blocked(queue, key string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	keys := b.q[queue]
	if keys == nil {
		keys = map[string]time.Time{}
		b.q[queue] = keys
	}
	if _, ok := keys[key]; !ok {
		keys[key] = time.Now()
	}
}

func (b *blockedKeys) released(queue, key string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.q[queue], key)
}

func (b *blockedKeys) Describe(ch chan<- *prometheus.Desc) { ch <- b.longest }

func (b *blockedKeys) Collect(ch chan<- prometheus.Metric) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	for queue, keys := range b.q {
		var longest time.Duration
		for _, since := range keys {
			longest = max(longest, now.Sub(since))
		}
		ch <- prometheus.MustNewConstMetric(b.longest, prometheus.GaugeValue, longest.Seconds(), queue)
	}
}

// RefreshBlocked sets, for each work queue with blocked order keys
// (amqpretry.Config.OrderKey), the keys blocked (amqpretry_blocked_keys) and the
// messages waiting behind them (amqpretry_behind_messages), as the broker has them
// (ops.Blocked): what every process sees. A queue with none is set to 0 once it had
// some. o needs ops.Config.Rabbitmqctl (listing queues takes a second or two: refresh
// every minute or so).
func (m *Metrics) RefreshBlocked(ctx context.Context, o *ops.Ops) error {
	keys, err := o.Blocked(ctx)
	if err != nil {
		return fmt.Errorf("metrics: blocked keys: %w", err)
	}
	count, behind := map[string]int{}, map[string]int{}
	for _, k := range keys {
		count[k.Queue]++
		behind[k.Queue] += k.Behind
	}
	m.blockedMu.Lock()
	defer m.blockedMu.Unlock()
	for q := range m.blockedSeen {
		if _, ok := count[q]; !ok {
			m.blockedGauge.WithLabelValues(q).Set(0)
			m.behind.WithLabelValues(q).Set(0)
		}
	}
	for q, n := range count {
		m.blockedSeen[q] = true
		m.blockedGauge.WithLabelValues(q).Set(float64(n))
		m.behind.WithLabelValues(q).Set(float64(behind[q]))
	}
	return nil
}
