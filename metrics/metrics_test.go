package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
	"github.com/amqpretry/amqpretry/metrics"
	"github.com/amqpretry/amqpretry/middleware"
)

// TestMetricsCountWhatHappened drives N messages that fail once and M permanent ones
// through a real broker and checks the metrics exactly: the counters, the lateness
// histogram's count against the retries the handler received, the hand-off histogram's
// count against the hand-offs, the attempts histogram, the gauges, and /metrics.
func TestMetricsCountWhatHappened(t *testing.T) {
	const n, m = 12, 3
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	topic := prefix + ".work"
	reg := prometheus.NewRegistry()
	mx, err := metrics.New(metrics.Config{Registerer: reg, Backend: delay.BackendTTLTiers})
	if err != nil {
		t.Fatal(err)
	}
	retry, err := amqpretry.New(amqpretry.Config{
		Subscriber: wamqp.NewDurableQueueConfig(brokertest.URI()),
		Delay:      delay.Config{Prefix: prefix, Tiers: []time.Duration{500 * time.Millisecond}},
		Policy:     middleware.Policy{Delays: []time.Duration{500 * time.Millisecond}},
		Observe:    mx.Observe,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer retry.Close()
	q := retry.Queues()
	brokertest.Cleanup(t, append([]string{topic, q.Parking, q.Poison}, q.Delay...), []string{prefix + ".delay", prefix + ".deliver", prefix + ".parking"})

	var retriesReceived, done atomic.Int64
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = retry.AddHandler(router, "metered", topic, func(msg *message.Message) error {
		if middleware.Attempt(msg) > 1 {
			retriesReceived.Add(1)
		}
		switch {
		case strings.HasPrefix(msg.UUID, "bad"):
			return middleware.Permanent(errors.New("malformed"))
		case middleware.Attempt(msg) == 1:
			return errors.New("flaky")
		}
		done.Add(1)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	defer router.Close()

	pub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(brokertest.URI()), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	for i := range n {
		if err := pub.Publish(topic, message.NewMessage(fmt.Sprintf("ok-%d", i), nil)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range m {
		if err := pub.Publish(topic, message.NewMessage(fmt.Sprintf("bad-%d", i), nil)); err != nil {
			t.Fatal(err)
		}
	}
	poisonedKey := fmt.Sprintf(`amqpretry_poisoned_total{queue=%q,reason="permanent"}`, topic)
	finished := func() bool {
		got := flatten(mustGather(t, reg))
		return done.Load() == n && got[poisonedKey] == m && got[`amqpretry_attempts_count{outcome="succeeded"}`] == n
	}
	for deadline := time.Now().Add(30 * time.Second); !finished(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d messages handled, %v of %d poisoned", done.Load(), n, flatten(mustGather(t, reg))[poisonedKey], m)
		}
	}

	exact := map[string]float64{
		fmt.Sprintf(`amqpretry_retries_scheduled_total{backend="ttl-tiers",queue=%q}`, topic): n,
		poisonedKey:                       m,
		`amqpretry_handoff_seconds_count`: n + m,
		`amqpretry_redelivery_lateness_seconds_count{backend="ttl-tiers"}`: float64(retriesReceived.Load()),
		`amqpretry_attempts_count{outcome="succeeded"}`:                    n,
		`amqpretry_attempts_sum{outcome="succeeded"}`:                      2 * n,
		`amqpretry_attempts_count{outcome="poisoned"}`:                     m,
	}
	if retriesReceived.Load() != n {
		t.Errorf("handler received %d retries, want %d", retriesReceived.Load(), n)
	}
	got := flatten(mustGather(t, reg))
	for k, want := range exact {
		if got[k] != want {
			t.Errorf("%s = %v, want %v", k, got[k], want)
		}
	}
	if c := testutil.CollectAndCount(reg, "amqpretry_handoff_failures_total"); c != 0 {
		t.Errorf("%d hand-off failure series, want none", c)
	}

	if err := mx.RefreshQueues(brokertest.URI(), q); err != nil {
		t.Fatal(err)
	}
	got = flatten(mustGather(t, reg))
	if v, ok := got[fmt.Sprintf(`amqpretry_poison_queue_messages{queue=%q}`, q.Poison)]; !ok || v != m {
		t.Errorf("poison queue gauge = %v (present %v), want %d", v, ok, m)
	}
	if v, ok := got[fmt.Sprintf(`amqpretry_waiting_retries{queue=%q}`, q.Delay[0])]; !ok || v != 0 {
		t.Errorf("waiting retries gauge = %v (present %v), want 0", v, ok)
	}

	// The endpoint an application serves.
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		fmt.Sprintf(`amqpretry_retries_scheduled_total{backend="ttl-tiers",queue=%q} %d`, topic, n),
		`# TYPE amqpretry_redelivery_lateness_seconds histogram`,
		`amqpretry_redelivery_lateness_seconds_bucket{backend="ttl-tiers",le="-0.1"}`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

func TestHandoffFailuresAreCountedByCause(t *testing.T) {
	reg := prometheus.NewRegistry()
	mx, err := metrics.New(metrics.Config{Registerer: reg, Backend: delay.BackendBinaryLevels})
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{
		fmt.Errorf("x: %w", delay.ErrReturned),
		fmt.Errorf("x: %w", delay.ErrNotConfirmed),
		fmt.Errorf("x: %w: %w", delay.ErrNotConfirmed, context.DeadlineExceeded),
		fmt.Errorf("x: %w", delay.ErrTooLarge),
		fmt.Errorf("x: %w", middleware.ErrNotWired),
		errors.New("something else"),
	} {
		mx.Observe(middleware.Event{Kind: middleware.EventHandoffFailed, Queue: "q", Err: err})
	}
	got := flatten(mustGather(t, reg))
	for _, cause := range []string{"returned", "nacked", "timeout", "too-large", "not-wired", "other"} {
		if k := fmt.Sprintf(`amqpretry_handoff_failures_total{cause=%q,queue="q"}`, cause); got[k] != 1 {
			t.Errorf("%s = %v, want 1", k, got[k])
		}
	}
}

func TestInvalidConfigNamesTheField(t *testing.T) {
	_, err := metrics.New(metrics.Config{})
	if err == nil || !strings.Contains(err.Error(), "Registerer") || !strings.Contains(err.Error(), "Backend") {
		t.Fatalf("New = %v, want an invalid config error naming Registerer and Backend", err)
	}
}

func mustGather(t *testing.T, g prometheus.Gatherer) []*dto.MetricFamily {
	t.Helper()
	f, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// flatten maps each series to its value: counters and gauges by name{labels}, and
// histograms as name_count{labels} and name_sum{labels}, labels sorted by name.
func flatten(families []*dto.MetricFamily) map[string]float64 {
	out := map[string]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			sort.Strings(labels)
			ls := ""
			if len(labels) > 0 {
				ls = "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.Counter != nil:
				out[f.GetName()+ls] = m.Counter.GetValue()
			case m.Gauge != nil:
				out[f.GetName()+ls] = m.Gauge.GetValue()
			case m.Histogram != nil:
				out[f.GetName()+"_count"+ls] = float64(m.Histogram.GetSampleCount())
				out[f.GetName()+"_sum"+ls] = m.Histogram.GetSampleSum()
			}
		}
	}
	return out
}
