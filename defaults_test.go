package amqpretry_test

import (
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
)

// TestDefaultPolicyJitterSurvivesDefaultTiers: the default policy (1 s doubling, ±20%
// jitter, at most 10 min) on the default ttl-tiers ladder. Snapping up to a tier keeps
// the jitter: each attempt's delays land on at least two tiers, none takes more than
// 60% of them, and none is more than 28% later than asked. (On the old ladder, 1s 5s 30s 2m
// 10m 1h, delays asked for 1, 2, 4 and 8 s came back as 9% at 1 s, 72% at 5 s and 19%
// at 30 s.)
func TestDefaultPolicyJitterSurvivesDefaultTiers(t *testing.T) {
	var policy middleware.Policy
	backend := delay.Config{Backend: delay.BackendTTLTiers}
	const samples = 2000
	for attempt := 1; attempt <= 10; attempt++ {
		tiers := map[time.Duration]int{}
		for range samples {
			requested := policy.Delay(attempt)
			effective, err := backend.Effective(requested)
			if err != nil {
				t.Fatal(err)
			}
			if effective < requested || float64(effective) > 1.29*float64(requested) {
				t.Fatalf("attempt %d: %s asked, %s applied", attempt, requested, effective)
			}
			tiers[effective]++
		}
		most := 0
		for _, n := range tiers {
			most = max(most, n)
		}
		if len(tiers) < 2 || most > samples*6/10 {
			t.Errorf("attempt %d: delays on %d tiers, the busiest with %d of %d: the jitter is lost", attempt, len(tiers), most, samples)
		}
	}
}
