package ops_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
)

// waitingBackends are the copying backends whose retries wait in delay queues, each
// with a delay that keeps them waiting through a test (10 minutes).
var waitingBackends = []amqpretry.Config{
	{Backend: delay.TTLTiers(10 * time.Minute)},
	{Backend: delay.BinaryLevels(12), Policy: amqpretry.Policy{Delays: []time.Duration{time.Second}, Jitter: -1}},
}

const waitDelay = 10 * time.Minute

// waitingRig is a rig whose Ops reads through rabbitmqctl, with retries waiting.
func waitingRig(t *testing.T, cfg amqpretry.Config, workQueues ...string) *rig {
	t.Helper()
	ctlCounts(t) // skips without rabbitmqctl
	r := newRigWith(t, cfg, workQueues...)
	r.cfg.Rabbitmqctl = brokertest.Ctl
	o, err := ops.New(r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = o.Close() })
	r.ops = o
	r.apply()
	return r
}

// park schedules a retry of queue with the middleware's envelope, due in waitDelay.
func (r *rig) park(queue, id string, attempt int, lastFailure time.Time) {
	r.t.Helper()
	cfg := r.cfg.Retry
	msg := message.NewMessage(id, []byte("payload of "+id))
	middleware.Envelope{Queue: queue, Attempt: attempt, Error: "failed " + id, LastFailure: lastFailure,
		Due: time.Now().Add(waitDelay), EffectiveDelay: waitDelay}.Write(msg.Metadata)
	r.schedule(cfg, queue, msg, waitDelay)
}

// listWaiting lists every waiting retry.
func (r *rig) listWaiting(f ops.Filter) ops.ListResult {
	r.t.Helper()
	res, err := r.ops.List(context.Background(), ops.Waiting, ops.ListOptions{Filter: f, Limit: -1})
	if err != nil {
		r.t.Fatal(err)
	}
	return res
}

// waitWaiting waits until n retries wait.
func (r *rig) waitWaiting(n int) {
	r.t.Helper()
	waitFor(r.t, 30*time.Second, func() bool { return len(r.listWaiting(ops.Filter{}).Messages) == n })
}

// seen is what a later delivery sees of a waiting retry.
type seen struct {
	id, delayQueue    string
	position          int
	attempt           int
	delivery, acquire int64
	release, due      time.Time
}

func seenOf(res ops.ListResult) []seen {
	out := make([]seen, len(res.Messages))
	for i, m := range res.Messages {
		out[i] = seen{m.UUID, m.DelayQueue, m.Position, m.Attempt, m.DeliveryCount, m.AcquiredCount, m.Release, m.Due}
	}
	return out
}

// TestPeekChangesNothing: listing the waiting retries (rabbitmqctl eval of the quorum
// queue's peek) leaves their order, positions, due times, expiries and the broker's
// counters (x-delivery-count, x-acquired-count) as they were, listed three times; a
// basic.get and nack of each, what AMQP 0-9-1 offers instead, changes the counters,
// and the same listing sees it: the counters it reads are the live ones.
func TestPeekChangesNothing(t *testing.T) {
	t.Parallel()
	for _, cfg := range waitingBackends {
		t.Run(cfg.WithDefaults().Backend.Name(), func(t *testing.T) {
			r := waitingRig(t, cfg, "orders", "invoices")
			failed := time.Now().Add(-time.Hour)
			for i := range 5 {
				q := r.queues[i%2]
				r.park(q, fmt.Sprintf("w-%d", i), i+1, failed)
			}
			r.waitWaiting(5)
			before := r.listWaiting(ops.Filter{})
			if len(before.Messages) != 5 || !before.Complete {
				t.Fatalf("listed %+v", before)
			}
			for i, m := range before.Messages {
				if m.UUID != fmt.Sprintf("w-%d", i) || m.Attempt != i+1 || m.Queue != r.queues[i%2] || m.Position != i+1 ||
					m.Release.IsZero() || m.Due.IsZero() || m.DelayQueue == "" || m.DeliveryCount != 0 || m.AcquiredCount != 0 {
					t.Errorf("retry %d: %+v", i, m)
				}
			}
			for range 2 {
				if after := seenOf(r.listWaiting(ops.Filter{})); !slices.Equal(after, seenOf(before)) {
					t.Fatalf("a listing changed what waits:\nbefore %+v\nafter  %+v", seenOf(before), after)
				}
			}
			orders := r.listWaiting(ops.Filter{Queue: r.queues[0]})
			if ids := uuids(orders.Messages); !slices.Equal(ids, []string{"w-0", "w-2", "w-4"}) {
				t.Errorf("retries of %s: %v", r.queues[0], ids)
			}

			// What AMQP 0-9-1 offers instead: take each and give all back at once.
			ch, err := brokertest.Dial(t).Channel()
			if err != nil {
				t.Fatal(err)
			}
			dq := before.Messages[0].DelayQueue
			var last uint64
			for range 5 {
				d, ok, err := ch.Get(dq, false)
				if err != nil || !ok {
					t.Fatalf("get: %v %v", ok, err)
				}
				last = d.DeliveryTag
			}
			if err := ch.Nack(last, true, true); err != nil {
				t.Fatal(err)
			}
			_ = ch.Close()
			waitFor(t, 10*time.Second, func() bool {
				after := r.listWaiting(ops.Filter{})
				return len(after.Messages) == 5 && after.Messages[0].DeliveryCount+after.Messages[0].AcquiredCount > 0
			})
		})
	}
}

