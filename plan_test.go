package amqpretry_test

import (
	"testing"
	"time"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
)

// TestPlanRoles: every queue of a plan says what the library keeps in it, so that the
// metrics module and ops read the roles from the plan rather than rebuild them.
func TestPlanRoles(t *testing.T) {
	for _, c := range []struct {
		backend delay.Backend
		want    map[string]int // role → queues (the work queue is in a plan when it needs arguments)
	}{
		{delay.TTLTiers(), map[string]int{"delay": len(backend.DefaultTiers()), "parking": 1, "poison": 1, "work": 0}},
		{delay.BinaryLevels(0), map[string]int{"delay": backend.DefaultLevels, "parking": 1, "poison": 1, "work": 0}},
		{delay.DelayedRetry(0), map[string]int{"delay": 0, "parking": 0, "poison": 1, "work": 1}},
	} {
		t.Run(c.backend.Name(), func(t *testing.T) {
			cfg := amqpretry.Config{Backend: c.backend, Prefix: "roles"}
			plan, err := cfg.Plan("orders")
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]int{"delay": 0, "parking": 0, "poison": 0, "work": 0}
			for _, q := range plan.Queues {
				if _, known := got[q.Role]; !known {
					t.Errorf("queue %q: role %q, want delay, parking, poison or work", q.Name, q.Role)
				}
				got[q.Role]++
				if q.Role == "poison" && q.Name != cfg.WithDefaults().PoisonQueue {
					t.Errorf("poison role on %q, want the poison queue %q", q.Name, cfg.WithDefaults().PoisonQueue)
				}
			}
			for role, n := range c.want {
				if got[role] != n {
					t.Errorf("%d queues of role %q, want %d (plan %+v)", got[role], role, n, plan.Queues)
				}
			}
		})
	}
}

// TestApplyCommand: the command that creates what a config needs gives a flag for each
// field that differs from its default, and a --queue for each work queue.
func TestApplyCommand(t *testing.T) {
	for _, tt := range []struct {
		cfg    amqpretry.Config
		queues []string
		want   string
	}{
		{amqpretry.Config{}, nil, "amqpretry topology apply --backend ttl-tiers"},
		{amqpretry.Config{Prefix: "shop", Backend: delay.TTLTiers(time.Second, 90*time.Second)}, []string{"q1", "q2"},
			"amqpretry topology apply --backend ttl-tiers --prefix shop --tiers 1s,1m30s --queue q1 --queue q2"},
		{amqpretry.Config{Backend: delay.BinaryLevels(10)}, nil, "amqpretry topology apply --backend binary-levels --levels 10"},
		{amqpretry.Config{Backend: delay.BinaryLevels(0)}, nil, "amqpretry topology apply --backend binary-levels"},
		{amqpretry.Config{Backend: delay.DelayedExchange(), Prefix: "x"}, []string{"q"}, "amqpretry topology apply --backend delayed-exchange --prefix x --queue q"},
		{amqpretry.Config{Backend: delay.HeldRetries(2, 5*time.Second, nil), PoisonQueue: "dead"}, []string{"q"},
			"amqpretry topology apply --backend ttl-tiers --held-retries 2 --retry-delay 5s --poison-queue dead --queue q"},
		{amqpretry.Config{Backend: delay.HeldRetries(2, 0, nil)}, nil, "amqpretry topology apply --backend ttl-tiers --held-retries 2"},
		{amqpretry.Config{Backend: delay.DelayedRetry(0)}, nil, "amqpretry topology apply --backend delayed-retry"},
		{amqpretry.Config{Backend: delay.DelayedRetry(2500 * time.Millisecond)}, nil, "amqpretry topology apply --backend delayed-retry --retry-delay 2.5s"},
	} {
		if got := tt.cfg.ApplyCommand(tt.queues...); got != tt.want {
			t.Errorf("ApplyCommand(%+v) = %q, want %q", tt.cfg, got, tt.want)
		}
	}
}
