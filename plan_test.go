package amqpretry_test

import (
	"testing"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
)

// TestPlanRoles: every queue of a plan says what the library keeps in it, so that the
// metrics module and ops read the roles from the plan rather than rebuild them.
func TestPlanRoles(t *testing.T) {
	for _, c := range []struct {
		backend delay.Backend
		want    map[string]int // role → queues (the work queue is in a plan when it needs arguments)
	}{
		{delay.TTLTiers, map[string]int{"delay": len(amqpretry.Config{}.WithDefaults().Tiers), "parking": 1, "poison": 1, "work": 0}},
		{delay.BinaryLevels, map[string]int{"delay": amqpretry.Config{}.WithDefaults().Levels, "parking": 1, "poison": 1, "work": 0}},
		{delay.DelayedRetry, map[string]int{"delay": 0, "parking": 0, "poison": 1, "work": 1}},
	} {
		t.Run(string(c.backend), func(t *testing.T) {
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
