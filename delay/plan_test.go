package delay_test

import (
	"strings"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/topology"
)

func TestPlanWithoutBroker(t *testing.T) {
	tiers := []time.Duration{5 * time.Second, time.Second}
	p, err := delay.Plan(delay.Config{Prefix: "p", Tiers: tiers}, "a", "b", "a")
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Exchanges) != 3 || len(p.Queues) != 3 || len(p.Bindings) != 5 {
		t.Errorf("ttl-tiers plan: %d exchanges, %d queues, %d bindings; want 3, 3, 5 (no duplicates)", len(p.Exchanges), len(p.Queues), len(p.Bindings))
	}
	qs, err := delay.DelayQueues(delay.Config{Prefix: "p", Tiers: tiers})
	if err != nil || len(qs) != 2 || qs[0] != (delay.DelayQueue{Name: "p.delay.1s", TTL: time.Second}) || qs[1].Name != "p.delay.5s" {
		t.Errorf("delay queues: %v %v", qs, err)
	}
	levels, err := delay.DelayQueues(delay.Config{Backend: delay.BackendBinaryLevels, Prefix: "p", Levels: 3})
	if err != nil || len(levels) != 3 || levels[2].TTL != 4*time.Second {
		t.Errorf("binary-levels delay queues: %v %v", levels, err)
	}
	if _, err := delay.NewPlanner(delay.Config{Backend: delay.BackendMemory}); err == nil {
		t.Error("memory backend planned")
	}
	if got := delay.ParkingQueue(""); got != "amqpretry.parking" {
		t.Errorf("ParkingQueue: %q", got)
	}
}

func TestApplyCommand(t *testing.T) {
	for _, tt := range []struct {
		cfg    delay.Config
		queues []string
		want   string
	}{
		{delay.Config{}, nil, "amqpretry topology apply --backend ttl-tiers"},
		{delay.Config{Prefix: "shop", Tiers: []time.Duration{time.Second, 90 * time.Second}}, []string{"q1", "q2"},
			"amqpretry topology apply --backend ttl-tiers --prefix shop --tiers 1s,1m30s --queue q1 --queue q2"},
		{delay.Config{Backend: delay.BackendBinaryLevels, Levels: 10}, nil, "amqpretry topology apply --backend binary-levels --levels 10"},
		{delay.Config{Backend: delay.BackendDelayedExchange, Prefix: "x"}, []string{"q"}, "amqpretry topology apply --backend delayed-exchange --prefix x --queue q"},
	} {
		if got := delay.ApplyCommand(tt.cfg, tt.queues...); got != tt.want {
			t.Errorf("ApplyCommand(%+v) = %q, want %q", tt.cfg, got, tt.want)
		}
	}
	p, err := delay.NewPlanner(delay.Config{Prefix: "shop"})
	if err != nil {
		t.Fatal(err)
	}
	if got := p.ApplyCommand("orders"); !strings.HasSuffix(got, "--prefix shop --queue orders") {
		t.Errorf("planner ApplyCommand: %q", got)
	}
	var _ topology.ApplyCommander = p
}
