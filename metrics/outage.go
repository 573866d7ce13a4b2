package metrics

import (
	"sync"
	"time"

	"github.com/amqpretry/amqpretry"
	"github.com/prometheus/client_golang/prometheus"
)

// outages collects, per work queue, whether it is in an outage now
// (amqpretry_in_outage) and the time it has spent in outages
// (amqpretry_outage_seconds_total), counting the ongoing outage's time up to the
// scrape. A queue has no series until its first outage starts.
type outages struct {
	inOutage, seconds *prometheus.Desc

	mu sync.Mutex
	q  map[string]*outageTime
}

type outageTime struct {
	done  time.Duration // ended outages
	since time.Time     // start of the ongoing one, zero when none
}

func newOutages(ns string) *outages {
	return &outages{
		inOutage: prometheus.NewDesc(ns+"_in_outage",
			"1 while the work queue is in an outage (its messages wait for a probe to succeed), 0 after.", []string{"queue"}, nil),
		seconds: prometheus.NewDesc(ns+"_outage_seconds_total",
			"Time the work queue has spent in outages, the ongoing one up to the scrape.", []string{"queue"}, nil),
		q: map[string]*outageTime{},
	}
}

func (o *outages) started(queue string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	t := o.of(queue)
	if t.since.IsZero() {
		t.since = time.Now()
	}
}

// ended adds the ended outage's duration as the middleware measured it, or the time
// since its start event if that is longer (a scrape may have counted it already: the
// counter never goes back).
func (o *outages) ended(queue string, lasted time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	t := o.of(queue)
	if !t.since.IsZero() {
		lasted = max(lasted, time.Since(t.since))
	}
	t.done += max(lasted, 0)
	t.since = time.Time{}
}

func (o *outages) of(queue string) *outageTime {
	t := o.q[queue]
	if t == nil {
		t = &outageTime{}
		o.q[queue] = t
	}
	return t
}

func (o *outages) Describe(ch chan<- *prometheus.Desc) {
	ch <- o.inOutage
	ch <- o.seconds
}

func (o *outages) Collect(ch chan<- prometheus.Metric) {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := time.Now()
	for queue, t := range o.q {
		in, total := 0.0, t.done
		if !t.since.IsZero() {
			in, total = 1, total+now.Sub(t.since)
		}
		ch <- prometheus.MustNewConstMetric(o.inOutage, prometheus.GaugeValue, in, queue)
		ch <- prometheus.MustNewConstMetric(o.seconds, prometheus.CounterValue, total.Seconds(), queue)
	}
}

// probeResult is the result label of amqpretry_outage_probes_total.
func probeResult(e amqpretry.Event) string {
	if e.Err != nil {
		return "failed"
	}
	return "ok"
}
