package middleware

import (
	"testing"
	"time"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/derived"
)

// TestLongestBoundsEveryDelay: the policy's longest delay (derived.Of(cfg).Longest),
// which Config.Validate checks against the backend's limits and the start logs, bounds every delay the engine asks for (delayOf) in the
// retries it counts, and is reached without jitter.
func TestLongestBoundsEveryDelay(t *testing.T) {
	for _, p := range []amqpretry.Policy{
		{MaxAttempts: 3},
		{MaxAttempts: 10},
		{MaxAttempts: 30, Jitter: 0.9},
		{MaxAttempts: 6, Delays: amqpretry.Exponential(300*time.Millisecond, 1.7, 7*time.Second), Jitter: 0.5},
		{MaxAttempts: 6, Delays: []time.Duration{3 * time.Second}},
		{MaxAttempts: 4, Delays: []time.Duration{time.Second, 9 * time.Second, 2 * time.Second, time.Hour}},
		{MaxAttempts: 6, Jitter: -1, Delays: amqpretry.Exponential(time.Second, 3, time.Minute)},
		{MaxAttempts: 6, Jitter: -1},
	} {
		cfg := amqpretry.Config{Policy: p}.WithDefaults()
		p, longest := cfg.Policy, derived.Of(cfg).Longest
		n := p.MaxAttempts - 1 // the retries: none run in this process, none held
		var seen time.Duration
		for i := 1; i <= n; i++ {
			for range 200 {
				d := delayOf(p, i)
				if d > longest {
					t.Fatalf("%+v: delay %d = %s, longer than Longest = %s", p, i, d, longest)
				}
				seen = max(seen, d)
			}
		}
		if p.Jitter < 0 && seen != longest {
			t.Errorf("%+v without jitter: longest delay seen %s, Longest %s", p, seen, longest)
		}
	}
}
