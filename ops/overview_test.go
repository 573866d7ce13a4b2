package ops_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/ops"
)

// TestOverviewOrder (issue 43): the order every view of Status reads in, decided once:
// the poison and parking queues, the work queues with a backlog and no consumer, what
// is flagged; then the other work queues; the delay queues sum up in one line.
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
		{"first", names(ov.First), "[p.poison p.parking p.orders p.delay.2s p.gone]"},
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
	if !s.Queues[6].Unconsumed() || s.Queues[5].Unconsumed() || s.Queues[7].Unconsumed() || s.Queues[4].Unconsumed() {
		t.Errorf("Unconsumed: only a work queue with ready messages and no consumer")
	}
}
