package metrics_test

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/metrics"
)

// TestOutageMetrics feeds an outage's events to Observe: the gauge is 1 while the queue
// is in an outage and 0 after, the probes are counted by result, and the time in outage
// counts the ongoing outage up to each scrape and each ended outage's Duration, never
// going back.
func TestOutageMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	mx, err := metrics.New(metrics.Config{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	const (
		in      = `amqpretry_in_outage{queue="q"}`
		seconds = `amqpretry_outage_seconds_total{queue="q"}`
		count   = `amqpretry_outages_total{queue="q"}`
		ok      = `amqpretry_outage_probes_total{queue="q",result="ok"}`
		failed  = `amqpretry_outage_probes_total{queue="q",result="failed"}`
	)
	down := amqpretry.Unavailable(errors.New("database down"))
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventSucceeded, Queue: "q", Attempt: 1})
	if got := flatten(mustGather(t, reg)); hasOutageSeries(got) {
		t.Fatalf("outage series before any outage: %v", got)
	}

	mx.Observe(amqpretry.Event{Kind: amqpretry.EventOutageStarted, Queue: "q", Err: down})
	first := flatten(mustGather(t, reg))
	if first[in] != 1 || first[count] != 1 {
		t.Errorf("in the outage: %s = %v, %s = %v, want 1 and 1", in, first[in], count, first[count])
	}
	second := flatten(mustGather(t, reg))
	if !(second[seconds] > first[seconds]) {
		t.Errorf("the ongoing outage's time does not grow between scrapes: %v then %v", first[seconds], second[seconds])
	}
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventProbe, Queue: "q", Attempt: 1, Err: down})
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventProbe, Queue: "q", Attempt: 1, Err: down})
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventProbe, Queue: "q", Attempt: 1})
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventOutageEnded, Queue: "q", Err: down, Duration: 18 * time.Second})
	r := &run{reg: reg}
	r.exactly(t, map[string]float64{in: 0, count: 1, ok: 1, failed: 2, seconds: 18})

	// A second outage adds to the time, from the first's 18 s.
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventOutageStarted, Queue: "q", Err: down})
	got := flatten(mustGather(t, reg))
	if got[in] != 1 || got[count] != 2 || got[seconds] < 18 {
		t.Errorf("second outage: %s = %v, %s = %v, %s = %v; want 1, 2, at least 18", in, got[in], count, got[count], seconds, got[seconds])
	}
	// An ended outage whose Duration is shorter than what a scrape already counted
	// does not take the counter back.
	mx.Observe(amqpretry.Event{Kind: amqpretry.EventOutageEnded, Queue: "q", Duration: 0})
	end := flatten(mustGather(t, reg))
	if end[seconds] < got[seconds] || end[in] != 0 {
		t.Errorf("after the second outage: %s = %v (was %v), %s = %v", seconds, end[seconds], got[seconds], in, end[in])
	}
	for k := range end {
		if strings.Contains(k, `queue="other"`) {
			t.Errorf("series for a queue without events: %s", k)
		}
	}
}

func hasOutageSeries(got map[string]float64) bool {
	for k := range got {
		if strings.Contains(k, "outage") {
			return true
		}
	}
	return false
}

// TestOutageMetricsOnTheBroker: a handler whose dependency is down (it returns
// amqpretry.Unavailable) puts its work queue in an outage on the real broker; the
// gauge shows it while it lasts, failed probes are counted, and when the dependency is
// back the probe succeeds, the gauge goes to 0 and the time in outage is counted.
func TestOutageMetricsOnTheBroker(t *testing.T) {
	const n = 5
	brokertest.Dial(t)
	var up atomic.Bool
	var done atomic.Int64
	r := start(t, brokertest.URI(), amqpretry.Config{
		Prefix:  brokertest.Prefix(t),
		Backend: delay.TTLTiers(500 * time.Millisecond),
		Policy:  amqpretry.Policy{Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1},
		Outage:  amqpretry.Outage{ProbeInterval: 50 * time.Millisecond},
	}, func(*message.Message) error {
		if !up.Load() {
			return amqpretry.Unavailable(errors.New("database down"))
		}
		done.Add(1)
		return nil
	})
	r.publish(t, n, 0)
	in := fmt.Sprintf(`amqpretry_in_outage{queue=%q}`, r.topic)
	failed := fmt.Sprintf(`amqpretry_outage_probes_total{queue=%q,result="failed"}`, r.topic)
	r.waitFor(t, 30*time.Second, func(got map[string]float64) bool { return got[in] == 1 && got[failed] >= 2 })
	up.Store(true)
	r.waitFor(t, 30*time.Second, func(got map[string]float64) bool { return got[in] == 0 && done.Load() == n })
	got := flatten(mustGather(t, r.reg))
	// Every run is an attempt: the one that began the outage and each failed probe
	// took the retry path; the messages that waited spent none.
	retries := 1 + got[failed]
	r.exactly(t, map[string]float64{
		fmt.Sprintf(`amqpretry_outages_total{queue=%q}`, r.topic):                               1,
		fmt.Sprintf(`amqpretry_outage_probes_total{queue=%q,result="ok"}`, r.topic):             1,
		fmt.Sprintf(`amqpretry_retries_scheduled_total{backend="ttl-tiers",queue=%q}`, r.topic): retries,
		`amqpretry_attempts_sum{outcome="succeeded"}`:                                           n + retries, // no attempt spent waiting
	})
	// Two failed probes at 50 ms then 100 ms: the outage lasted at least 150 ms.
	if s := got[fmt.Sprintf(`amqpretry_outage_seconds_total{queue=%q}`, r.topic)]; s < 0.15 {
		t.Errorf("time in outage %v s, want at least the two failed probes' intervals, 0.15 s", s)
	}
}
