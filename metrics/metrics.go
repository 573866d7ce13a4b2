// Package metrics exposes what amqpretry does as Prometheus metrics, registered on a
// registerer you pass in (nothing is global).
//
// It is a module of its own, so that an application that does not want Prometheus does
// not get github.com/prometheus/client_golang in its module graph through amqpretry.
//
//	m, err := metrics.New(metrics.Config{Registerer: prometheus.DefaultRegisterer, Backend: "ttl-tiers"})
//	retry, err := amqpretry.New(amqpretry.Config{..., Observe: m.Observe})
//	go m.WatchQueues(ctx, uri, metrics.QueuesOf(retry), 15*time.Second) // optional gauges
//
// # Metrics
//
// Counters:
//   - amqpretry_retries_scheduled_total{queue,backend}: retries handed off and confirmed.
//   - amqpretry_poisoned_total{queue,reason}: messages poisoned, by reason (permanent,
//     max-attempts, delay-too-long, handoff-failed, too-large).
//   - amqpretry_handoff_failures_total{queue,cause}: failed hand-offs, by cause
//     (returned, nacked, timeout, connection, too-large, not-wired, other).
//
// Histograms:
//   - amqpretry_handoff_seconds: publish to confirm of each confirmed hand-off (retries
//     and poisonings).
//   - amqpretry_redelivery_lateness_seconds{backend}: arrival of a retry minus the due
//     time recorded on it. An early arrival (clock skew between processes, or a delay
//     shortened to the longest tier, which the due time already accounts for) is
//     observed as a negative value: the lowest buckets are -0.1, -0.01 and 0.
//   - amqpretry_attempts{outcome}: the attempt on which a message finally succeeded
//     (outcome="succeeded") or was poisoned (outcome="poisoned").
//
// Gauges, refreshed by WatchQueues on an interval (passive declarations on a connection
// of their own):
//   - amqpretry_waiting_retries{queue}: messages in each delay queue (tiers or levels).
//   - amqpretry_parked_messages{queue}: messages in the parking queue. There is no parked
//     counter: the broker parks a retry when it comes due, out of the library's sight.
//   - amqpretry_poison_queue_messages{queue}: messages in the poison queue.
//
// Labels are bounded: queue is a queue the application subscribes to (or, for the gauges,
// one of the library's own), backend a backend name, reason and cause the sets above.
package metrics

import (
	"errors"
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
)

// CauseNotWired is the cause of a hand-off that failed because the middleware was not
// wired to the message's subscriber (middleware.ErrNotWired).
const CauseNotWired = "not-wired"

// DefaultLatenessBuckets are the buckets of amqpretry_redelivery_lateness_seconds, in
// seconds: early arrivals below 0, then from 5 ms (ttl-tiers is a few ms late) to 30 s.
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
	// Backend is the delay backend's name (retry.Backend().Name()), the backend label.
	// Required.
	Backend string
	// LatenessBuckets. Default: DefaultLatenessBuckets.
	LatenessBuckets []float64
	// HandoffBuckets. Default: DefaultHandoffBuckets.
	HandoffBuckets []float64
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
	if c.Backend == "" {
		errs = append(errs, fmt.Errorf("Backend: required (one of %s)", strings.Join(delay.Backends(), ", ")))
	}
	return errors.Join(errs...)
}

// Metrics records middleware events. Give its Observe method to amqpretry.Config.Observe.
type Metrics struct {
	backend         string
	retries         *prometheus.CounterVec
	poisoned        *prometheus.CounterVec
	handoffFailures *prometheus.CounterVec
	handoff         prometheus.Histogram
	lateness        prometheus.Observer
	attempts        *prometheus.HistogramVec
	waiting         *prometheus.GaugeVec
	parked          *prometheus.GaugeVec
	poisonDepth     *prometheus.GaugeVec
}

// New registers the metrics on cfg.Registerer.
func New(cfg Config) (*Metrics, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	const ns = "amqpretry"
	m := &Metrics{
		backend: cfg.Backend,
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "retries_scheduled_total",
			Help: "Retries handed off to the delay backend and confirmed by the broker."}, []string{"queue", "backend"}),
		poisoned: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "poisoned_total",
			Help: "Messages sent to the poison queue, by reason."}, []string{"queue", "reason"}),
		handoffFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "handoff_failures_total",
			Help: "Hand-offs that failed (the message was nacked for redelivery, or poisoned), by cause."}, []string{"queue", "cause"}),
		handoff: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "handoff_seconds",
			Help: "Time from publish to broker confirm of each confirmed hand-off.", Buckets: cfg.HandoffBuckets}),
		attempts: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "attempts",
			Help: "The attempt on which a message finally succeeded or was poisoned.", Buckets: DefaultAttemptBuckets}, []string{"outcome"}),
		waiting: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "waiting_retries",
			Help: "Messages waiting in each delay queue (refreshed by WatchQueues)."}, []string{"queue"}),
		parked: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "parked_messages",
			Help: "Messages in the parking queue: retries whose work queue was gone (refreshed by WatchQueues)."}, []string{"queue"}),
		poisonDepth: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "poison_queue_messages",
			Help: "Messages in the poison queue (refreshed by WatchQueues)."}, []string{"queue"}),
	}
	lateness := prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "redelivery_lateness_seconds",
		Help:    "Arrival of a retry minus its due time; negative when early.",
		Buckets: cfg.LatenessBuckets}, []string{"backend"})
	m.lateness = lateness.WithLabelValues(cfg.Backend)
	for _, c := range []prometheus.Collector{m.retries, m.poisoned, m.handoffFailures, m.handoff, lateness, m.attempts, m.waiting, m.parked, m.poisonDepth} {
		if err := cfg.Registerer.Register(c); err != nil {
			return nil, fmt.Errorf("register amqpretry metrics: %w", err)
		}
	}
	return m, nil
}

// Observe records one middleware event. It is safe for concurrent use.
func (m *Metrics) Observe(e middleware.Event) {
	switch e.Kind {
	case middleware.EventDelivered:
		if e.Late {
			m.lateness.Observe(e.Lateness.Seconds())
		}
	case middleware.EventSucceeded:
		m.attempts.WithLabelValues("succeeded").Observe(float64(e.Attempt))
	case middleware.EventRetryScheduled:
		m.retries.WithLabelValues(e.Queue, m.backend).Inc()
		m.handoff.Observe(e.Handoff.Seconds())
	case middleware.EventPoisoned:
		m.poisoned.WithLabelValues(e.Queue, e.Reason).Inc()
		m.handoff.Observe(e.Handoff.Seconds())
		m.attempts.WithLabelValues("poisoned").Observe(float64(e.Attempt))
	case middleware.EventHandoffFailed:
		cause := delay.FailureCause(e.Err)
		if errors.Is(e.Err, middleware.ErrNotWired) {
			cause = CauseNotWired
		}
		m.handoffFailures.WithLabelValues(e.Queue, cause).Inc()
	}
}
