// Package metrics exposes what amqpretry does as Prometheus metrics, registered on a
// registerer you pass in (nothing is global).
//
// It is a module of its own, so that an application that does not want Prometheus does
// not get github.com/prometheus/client_golang in its module graph through amqpretry.
//
//	m, err := metrics.New(metrics.Config{Registerer: prometheus.DefaultRegisterer})
//	cfg := amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 5}, Observe: m.Observe}
//	retry, err := wamqp3.New(amqp.NewDurableQueueConfig(uri), cfg)
//	go m.WatchQueues(ctx, uri, cfg, 15*time.Second) // optional: queue-depth gauges
//
// Observe takes every label from the event: the backend from Event.Backend (the one
// that took the retry: "delayed-retry" for a retry RabbitMQ 4.3 holds in the work
// queue, the copying backend's name otherwise), the cause of a failed hand-off from
// Event.Cause. A delivered retry whose event names no backend gets the backend that
// took the last retry this process scheduled from the same queue after the same
// attempt ("unknown" if none). WatchQueues takes the same amqpretry.Config the
// application gives wamqp3.New (or wamqp2.New) and derives from it the queues to
// watch (QueuesOf).
//
// # Metrics
//
// Counters:
//   - amqpretry_retries_scheduled_total{queue,backend}: retries parked (handed off and
//     confirmed), or, backend="delayed-retry" or "delivery-time", held by the broker in
//     the work queue.
//   - amqpretry_poisoned_total{queue,reason}: messages poisoned, by reason (permanent,
//     max-attempts, delay-too-long, handoff-failed, too-large).
//   - amqpretry_handoff_failures_total{queue,cause}: failed hand-offs, by cause
//     (returned, nacked, timeout, connection, too-large, not-wired, other;
//     poison-queue-missing: a poisoning returned unroutable, the poison queue is gone
//     and the message waits in its work queue until it is created again).
//   - amqpretry_outages_total{queue}: outages that started (amqpretry.Config.Outage:
//     the queue's handlers fail as if something they depend on is down).
//   - amqpretry_outage_probes_total{queue,result}: messages run as an outage's probe,
//     by result: ok (the outage ends) or failed.
//   - amqpretry_outage_seconds_total{queue}: time spent in outages: each ended
//     outage's Event.Duration, plus the ongoing outage's time up to the scrape.
//
// Histograms:
//
//   - amqpretry_handoff_seconds: publish to confirm of each confirmed hand-off (parked
//     retries, and poisonings). A held retry (delayed-retry, delivery-time: the broker
//     holds the failed delivery) is not published and is not observed here.
//
//   - amqpretry_redelivery_lateness_seconds{backend}: arrival of a retry minus its due
//     time (recorded on a copy; for a retry held in the work queue, kept by the
//     middleware that settled it). An early arrival (clock skew between processes, or
//     a delay shortened to the longest tier, which the due time already accounts for)
//     is observed as a negative value: the lowest buckets are -0.1, -0.01 and 0.
//
//   - amqpretry_attempts{outcome}: the attempt on which a message finally succeeded
//     (outcome="succeeded") or was poisoned (outcome="poisoned").
//
//   - amqpretry_keys_blocked_total{queue}, amqpretry_keys_released_total{queue}: order
//     keys (amqpretry.Config.OrderKey) blocked, and released (EventKeyBlocked,
//     EventKeyReleased).
//
// Gauges set by Observe:
//   - amqpretry_in_outage{queue}: 1 while the work queue is in an outage (its messages
//     wait in the process, spending no attempt, until a probe succeeds), 0 after; no
//     series until the queue's first outage.
//
// Gauges, refreshed by WatchQueues on an interval (passive declarations on a connection
// of their own):
//   - amqpretry_waiting_retries{queue}: messages in each delay queue (tiers or levels).
//     Retries held in a work queue by RabbitMQ 4.3 are counted in that queue, not here.
//   - amqpretry_parked_messages{queue}: messages in the parking queue (the name is kept
//     for compatibility: "park" is to copy a retry into delay storage). There is no
//     counter of them: the broker routes a retry to the parking queue when it comes
//     due, out of the library's sight.
//   - amqpretry_poison_queue_messages{queue}: messages in the poison queue.
//
// Gauges refreshed by RefreshWaiting (through ops, with rabbitmqctl eval):
//   - amqpretry_work_queue_waiting_retries{queue}: retries waiting to come back to each
//     work queue, wherever they wait (any backend's delay queues under the prefix,
//     RabbitMQ 4.3's delayed retry).
//   - amqpretry_next_retry_due_timestamp_seconds{queue}: due time of the first of them;
//     a value in the past is an overdue retry (alert rule: example/alerts.yml).
//
// Gauges of order keys:
//   - amqpretry_longest_blocked_seconds{queue}: how long the key blocked longest has
//     been, as this process saw it block (Observe); 0 when none is.
//   - amqpretry_blocked_keys{queue}, amqpretry_behind_messages{queue}: the keys blocked
//     and the messages waiting behind them, as the broker has them (RefreshBlocked,
//     through ops with rabbitmqctl).
//
// Labels are bounded: queue is a queue the application subscribes to (or, for the gauges,
// one of the library's own), backend a backend name (package delay), reason, cause and
// result (ok, failed) the sets above.
package metrics

