package ops_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/ops"
)

// TestOverviewOrder (issue 43): the order every view of Status reads in, decided once:
// the poison and parking queues, the work queues whose consumers keep deliveries
// without acking (issue 41), those with a backlog and no consumer, what is flagged; then the other work queues; the delay queues sum up in one line.
func TestOverviewOrder(t *testing.T) {
	soon := time.Now().Add(time.Minute)
	s := ops.Status{
		Queues: []ops.QueueStatus{
			{Name: "p.delay.1s", Role: "delay", Exists: true, Counted: true, Messages: 2, Ready: 0, WaitingRead: true, Waiting: 2, NextDue: soon.Add(time.Second)},
			{Name: "p.delay.2s", Role: "delay", Exists: true, Counted: true, Consumers: 1, WaitingRead: true},
			{Name: "p.delay.4s", Role: "delay", Exists: true, Counted: true, Messages: 1, Ready: 1, WaitingRead: true, Waiting: 1, NextDue: soon},
			{Name: "p.parking", Role: "parking", Exists: true},
			{Name: "p.poison", Role: "poison", Exists: true, Ready: 10},
			{Name: "p.served", Role: "work", Exists: true, Ready: 5, Consumers: 1},
			{Name: "p.stalled", Role: "work", Exists: true, Ready: 3, Consumers: 1, Counted: true, Messages: 5, Unacked: 2, Stalled: 2 * time.Second},
			{Name: "p.orders", Role: "work", Exists: true, Ready: 10},
			{Name: "p.gone", Role: "work"},
		},
		Flags: []ops.Flag{{Kind: ops.FlagConsumed, Name: "p.delay.2s", Role: "delay", Count: 1}, {Kind: ops.FlagMissing, Name: "p.gone", Role: "work"}},
	}
	ov := s.Overview()
	names := func(qs []ops.QueueStatus) string {
		var out []string
		for _, q := range qs {
			out = append(out, q.Name)
		}
		return fmt.Sprint(out)
	}
	for _, c := range []struct{ what, got, want string }{
		{"first", names(ov.First), "[p.poison p.parking p.stalled p.orders p.delay.2s p.gone]"},
		{"work", names(ov.Work), "[p.served]"},
		{"delay queues", names(ov.DelayQueues), "[p.delay.1s p.delay.4s]"},
	} {
		if c.got != c.want {
			t.Errorf("%s: %s, want %s", c.what, c.got, c.want)
		}
	}
	want := ops.DelaySummary{Queues: 3, Flagged: 1, Messages: 3, Counted: true, WaitingRead: true, NextDue: soon}
	if ov.Delay != want {
		t.Errorf("delay summary:\n got %+v\nwant %+v", ov.Delay, want)
	}
	if !s.Queues[7].Unconsumed() || s.Queues[5].Unconsumed() || s.Queues[8].Unconsumed() || s.Queues[4].Unconsumed() {
		t.Errorf("Unconsumed: only a work queue with ready messages and no consumer")
	}
	if !s.Queues[6].PossibleOutage() || s.Queues[5].PossibleOutage() || s.Queues[7].PossibleOutage() {
		t.Errorf("PossibleOutage: only a work queue with consumers whose counts did not move")
	}
}

// keeper is a consumer that keeps its deliveries without acking them, as a consumer
// in an outage does (its prefetch full, the rest ready in the queue).
type keeper struct {
	ch         *amqp.Channel
	deliveries <-chan amqp.Delivery
	kept       []amqp.Delivery
}

