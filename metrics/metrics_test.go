package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/metrics"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// run is one application on a real broker: a Retry built from cfg with the metrics as
// its Observe, a router with one handler on topic, and a publisher.
type run struct {
	reg   *prometheus.Registry
	mx    *metrics.Metrics
	cfg   amqpretry.Config
	topic string
	pub   message.Publisher
}

// start builds the application on uri and deletes everything it declared when the test
// ends.
func start(t *testing.T, uri string, cfg amqpretry.Config, handler message.NoPublishHandlerFunc) *run {
	t.Helper()
	r := &run{reg: prometheus.NewRegistry(), cfg: cfg, topic: cfg.Prefix + ".work"}
	var err error
	if r.mx, err = metrics.New(metrics.Config{Registerer: r.reg}); err != nil {
		t.Fatal(err)
	}
	r.cfg.Observe = r.mx.Observe
	plan, err := r.cfg.Plan(r.topic)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cleanup(uri, append(names(plan.Queues), r.topic), exchanges(plan)) })
	retry, err := wamqp3.New(amqp3.NewDurableQueueConfig(uri), r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := retry.AddHandler(router, "metered", r.topic, handler); err != nil {
		t.Fatal(err)
	}
	go func() { _ = router.Run(context.Background()) }()
	select {
	case <-router.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router not running after 30 s")
	}
	// The publisher declares the work queue as the subscriber does.
	pub, err := amqp3.NewPublisher(retry.SubscriberConfig(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.pub = pub
	t.Cleanup(func() {
		_ = pub.Close()
		_ = router.Close()
		_ = retry.Close()
	})
	return r
}

func names(qs []topology.Queue) []string {
	var out []string
	for _, q := range qs {
		out = append(out, q.Name)
	}
	return out
}

func exchanges(t topology.Topology) []string {
	var out []string
	for _, e := range t.Exchanges {
		out = append(out, e.Name)
	}
	return out
}

// cleanup deletes queues and exchanges on the broker at uri, each on a channel of its
// own (a failed delete closes it), within 30 s.
func cleanup(uri string, queues, exchanges []string) {
	conn, err := amqp.DialConfig(uri, amqp.Config{Dial: amqp.DefaultDial(10 * time.Second)})
	if err != nil {
		return
	}
	defer conn.Close()
	deadline := time.Now().Add(30 * time.Second)
	del := func(f func(*amqp.Channel) error) {
		if time.Now().After(deadline) {
			return
		}
		if ch, err := conn.Channel(); err == nil {
			_ = f(ch)
			_ = ch.Close()
		}
	}
	for _, q := range queues {
		del(func(ch *amqp.Channel) error { _, err := ch.QueueDelete(q, false, false, false); return err })
	}
	for _, x := range exchanges {
		del(func(ch *amqp.Channel) error { return ch.ExchangeDelete(x, false, false) })
	}
}

// TestMetricsCountWhatHappened drives N messages that fail once and M permanent ones
// through a real broker (ttl-tiers) and checks the metrics exactly: the counters, the
// lateness histogram's count against the retries the handler received, the hand-off
// histogram's count against the hand-offs, the attempts histogram, the gauges, and
// /metrics.
func TestMetricsCountWhatHappened(t *testing.T) {
	const n, m = 12, 3
	brokertest.Dial(t)
	var retriesReceived, done atomic.Int64
	r := start(t, brokertest.URI(), amqpretry.Config{
		Prefix:  brokertest.Prefix(t),
		Backend: delay.TTLTiers(500 * time.Millisecond),
		Policy:  amqpretry.Policy{Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1},
	}, func(msg *message.Message) error {
		if amqpretry.Attempt(msg) > 1 {
			retriesReceived.Add(1)
		}
		switch {
		case strings.HasPrefix(msg.UUID, "bad"):
			return amqpretry.Permanent(errors.New("malformed"))
		case amqpretry.Attempt(msg) == 1:
			return errors.New("flaky")
		}
		done.Add(1)
		return nil
	})
	r.publish(t, n, m)
	poisonedKey := fmt.Sprintf(`amqpretry_poisoned_total{queue=%q,reason="permanent"}`, r.topic)
	r.waitFor(t, 30*time.Second, func(got map[string]float64) bool {
		return done.Load() == n && got[poisonedKey] == m && got[`amqpretry_attempts_count{outcome="succeeded"}`] == n
	})

	if retriesReceived.Load() != n {
		t.Errorf("handler received %d retries, want %d", retriesReceived.Load(), n)
	}
	r.exactly(t, map[string]float64{
		fmt.Sprintf(`amqpretry_retries_scheduled_total{backend="ttl-tiers",queue=%q}`, r.topic): n,
		poisonedKey:                       m,
		`amqpretry_handoff_seconds_count`: n + m,
		`amqpretry_redelivery_lateness_seconds_count{backend="ttl-tiers"}`: float64(retriesReceived.Load()),
		`amqpretry_attempts_count{outcome="succeeded"}`:                    n,
		`amqpretry_attempts_sum{outcome="succeeded"}`:                      2 * n,
		`amqpretry_attempts_count{outcome="poisoned"}`:                     m,
	})
	if c := testutil.CollectAndCount(r.reg, "amqpretry_handoff_failures_total"); c != 0 {
		t.Errorf("%d hand-off failure series, want none", c)
	}

	// The gauges, from the same config the application gave wamqp3.New.
	if err := r.mx.RefreshQueues(brokertest.URI(), r.cfg); err != nil {
		t.Fatal(err)
	}
	q, err := metrics.QueuesOf(r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	got := flatten(mustGather(t, r.reg))
	if v, ok := got[fmt.Sprintf(`amqpretry_poison_queue_messages{queue=%q}`, r.cfg.Prefix+".poison")]; !ok || v != m {
		t.Errorf("poison queue gauge = %v (present %v), want %d", v, ok, m)
	}
	if v, ok := got[fmt.Sprintf(`amqpretry_waiting_retries{queue=%q}`, r.cfg.Prefix+".delay.500ms")]; !ok || v != 0 {
		t.Errorf("waiting retries gauge = %v (present %v), want 0 (queues %+v)", v, ok, q)
	}
	if v, ok := got[fmt.Sprintf(`amqpretry_parked_messages{queue=%q}`, r.cfg.Prefix+".parking")]; !ok || v != 0 {
		t.Errorf("parked gauge = %v (present %v), want 0", v, ok)
	}

	// WatchQueues refreshes before its first wait and returns when ctx is done.
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if err := r.mx.WatchQueues(ctx, brokertest.URI(), r.cfg, time.Hour); err != nil {
		t.Errorf("WatchQueues = %v", err)
	}

	// The endpoint an application serves.
	srv := httptest.NewServer(promhttp.HandlerFor(r.reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		fmt.Sprintf(`amqpretry_retries_scheduled_total{backend="ttl-tiers",queue=%q} %d`, r.topic, n),
		`# TYPE amqpretry_redelivery_lateness_seconds histogram`,
		`amqpretry_redelivery_lateness_seconds_bucket{backend="ttl-tiers",le="-0.1"}`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

// uri43 is a RabbitMQ 4.3 broker for the delayed-retry test: AMQP_URI_43, or none.
func uri43(t *testing.T) string {
	t.Helper()
	uri := os.Getenv("AMQP_URI_43")
	if uri == "" {
		t.Skip("AMQP_URI_43 unset: no RabbitMQ 4.3 to hold retries in the work queue (scripts/rabbitmq4.sh 4.3 start; AMQP_URI_43=$(scripts/rabbitmq4.sh 4.3 uri))")
	}
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatalf("AMQP_URI_43 (%s): %v", brokertest.Redact(uri), err)
	}
	_ = conn.Close()
	return uri
}

// TestDelayedRetryMetrics runs the two-stage retry on RabbitMQ 4.3: N messages that
// fail twice, the first retry held in the work queue (delayed-retry), the second copied
// to ttl-tiers, and M permanent ones. Each backend gets its own retries and lateness
// series; only the copies and the poisonings are hand-offs.
func TestDelayedRetryMetrics(t *testing.T) {
	const n, m = 10, 2
	uri := uri43(t)
	var done atomic.Int64
	r := start(t, uri, amqpretry.Config{
		Prefix:  brokertest.Prefix(t),
		Backend: delay.HeldRetries(1, 200*time.Millisecond, delay.TTLTiers(300*time.Millisecond)),
		Policy:  amqpretry.Policy{Delays: []time.Duration{300 * time.Millisecond}, Jitter: -1},
		// Every message fails its first two attempts, all published together: new
		// messages and retries failing, which is what an outage looks like
		// (docs/outage.md). This test counts the retries' metrics.
		Outage: amqpretry.Outage{Consecutive: -1},
	}, func(msg *message.Message) error {
		switch {
		case strings.HasPrefix(msg.UUID, "bad"):
			return amqpretry.Permanent(errors.New("malformed"))
		case amqpretry.Attempt(msg) <= 2:
			return errors.New("flaky")
		}
		done.Add(1)
		return nil
	})
	r.publish(t, n, m)
	poisonedKey := fmt.Sprintf(`amqpretry_poisoned_total{queue=%q,reason="permanent"}`, r.topic)
	r.waitFor(t, 60*time.Second, func(got map[string]float64) bool {
		return done.Load() == n && got[poisonedKey] == m && got[`amqpretry_attempts_count{outcome="succeeded"}`] == n
	})
	r.exactly(t, map[string]float64{
		fmt.Sprintf(`amqpretry_retries_scheduled_total{backend="delayed-retry",queue=%q}`, r.topic): n,
		fmt.Sprintf(`amqpretry_retries_scheduled_total{backend="ttl-tiers",queue=%q}`, r.topic):     n,
		poisonedKey:                       m,
		`amqpretry_handoff_seconds_count`: n + m, // the copies and the poisonings, not the held retries
		`amqpretry_redelivery_lateness_seconds_count{backend="delayed-retry"}`: n,
		`amqpretry_redelivery_lateness_seconds_count{backend="ttl-tiers"}`:     n,
		`amqpretry_attempts_sum{outcome="succeeded"}`:                          3 * n,
	})
	got := flatten(mustGather(t, r.reg))
	if mean := got[`amqpretry_redelivery_lateness_seconds_sum{backend="delayed-retry"}`] / n; mean < -0.1 || mean > 1 {
		t.Errorf("mean lateness of the held retries %.3f s: the work queue does not hold them for their delay", mean)
	}
	if err := r.mx.RefreshQueues(uri, r.cfg); err != nil {
		t.Fatal(err)
	}
	got = flatten(mustGather(t, r.reg))
	if v := got[fmt.Sprintf(`amqpretry_poison_queue_messages{queue=%q}`, r.cfg.Prefix+".poison")]; v != m {
		t.Errorf("poison queue gauge = %v, want %d", v, m)
	}
}

// TestObserveLabelsAHeldRetryWithoutItsBackend: a delivered retry whose event does not
// name its backend is labelled with the backend that took the retry from that queue and
// attempt, here delayed-retry for attempt 2 and ttl-tiers for attempt 3.
func TestObserveLabelsAHeldRetryWithoutItsBackend(t *testing.T) {
	reg := prometheus.NewRegistry()
	mx, err := metrics.New(metrics.Config{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventRetryScheduled, Queue: "q", Backend: delay.DelayedRetry(0).Name(), Attempt: 1, Effective: time.Second})
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventDelivered, Queue: "q", Attempt: 2, Late: true, Lateness: 3 * time.Millisecond})
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventRetryScheduled, Queue: "q", Backend: delay.TTLTiers().Name(), Attempt: 2, Handoff: time.Millisecond})
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventDelivered, Queue: "q", Attempt: 3, Late: true, Lateness: 5 * time.Millisecond})
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventDelivered, Queue: "q", Attempt: 3, Backend: delay.BinaryLevels(0).Name(), Late: true})
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventDelivered, Queue: "other", Attempt: 2, Late: true})
	got := flatten(mustGather(t, reg))
	for k, want := range map[string]float64{
		`amqpretry_redelivery_lateness_seconds_count{backend="delayed-retry"}`: 1,
		`amqpretry_redelivery_lateness_seconds_count{backend="ttl-tiers"}`:     1,
		`amqpretry_redelivery_lateness_seconds_count{backend="binary-levels"}`: 1,
		`amqpretry_redelivery_lateness_seconds_count{backend="unknown"}`:       1,
		`amqpretry_retries_scheduled_total{backend="delayed-retry",queue="q"}`: 1,
		`amqpretry_handoff_seconds_count`:                                      1,
	} {
		if got[k] != want {
			t.Errorf("%s = %v, want %v", k, got[k], want)
		}
	}
}