import (
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/amqpretry/amqpretry"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"
)

// DefaultLatenessBuckets are the buckets of amqpretry_redelivery_lateness_seconds, in
// seconds: early arrivals below 0, then from 5 ms (ttl-tiers and delayed-retry are a
// few ms late) to 30 s.
var DefaultLatenessBuckets = []float64{-0.1, -0.01, 0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}

// DefaultHandoffBuckets are the buckets of amqpretry_handoff_seconds: from 250 µs (a
// confirmed persistent publish on an idle local broker) to 10 s (the confirm timeout).
var DefaultHandoffBuckets = []float64{0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 10}

// DefaultAttemptBuckets are the buckets of amqpretry_attempts.
var DefaultAttemptBuckets = []float64{1, 2, 3, 4, 5, 7, 10, 15, 20}

// Config configures New.
type Config struct {
	// Registerer receives every metric. Required.
	Registerer prometheus.Registerer
	// LatenessBuckets. Default: DefaultLatenessBuckets.
	LatenessBuckets []float64
	// HandoffBuckets. Default: DefaultHandoffBuckets.
	HandoffBuckets []float64
	// AMQP is given to amqp091-go's DialConfig for the connections of WatchQueues and
	// RefreshQueues (TLS, heartbeat, properties). Default: its zero value.
	AMQP amqp.Config
}

func (c *Config) setDefaults() {
	if c.LatenessBuckets == nil {
		c.LatenessBuckets = DefaultLatenessBuckets
	}
	if c.HandoffBuckets == nil {
		c.HandoffBuckets = DefaultHandoffBuckets
	}
}

// Validate reports every invalid field, each named.
func (c Config) Validate() error {
	var errs []error
	if c.Registerer == nil {
		errs = append(errs, errors.New("Registerer: required"))
	}
	return errors.Join(errs...)
}

// Metrics records middleware events. Give its Observe method to amqpretry.Config.Observe.
type Metrics struct {
	dial            amqp.Config
	retries         *prometheus.CounterVec
	poisoned        *prometheus.CounterVec
	handoffFailures *prometheus.CounterVec
	handoff         prometheus.Histogram
	lateness        *prometheus.HistogramVec
	attempts        *prometheus.HistogramVec
	waiting         *prometheus.GaugeVec
	parked          *prometheus.GaugeVec
	poisonDepth     *prometheus.GaugeVec
	workWaiting     *prometheus.GaugeVec
	nextDue         *prometheus.GaugeVec
	outages         *outages
	outageCount     *prometheus.CounterVec
	probes          *prometheus.CounterVec
	took            tookBy
	keysBlocked     *prometheus.CounterVec
	keysReleased    *prometheus.CounterVec
	blockedKeys     *blockedKeys
	blockedGauge    *prometheus.GaugeVec
	behind          *prometheus.GaugeVec
	blockedMu       sync.Mutex
	blockedSeen     map[string]bool // queues RefreshBlocked set
}

// New registers the metrics on cfg.Registerer.
func New(cfg Config) (*Metrics, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	const ns = "amqpretry"
	m := &Metrics{
		dial: cfg.AMQP,
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "retries_scheduled_total",
			Help: "Retries parked in delay storage and confirmed by the broker, or held by the broker in the work queue (backend delayed-retry or delivery-time)."}, []string{"queue", "backend"}),
		poisoned: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "poisoned_total",
			Help: "Messages sent to the poison queue, by reason."}, []string{"queue", "reason"}),
		handoffFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "handoff_failures_total",
			Help: "Hand-offs that failed (the message was nacked for redelivery, or poisoned), by cause."}, []string{"queue", "cause"}),
		handoff: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "handoff_seconds",
			Help: "Time from publish to broker confirm of each confirmed hand-off.", Buckets: cfg.HandoffBuckets}),
		lateness: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "redelivery_lateness_seconds",
			Help:    "Arrival of a retry minus its due time; negative when early.",
			Buckets: cfg.LatenessBuckets}, []string{"backend"}),
		attempts: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "attempts",
			Help: "The attempt on which a message finally succeeded or was poisoned.", Buckets: DefaultAttemptBuckets}, []string{"outcome"}),
		waiting: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "waiting_retries",
			Help: "Messages waiting in each delay queue (refreshed by WatchQueues)."}, []string{"queue"}),
		parked: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "parked_messages",
			Help: "Messages in the parking queue: retries whose work queue was gone (refreshed by WatchQueues)."}, []string{"queue"}),
		poisonDepth: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "poison_queue_messages",
			Help: "Messages in the poison queue (refreshed by WatchQueues)."}, []string{"queue"}),
		workWaiting: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "work_queue_waiting_retries",
			Help: "Retries waiting to come back to each work queue, in any delay storage (refreshed by RefreshWaiting)."}, []string{"queue"}),
		nextDue: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "next_retry_due_timestamp_seconds",
			Help: "Due time (Unix seconds) of the first retry waiting to come back to each work queue; absent when none waits (refreshed by RefreshWaiting)."}, []string{"queue"}),
		outages: newOutages(ns),
		outageCount: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "outages_total",
			Help: "Outages of the work queue that started (its handlers failed as if something they depend on is down)."}, []string{"queue"}),
		probes: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "outage_probes_total",
			Help: "Messages run as an outage's probe, by result (ok ends the outage, failed keeps it)."}, []string{"queue", "result"}),
		keysBlocked: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "keys_blocked_total",
			Help: "Order keys blocked: a message of the key waits for its retry, and its later messages wait behind it."}, []string{"queue"}),
		keysReleased: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "keys_released_total",
			Help: "Order keys released: the messages behind the key ran, in order."}, []string{"queue"}),
		blockedKeys: newBlockedKeys(ns),
		blockedGauge: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "blocked_keys",
			Help: "Order keys blocked in the work queue, as the broker has them (refreshed by RefreshBlocked)."}, []string{"queue"}),
		behind: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "behind_messages",
			Help: "Messages waiting behind the work queue's blocked order keys (refreshed by RefreshBlocked)."}, []string{"queue"}),
		blockedSeen: map[string]bool{},
	}
	for _, c := range []prometheus.Collector{m.retries, m.poisoned, m.handoffFailures, m.handoff, m.lateness, m.attempts, m.waiting, m.parked, m.poisonDepth, m.workWaiting, m.nextDue, m.outages, m.outageCount, m.probes, m.keysBlocked, m.keysReleased, m.blockedKeys, m.blockedGauge, m.behind} {
		if err := cfg.Registerer.Register(c); err != nil {
			return nil, fmt.Errorf("register amqpretry metrics: %w", err)
		}
	}
	return m, nil
}