func uuids(msgs []ops.Message) []string {
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.UUID
	}
	return ids
}

// TestRetryNowAndPurgeWaiting: retry now brings the matching waiting retries of one
// work queue back to it (by id, then by age), in order and unchanged (attempt kept);
// the others keep waiting, in order; purge drops those of the other queue, after a dry
// run that changes nothing.
func TestRetryNowAndPurgeWaiting(t *testing.T) {
	for _, cfg := range waitingBackends {
		t.Run(cfg.WithDefaults().Backend.Name(), func(t *testing.T) {
			r := waitingRig(t, cfg, "orders", "invoices")
			orders, invoices := r.queues[0], r.queues[1]
			old, recent := time.Now().Add(-2*time.Hour), time.Now()
			r.park(orders, "o-1", 2, old)
			r.park(invoices, "i-1", 1, old)
			r.park(orders, "o-2", 3, recent)
			r.park(orders, "o-3", 1, old)
			r.park(invoices, "i-2", 1, recent)
			r.waitWaiting(5)
			ctx := context.Background()

			res, err := r.ops.Redrive(ctx, ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: orders, IDs: []string{"o-2"}}})
			if err != nil || res.Done != 1 || res.Matched != 1 {
				t.Fatalf("retry now o-2: %v %+v", err, res)
			}
			res, err = r.ops.Redrive(ctx, ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: orders, OlderThan: time.Hour}})
			if err != nil || res.Done != 2 {
				t.Fatalf("retry now older than 1h: %v %+v", err, res)
			}
			got := brokertest.Drain(t, orders)
			if ids := uuidsOf(got); !slices.Equal(ids, []string{"o-2", "o-1", "o-3"}) {
				t.Fatalf("work queue got %v", ids)
			}
			if got[0].Metadata.Get("amqpretry-attempt") != "3" || string(got[0].Payload) != "payload of o-2" {
				t.Errorf("retried copy changed: %v %q", got[0].Metadata, got[0].Payload)
			}
			if ids := uuids(r.listWaiting(ops.Filter{}).Messages); !slices.Equal(ids, []string{"i-1", "i-2"}) {
				t.Fatalf("still waiting: %v", ids)
			}

			if _, err := r.ops.Purge(ctx, ops.Waiting, ops.MoveOptions{}); err == nil || !strings.Contains(err.Error(), "MoveOptions.All") {
				t.Errorf("purge without a filter: %v", err)
			}
			res, err = r.ops.Purge(ctx, ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: invoices}, DryRun: true})
			if err != nil || res.Matched != 2 || res.Done != 0 || !res.DryRun {
				t.Fatalf("purge dry run: %v %+v", err, res)
			}
			if ids := uuids(r.listWaiting(ops.Filter{}).Messages); !slices.Equal(ids, []string{"i-1", "i-2"}) {
				t.Fatalf("after the dry run: %v", ids)
			}
			res, err = r.ops.Purge(ctx, ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: invoices, NewerThan: time.Hour}})
			if err != nil || res.Done != 1 || res.Messages[0].UUID != "i-2" {
				t.Fatalf("purge newer than 1h: %v %+v", err, res)
			}
			if ids := uuids(r.listWaiting(ops.Filter{}).Messages); !slices.Equal(ids, []string{"i-1"}) {
				t.Fatalf("after the purge: %v", ids)
			}
			if n := brokertest.QueueLength(t, invoices); n != 0 {
				t.Errorf("a purge sent %d to the work queue", n)
			}
		})
	}
}

