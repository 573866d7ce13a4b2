package amqpretry_test

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/derived"
)

// TestConfiguredView: what the middleware, its transports and ops derive from a
// Config (internal/derived.Of) agrees with what the Config itself plans and validates: the
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
		{"held retries", amqpretry.Config{Backend: delay.HeldRetries(2, 3*time.Second, nil)}, true, 2400 * time.Millisecond,
			"2 retries held in the work queue 3s apart, then 1s, ×2 per retry"},
		{"delayed-retry", amqpretry.Config{Backend: delay.DelayedRetry(2 * time.Second)}, false, 2 * time.Second,
			"every retry held in the work queue 2s (its delay)"},
		{"binary-levels", amqpretry.Config{Backend: delay.BinaryLevels(12), Prefix: "p", Policy: amqpretry.Policy{Delays: []time.Duration{time.Minute}}},
			false, time.Minute, "delays [1m0s], the last repeating"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := c.cfg.WithDefaults()
			v := derived.Of(cfg)
			if v.Backend == nil || v.Name != cfg.Backend.Name() || v.Backend.Name() != v.Name || v.Err != nil {
				t.Errorf("Backend = %v (%q, %v), want %s opened", v.Backend, v.Name, v.Err, cfg.Backend.Name())
			}
			if got := v.Held != nil; got != c.held {
				t.Fatalf("Held = %+v, want one: %v", v.Held, c.held)
			}
			if c.held && (v.Held.Name() != (delay.DelayedRetry(0)).Name() || v.Held.Caps().Longest != 3*time.Second || v.HeldRetries != 2) {
				t.Errorf("Held = %s holding %s (%d), want delayed-retry every 3s (2)", v.Held.Name(), v.Held.Caps().Longest, v.HeldRetries)
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
