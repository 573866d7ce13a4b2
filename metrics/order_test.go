package metrics

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/ops"
)

// TestOrderKeyMetrics: the key events are counted by queue, the longest-blocked gauge
// follows them, and RefreshBlocked reads the blocked keys and what waits behind them
// from the broker.
func TestOrderKeyMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := New(Config{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	m.Observe(amqpretry.Event{Kind: amqpretry.EventKeyBlocked, Queue: "accounts", Key: "a1"})
	m.Observe(amqpretry.Event{Kind: amqpretry.EventKeyBlocked, Queue: "accounts", Key: "a2"})
	m.Observe(amqpretry.Event{Kind: amqpretry.EventKeyReleased, Queue: "accounts", Key: "a1", Duration: time.Second})
	if got := testutil.ToFloat64(m.keysBlocked.WithLabelValues("accounts")); got != 2 {
		t.Errorf("keys_blocked_total = %g, want 2", got)
	}
	if got := testutil.ToFloat64(m.keysReleased.WithLabelValues("accounts")); got != 1 {
		t.Errorf("keys_released_total = %g, want 1", got)
	}
	if n := testutil.CollectAndCount(m.blockedKeys); n != 1 {
		t.Errorf("longest_blocked_seconds has %d series, want 1 (accounts)", n)
	}
	m.Observe(amqpretry.Event{Kind: amqpretry.EventKeyReleased, Queue: "accounts", Key: "a2"})
	if got := testutil.ToFloat64(m.blockedKeys); got != 0 {
		t.Errorf("longest_blocked_seconds = %g once every key is released, want 0", got)
	}

	// From the broker: a blocked key's behind queue with two messages.
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	work := prefix + ".work"
	behind := names.Names{Prefix: prefix}.Behind(work, "acc-7")
	brokertest.Cleanup(t, []string{behind, prefix + ".poison"}, nil)
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	q := declare.BehindQueue(behind, work, "acc-7")
	if _, err := ch.QueueDeclare(behind, true, false, false, false, amqp.Table(q.Args)); err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", behind, false, false, amqp.Publishing{Body: []byte("e")})
		if err != nil || !dc.Wait() {
			t.Fatalf("publish: %v", err)
		}
	}
	o, err := ops.New(ops.Config{URI: brokertest.URI(), Retry: amqpretry.Config{Prefix: prefix}, Rabbitmqctl: brokertest.Ctl})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	if err := m.RefreshBlocked(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(m.blockedGauge.WithLabelValues(work)); got != 1 {
		t.Errorf("blocked_keys = %g, want 1", got)
	}
	if got := testutil.ToFloat64(m.behind.WithLabelValues(work)); got != 2 {
		t.Errorf("behind_messages = %g, want 2", got)
	}
	if _, err := ch.QueueDelete(behind, false, false, false); err != nil {
		t.Fatal(err)
	}
	if err := m.RefreshBlocked(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(m.blockedGauge.WithLabelValues(work)); got != 0 {
		t.Errorf("blocked_keys = %g once released, want 0", got)
	}
}