func TestHandoffFailuresAreCountedByCause(t *testing.T) {
	reg := prometheus.NewRegistry()
	mx, err := metrics.New(metrics.Config{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	causes := []string{"returned", "nacked", "timeout", "connection", "too-large", "not-wired", "other"}
	for _, cause := range causes {
		mx.Observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: "q", Err: errors.New(cause), Cause: cause})
	}
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: "q", Err: errors.New("no cause")})
	got := flatten(mustGather(t, reg))
	for _, cause := range causes {
		want := 1.0
		if cause == "other" {
			want = 2 // an event without a cause counts as other
		}
		if k := fmt.Sprintf(`amqpretry_handoff_failures_total{cause=%q,queue="q"}`, cause); got[k] != want {
			t.Errorf("%s = %v, want %v", k, got[k], want)
		}
	}
}

func TestInvalidConfigNamesTheField(t *testing.T) {
	_, err := metrics.New(metrics.Config{})
	if err == nil || !strings.Contains(err.Error(), "Registerer") {
		t.Fatalf("New = %v, want an invalid config error naming Registerer", err)
	}
}

// TestQueuesOf: the gauges' queues come from the application's config as the library
// names them.
func TestQueuesOf(t *testing.T) {
	for _, c := range []struct {
		name    string
		cfg     amqpretry.Config
		want    metrics.Queues
		wantErr string
	}{
		{"ttl-tiers", amqpretry.Config{Prefix: "p", Backend: delay.TTLTiers(time.Second, time.Minute)},
			metrics.Queues{Delay: []string{"p.delay.1s", "p.delay.1m"}, Parking: "p.parking", Poison: "p.poison"}, ""},
		{"binary-levels", amqpretry.Config{Backend: delay.BinaryLevels(2), Prefix: "p", PoisonQueue: "dead", Policy: amqpretry.Policy{Delays: amqpretry.Exponential(time.Second, 2, 2*time.Second), Jitter: -1}},
			metrics.Queues{Delay: []string{"p.level.0", "p.level.1"}, Parking: "p.parking", Poison: "dead"}, ""},
		{"delayed-retry", amqpretry.Config{Backend: delay.DelayedRetry(0)},
			metrics.Queues{Poison: "amqpretry.poison"}, ""},
		{"two-stage", amqpretry.Config{Prefix: "p", Backend: delay.HeldRetries(2, 0, delay.TTLTiers(time.Second))},
			metrics.Queues{Delay: []string{"p.delay.1s"}, Parking: "p.parking", Poison: "p.poison"}, ""},
		{"memory", amqpretry.Config{Backend: delay.Memory(nopPublisher{})}, metrics.Queues{}, "memory backend"},
		{"invalid", amqpretry.Config{Backend: delay.BinaryLevels(40)}, metrics.Queues{}, "Levels: 40"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := metrics.QueuesOf(c.cfg)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("QueuesOf = %+v, %v; want an error with %q", got, err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(got) != fmt.Sprint(c.want) {
				t.Errorf("QueuesOf = %+v, want %+v", got, c.want)
			}
		})
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// TestDialErrorsNeverShowThePassword passes URIs whose password must not come out
// through every entry point that dials: malformed ones, which amqp091-go's parser
// quotes, ones that reach no broker, and a wrong password that reaches the broker.
func TestDialErrorsNeverShowThePassword(t *testing.T) {
	const secret = "s3cret"
	uris := []string{
		"amqp://user:" + secret + "@host:badport/",
		"amqp://user:" + secret + "@127.0.0.1:badport/vhost",
		"amqp//user:" + secret + "@127.0.0.1:5672/",
		"amqp://user:" + secret + "@[::1/",
		"amqp://user:" + secret + "@127.0.0.1:5672/%zz",
		"amqp://user:" + secret + "@127.0.0.1:1/",
		"http://user:" + secret + "@127.0.0.1:5672/",
		"amqp://user:" + secret + "@127.0.0.1:5672/\x7f",
	}
	if brokertest.Dial(t) != nil {
		// A wrong password that reaches the broker at AMQP_URI.
		u := brokertest.URI()
		if i, j := strings.Index(u, "://"), strings.Index(u, "@"); i >= 0 && j > i {
			uris = append(uris, u[:i+3]+"guest:"+secret+u[j:])
		}
	}
	// The test means something only while amqp091-go quotes such a URI, password and
	// all, in its own error (issue 18).
	if _, err := amqp.Dial(uris[0]); err == nil || !strings.Contains(err.Error(), secret) {
		t.Logf("amqp091-go no longer quotes the password of %q: %v", strings.ReplaceAll(uris[0], secret, "xxxxx"), err)
	}
	mx, err := metrics.New(metrics.Config{Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	cfg := amqpretry.Config{Prefix: brokertest.Prefix(t)}
	entry := map[string]func(uri string) error{
		"RefreshQueues": func(uri string) error { return mx.RefreshQueues(uri, cfg) },
		"WatchQueues": func(uri string) error {
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			defer cancel()
			return mx.WatchQueues(ctx, uri, cfg, 50*time.Millisecond)
		},
	}
	for name, call := range entry {
		for _, uri := range uris {
			err := call(uri)
			if err == nil {
				t.Errorf("%s(%q): no error", name, strings.ReplaceAll(uri, secret, "xxxxx"))
				continue
			}
			if strings.Contains(err.Error(), secret) || strings.Contains(fmt.Sprintf("%+v", err), secret) {
				t.Errorf("%s: error shows the password: %v", name, err)
			}
		}
	}
}

// publish publishes n messages ok-i and m messages bad-i to the run's topic.
func (r *run) publish(t *testing.T, n, m int) {
	t.Helper()
	for i := range n {
		if err := r.pub.Publish(r.topic, message.NewMessage(fmt.Sprintf("ok-%d", i), nil)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range m {
		if err := r.pub.Publish(r.topic, message.NewMessage(fmt.Sprintf("bad-%d", i), nil)); err != nil {
			t.Fatal(err)
		}
	}
}

// waitFor polls the metrics until done is true, or fails the test at the deadline.
func (r *run) waitFor(t *testing.T, limit time.Duration, done func(map[string]float64) bool) {
	t.Helper()
	for deadline := time.Now().Add(limit); !done(flatten(mustGather(t, r.reg))); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not done within %s: %v", limit, flatten(mustGather(t, r.reg)))
		}
	}
}

// exactly checks each series against its value.
func (r *run) exactly(t *testing.T, want map[string]float64) {
	t.Helper()
	got := flatten(mustGather(t, r.reg))
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%s = %v, want %v", k, got[k], w)
		}
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
