package amqpretry_test

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
)

// TestConfiguredView: what the middleware, its transports and ops derive from a
// Config (Config.Derived) agrees with what the Config itself plans and validates: the
// backend it names, the one held in front of it, the work queues' arguments (the
// plan's), the longest delay and the fix's command.
func TestConfiguredView(t *testing.T) {
	for _, c := range []struct {
		name     string
		cfg      amqpretry.Config
		held     bool
		longest  time.Duration
		schedule string // the start of the description
	}{
		{"default", amqpretry.Config{}, false, 9600 * time.Millisecond, "1s, ×2 per retry up to 10m0s, jitter ±20%"},
		{"held retries", amqpretry.Config{HeldRetries: 2, DelayedRetryDelay: 3 * time.Second}, true, 2400 * time.Millisecond,
			"2 retries held in the work queue 3s apart, then 1s, ×2 per retry"},
		{"delayed-retry", amqpretry.Config{Backend: delay.DelayedRetry, DelayedRetryDelay: 2 * time.Second}, false, 2 * time.Second,
			"every retry held in the work queue 2s (DelayedRetryDelay)"},
		{"binary-levels", amqpretry.Config{Backend: delay.BinaryLevels, Levels: 12, Prefix: "p", Policy: amqpretry.Policy{Delays: []time.Duration{time.Minute}}},
			false, time.Minute, "delays [1m0s], the last repeating"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := c.cfg.WithDefaults()
			v := cfg.Derived()
			want := backend.Spec{Name: string(cfg.Backend), Prefix: cfg.Prefix, Tiers: cfg.Tiers, Levels: cfg.Levels, RetryDelay: cfg.DelayedRetryDelay}
			if !reflect.DeepEqual(v.Backend, want) {
				t.Errorf("Backend = %+v, want %+v", v.Backend, want)
			}
			if got := v.Held != nil; got != c.held {
				t.Fatalf("Held = %+v, want one: %v", v.Held, c.held)
			}
			if c.held && (v.Held.Name != string(delay.DelayedRetry) || v.Held.RetryDelay != cfg.DelayedRetryDelay) {
				t.Errorf("Held = %+v, want delayed-retry every %s", *v.Held, cfg.DelayedRetryDelay)
			}
			if v.Longest != c.longest {
				t.Errorf("Longest = %s, want %s", v.Longest, c.longest)
			}
			if !strings.HasPrefix(v.Schedule, c.schedule) {
				t.Errorf("Schedule = %q, want it to start %q", v.Schedule, c.schedule)
			}
			plan, err := cfg.Plan("work")
			if err != nil {
				t.Fatal(err)
			}
			var planned map[string]any
			for _, q := range plan.Queues {
				if q.Role == "work" {
					planned = q.Args
				}
			}
			if !reflect.DeepEqual(map[string]any(v.WorkQueueArgs), planned) || v.Fix.HoldsRetries != (planned != nil) {
				t.Errorf("WorkQueueArgs = %v, HoldsRetries %v; the plan's work queue has %v", v.WorkQueueArgs, v.Fix.HoldsRetries, planned)
			}
			if got, want := v.Fix.Apply("work"), cfg.ApplyCommand("work"); got != want {
				t.Errorf("Fix.Apply = %q, want %q", got, want)
			}
		})
	}
}