// Observe records one middleware event. It is safe for concurrent use.
func (m *Metrics) Observe(e amqpretry.Event) {
	switch e.Kind {
	case amqpretry.EventDelivered:
		if e.Late {
			backend := string(e.Backend)
			if backend == "" {
				backend = m.took.get(e.Queue, e.Attempt-1)
			}
			m.lateness.WithLabelValues(backend).Observe(e.Lateness.Seconds())
		}
	case amqpretry.EventSucceeded:
		m.attempts.WithLabelValues("succeeded").Observe(float64(e.Attempt))
	case amqpretry.EventRetryScheduled:
		backend := orUnknown(string(e.Backend))
		m.took.set(e.Queue, e.Attempt, backend)
		m.retries.WithLabelValues(e.Queue, backend).Inc()
		if e.Handoff > 0 { // a held retry (delayed-retry, delivery-time) is not published
			m.handoff.Observe(e.Handoff.Seconds())
		}
	case amqpretry.EventPoisoned:
		m.poisoned.WithLabelValues(e.Queue, string(e.Reason)).Inc()
		m.handoff.Observe(e.Handoff.Seconds())
		m.attempts.WithLabelValues("poisoned").Observe(float64(e.Attempt))
	case amqpretry.EventHandoffFailed:
		cause := e.Cause
		if cause == "" {
			cause = "other"
		}
		m.handoffFailures.WithLabelValues(e.Queue, cause).Inc()
	case amqpretry.EventOutageStarted:
		m.outageCount.WithLabelValues(e.Queue).Inc()
		m.outages.started(e.Queue)
	case amqpretry.EventProbe:
		m.probes.WithLabelValues(e.Queue, probeResult(e)).Inc()
	case amqpretry.EventOutageEnded:
		m.outages.ended(e.Queue, e.Duration)
	case amqpretry.EventKeyBlocked:
		m.keysBlocked.WithLabelValues(e.Queue).Inc()
		m.blockedKeys.blocked(e.Queue, e.Key)
	case amqpretry.EventKeyReleased:
		m.keysReleased.WithLabelValues(e.Queue).Inc()
		m.blockedKeys.released(e.Queue, e.Key)
	}
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

// tookBy remembers, per work queue and failed attempt, the backend that took the last
// retry scheduled from there, so that a delivered retry whose event does not name its
// backend is labelled with the one that held it: with delay.HeldRetries, the first
// retries are held in the work queue and the later ones copied, by attempt. It is
// bounded by the queues and attempts the application has (maxTook entries at most).
type tookBy struct {
	mu sync.RWMutex
	m  map[string]string
}

const maxTook = 4096

func tookKey(queue string, attempt int) string { return strconv.Itoa(attempt) + "\x00" + queue }

func (t *tookBy) set(queue string, attempt int, backend string) {
	k := tookKey(queue, attempt)
	t.mu.RLock()
	same := t.m[k] == backend
	t.mu.RUnlock()
	if same {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil || len(t.m) >= maxTook {
		t.m = map[string]string{}
	}
	t.m[k] = backend
}

// get returns the backend of the last retry scheduled after attempt from queue, or
// "unknown" if this process scheduled none (another process did).
func (t *tookBy) get(queue string, attempt int) string {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return orUnknown(t.m[tookKey(queue, attempt)])
}