// keep publishes n messages to queue with confirms and consumes them with prefetch,
// acking none; it returns once the broker counts prefetch unacked and n-prefetch
// ready.
func keep(t *testing.T, counts func(context.Context) (ops.BrokerCounts, error), queue string, n, prefetch int) *keeper {
	t.Helper()
	conn := brokertest.Dial(t)
	pub, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Confirm(false); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		c, err := pub.PublishWithDeferredConfirm("", queue, true, false, amqp.Publishing{Body: []byte{byte(i)}})
		if err != nil {
			t.Fatal(err)
		}
		if ok, err := c.WaitContext(t.Context()); !ok || err != nil {
			t.Fatalf("publish to %s: acked %t, %v", queue, ok, err)
		}
	}
	h := &keeper{}
	if h.ch, err = conn.Channel(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.ch.Close() })
	if err := h.ch.Qos(prefetch, 0, false); err != nil {
		t.Fatal(err)
	}
	if h.deliveries, err = h.ch.Consume(queue, "", false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	for range prefetch {
		h.next(t)
	}
	waitFor(t, 30*time.Second, func() bool {
		c, err := counts(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		return c.Unacked[queue] == prefetch && c.Ready[queue] == n-prefetch
	})
	return h
}

// next waits for the next delivery and keeps it.
func (h *keeper) next(t *testing.T) {
	t.Helper()
	select {
	case d := <-h.deliveries:
		h.kept = append(h.kept, d)
	case <-time.After(30 * time.Second):
		t.Fatal("no delivery within 30 s")
	}
}

// TestStatusPossibleOutage: a work queue whose consumer keeps its prefetch of
// deliveries, acking none, while more wait ready: the broker's counts do not move
// between Status's two samples (Stalled), and the overview puts the queue first, after
// the poison and parking queues. When the consumer acks one between the samples (and
// takes the next: the counts moved), it is not Stalled. Without the broker's counts,
// Status says nothing of it.
func TestStatusPossibleOutage(t *testing.T) {
	t.Parallel()
	skipShort(t)
	counts := ctlCounts(t)
	r := newRig(t, "idle", "orders")
	r.apply()
	orders := r.queues[1]
	h := keep(t, counts, orders, 5, 2)
	const interval = 500 * time.Millisecond
	opts := ops.StatusOptions{WorkQueues: r.queues, Counts: counts, SampleInterval: interval, Peek: "never"}
	s, err := r.ops.Status(t.Context(), opts)
	if err != nil {
		t.Fatal(err)
	}
	q := s.Queues[slices.IndexFunc(s.Queues, func(q ops.QueueStatus) bool { return q.Name == orders })]
	if !q.PossibleOutage() || q.Stalled != interval || q.Consumers != 1 || q.Unacked != 2 || q.Ready != 3 {
		t.Errorf("a consumer keeping its deliveries: %+v", q)
	}
	var first []string
	for _, q := range s.Overview().First {
		first = append(first, q.Name)
	}
	if want := []string{r.poisonQueue(), r.prefix + ".parking", orders}; !slices.Equal(first, want) {
		t.Errorf("overview first: %v, want %v", first, want)
	}
	if len(s.Flags) != 0 {
		t.Errorf("a possible outage is not a flag (status exits 0): %+v", s.Flags)
	}

	// The consumer acks one between the two samples and gets the next.
	calls := 0
	opts.Counts = func(ctx context.Context) (ops.BrokerCounts, error) {
		c, err := counts(ctx)
		if calls++; calls == 1 {
			if err := h.kept[0].Ack(false); err != nil {
				t.Fatal(err)
			}
			h.kept = h.kept[1:]
			h.next(t)
		}
		return c, err
	}
	if s, err = r.ops.Status(t.Context(), opts); err != nil {
		t.Fatal(err)
	}
	if calls != 2 {
		t.Errorf("counts read %d times, want 2", calls)
	}
	for _, q := range s.Queues {
		if q.PossibleOutage() || q.Stalled != 0 {
			t.Errorf("counts that moved: %+v", q)
		}
	}

	// Without the broker's counts, nothing is said.
	opts.Counts = nil
	if s, err = r.ops.Status(t.Context(), opts); err != nil {
		t.Fatal(err)
	}
	for _, q := range s.Queues {
		if q.PossibleOutage() {
			t.Errorf("without counts: %+v", q)
		}
	}
}