func uuidsOf(msgs []*message.Message) []string {
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.UUID
	}
	return ids
}

// TestListWaitingNeedsRabbitmqctl: without Config.Rabbitmqctl, List refuses Waiting
// and says why and what to set.
func TestListWaitingNeedsRabbitmqctl(t *testing.T) {
	r := newRig(t, "orders")
	_, err := r.ops.List(context.Background(), ops.Waiting, ops.ListOptions{})
	if err == nil || !strings.Contains(err.Error(), "Config.Rabbitmqctl") {
		t.Fatalf("list waiting without rabbitmqctl: %v", err)
	}
}

// closeConnection closes the connections named name (client property connection_name)
// with rabbitmqctl close_connection: only those this test opened.
func closeConnection(t *testing.T, name string) int {
	t.Helper()
	out, err := brokertest.Ctl(context.Background(), "-q", "list_connections", "pid", "client_properties", "--no-table-headers")
	if err != nil {
		t.Fatalf("list_connections: %v\n%s", err, out)
	}
	n := 0
	for _, line := range strings.Split(string(out), "\n") {
		if !strings.Contains(line, `"`+name+`"`) {
			continue
		}
		pid := strings.Fields(line)[0]
		if out, err := brokertest.Ctl(context.Background(), "close_connection", pid, "amqpretry test: retry now under a connection kill"); err != nil {
			t.Errorf("close_connection %s: %v\n%s", pid, err, out)
		}
		n++
	}
	return n
}

// TestRetryNowSurvivesConnectionKill: retry now of 200 waiting retries, its
// connections closed by the broker (rabbitmqctl close_connection) part way: the run
// fails, and every retry is either back in the work queue or still waiting; a second
// run brings the rest back. None lost; a duplicate is possible only for a retry
// confirmed but not acked when the connection died.
func TestRetryNowSurvivesConnectionKill(t *testing.T) {
	skipShort(t)
	const total = 200
	for _, cfg := range waitingBackends {
		t.Run(cfg.WithDefaults().Backend.Name(), func(t *testing.T) {
			r := waitingRig(t, cfg, "orders")
			queue := r.queues[0]
			for i := range total {
				r.park(queue, fmt.Sprintf("k-%03d", i), 1, time.Now())
			}
			r.waitWaiting(total)

			name := "amqpretry-test-kill-" + r.prefix
			cfg := r.cfg
			cfg.AMQP = amqp.Config{Properties: amqp.Table{"connection_name": name}}
			o, err := ops.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			var once sync.Once
			killed := make(chan int, 1)
			res, err := o.Redrive(context.Background(), ops.Waiting, ops.MoveOptions{
				Filter: ops.Filter{Queue: queue}, Rate: 100,
				Progress: func(p ops.MoveResult) {
					if p.Done >= 20 {
						once.Do(func() { killed <- closeConnection(t, name) })
					}
				},
			})
			if n := <-killed; n != 2 {
				t.Fatalf("closed %d connections named %s, want 2 (reading and hand-off)", n, name)
			}
			if err == nil || res.Done >= total {
				t.Fatalf("retry now went on after its connections were closed: %+v", res)
			}
			t.Logf("first run: %d back before the kill (%v)", res.Done, err)
			var waiting int
			waitFor(t, 30*time.Second, func() bool {
				waiting = len(r.listWaiting(ops.Filter{}).Messages)
				return waiting+brokertest.QueueLength(t, queue) >= total
			})
			res, err = r.ops.Redrive(context.Background(), ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: queue}})
			if err != nil || res.Done != waiting {
				t.Fatalf("second run: %v, %d of %d back", err, res.Done, waiting)
			}
			got := uuidsOf(brokertest.Drain(t, queue))
			unique := slices.Compact(slices.Sorted(slices.Values(got)))
			if len(unique) != total {
				t.Fatalf("%d distinct retries back of %d (%d in all)", len(unique), total, len(got))
			}
			t.Logf("%d back, %d distinct, %d duplicates", len(got), len(unique), len(got)-len(unique))
		})
	}
}

