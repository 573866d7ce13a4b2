package metrics_test

import (
	"context"
	"os"
	"regexp"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.yaml.in/yaml/v2"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/derived"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/metrics"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
)

// TestRefreshWaiting: two retries wait 10 minutes for one work queue, none for the
// other: the waiting gauge counts 2 and 0, the next-due gauge is the first due time,
// and absent for the queue where none waits.
func TestRefreshWaiting(t *testing.T) {
	brokertest.Dial(t)
	if _, err := brokertest.Ctl(context.Background(), "-q", "list_queues", "name"); err != nil {
		t.Skipf("needs rabbitmqctl: %v", err)
	}
	prefix := brokertest.Prefix(t)
	busy, idle := prefix+".orders", prefix+".invoices"
	cfg := amqpretry.Config{Prefix: prefix, Backend: delay.TTLTiers(10 * time.Minute)}
	plan, err := cfg.Plan(busy, idle)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, plan)
	brokertest.Cleanup(t, []string{busy, idle}, nil) // Apply creates the work queues too
	o, err := ops.New(ops.Config{URI: brokertest.URI(), Retry: cfg, Rabbitmqctl: brokertest.Ctl})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	if _, err := o.Apply(context.Background(), busy, idle); err != nil {
		t.Fatal(err)
	}
	h, err := handoff.Dial(backend.HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	b, err := derived.Of(cfg).Open(backend.Env{Handoff: h})
	if err != nil {
		t.Fatal(err)
	}
	first := time.Now().Add(10 * time.Minute).Truncate(time.Millisecond)
	for i, id := range []string{"r-1", "r-2"} {
		msg := message.NewMessage(id, []byte(id))
		middleware.Envelope{Queue: busy, Attempt: 1, Due: first.Add(time.Duration(i) * time.Second)}.Write(msg.Metadata)
		wdelay.Message(msg, wdelay.For(10*time.Minute))
		if err := (backend.Scheduler{Backend: b}).Publish(busy, msg); err != nil {
			t.Fatal(err)
		}
	}
	reg := prometheus.NewRegistry()
	mx, err := metrics.New(metrics.Config{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if err := mx.RefreshWaiting(context.Background(), o, busy, idle); err != nil {
			t.Fatal(err)
		}
		if n, _ := testutil.GatherAndCount(reg, "amqpretry_work_queue_waiting_retries"); n == 2 {
			families, _ := reg.Gather()
			var waiting = map[string]float64{}
			var next = map[string]float64{}
			for _, f := range families {
				for _, m := range f.GetMetric() {
					switch f.GetName() {
					case "amqpretry_work_queue_waiting_retries":
						waiting[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
					case "amqpretry_next_retry_due_timestamp_seconds":
						next[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
					}
				}
			}
			if waiting[busy] == 2 {
				if waiting[idle] != 0 || len(next) != 1 || next[busy] != float64(first.UnixMilli())/1000 {
					t.Fatalf("waiting %v, next due %v, want %s", waiting, next, first)
				}
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the waiting gauge never reached 2")
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestAlertRules: the example alert rules parse, and every amqpretry metric they name
// is one New registers: they cannot drift from the code.
func TestAlertRules(t *testing.T) {
	data, err := os.ReadFile("example/alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert, Expr, For string
			}
		}
	}
	if err := yaml.Unmarshal(data, &rules); err != nil {
		t.Fatal(err)
	}
	known := &metricNames{m: map[string]bool{}}
	if _, err := metrics.New(metrics.Config{Registerer: known}); err != nil {
		t.Fatal(err)
	}
	if !known.m["amqpretry_next_retry_due_timestamp_seconds"] {
		t.Fatalf("the recorder missed a metric: %v", known.m)
	}
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			if r.Alert == "" || r.Expr == "" {
				t.Errorf("rule %+v lacks alert or expr", r)
			}
			for _, name := range regexp.MustCompile(`amqpretry_[a-z_]+`).FindAllString(r.Expr, -1) {
				if !known.m[name] {
					t.Errorf("alert %s names %s, which the metrics module does not export", r.Alert, name)
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("no alert rule")
	}
}

// metricNames is a prometheus.Registerer that records the name of every metric registered.
type metricNames struct{ m map[string]bool }

func (n *metricNames) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc, 16)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		if m := regexp.MustCompile(`fqName: "([^"]+)"`).FindStringSubmatch(d.String()); m != nil {
			n.m[m[1]] = true
		}
	}
	return nil
}

func (n *metricNames) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		_ = n.Register(c)
	}
}

func (n *metricNames) Unregister(prometheus.Collector) bool { return false }