// TestWaitingDelayedRetry (RabbitMQ 4.3+): retries a work queue holds in delayed retry
// are listed (due time, counters; the bodies stay in the broker's log) without changing
// them; retry now takes no filter but a limit, and brings back the first due through
// the broker's retry_delayed; purge says it cannot drop them.
func TestWaitingDelayedRetry(t *testing.T) {
	r := newRigWith(t, amqpretry.Config{Backend: delay.DelayedRetry(waitDelay)}, "orders")
	s, err := r.ops.Status(context.Background(), ops.StatusOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !version.DelayedRetry(s.Broker) {
		t.Skipf("RabbitMQ %s has no delayed retry (4.3+)", s.Broker)
	}
	ctlCounts(t)
	r.cfg.Rabbitmqctl = brokertest.Ctl
	o, err := ops.New(r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	r.ops = o
	r.apply()
	queue := r.queues[0]
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	for i := range 3 {
		if err := ch.Publish("", queue, false, false, amqp.Publishing{MessageId: fmt.Sprint("d-", i)}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, func() bool { return brokertest.QueueLength(t, queue) == 3 })
	for range 3 { // fail each once: returned, the broker holds it 10 minutes
		d, ok, err := ch.Get(queue, false)
		if err != nil || !ok {
			t.Fatalf("get: %v %v", ok, err)
		}
		if err := d.Nack(false, true); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	var before ops.ListResult
	waitFor(t, 30*time.Second, func() bool {
		before = r.listWaiting(ops.Filter{Queue: queue})
		return len(before.Messages) == 3
	})
	for _, m := range before.Messages {
		if m.DelayQueue != queue || m.Queue != queue || time.Until(m.Release) < waitDelay-time.Minute || m.AcquiredCount != 1 {
			t.Errorf("held retry: %+v", m)
		}
	}
	if after := seenOf(r.listWaiting(ops.Filter{Queue: queue})); !slices.Equal(after, seenOf(before)) {
		t.Fatalf("a listing changed what waits:\nbefore %+v\nafter  %+v", seenOf(before), after)
	}
	if _, err := r.ops.Redrive(ctx, ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: queue, IDs: []string{"d-1"}}}); err == nil || !strings.Contains(err.Error(), "no filter") {
		t.Errorf("retry now by id in delayed retry: %v", err)
	}
	if _, err := r.ops.Purge(ctx, ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: queue}}); err == nil || !strings.Contains(err.Error(), "no way to drop") {
		t.Errorf("purge of delayed retry: %v", err)
	}
	res, err := r.ops.Redrive(ctx, ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: queue}, Limit: 1})
	if err != nil || res.Done != 1 || res.Matched != 1 {
		t.Fatalf("retry now, limit 1: %v %+v", err, res)
	}
	waitFor(t, 10*time.Second, func() bool { return brokertest.QueueLength(t, queue) == 1 })
	res, err = r.ops.Redrive(ctx, ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: queue}})
	if err != nil || res.Done != 2 {
		t.Fatalf("retry now, all: %v %+v", err, res)
	}
	waitFor(t, 10*time.Second, func() bool { return brokertest.QueueLength(t, queue) == 3 })
	if n := len(r.listWaiting(ops.Filter{Queue: queue}).Messages); n != 0 {
		t.Errorf("%d still held after retry now", n)
	}
	_, _ = ch.QueuePurge(queue, false)
}
