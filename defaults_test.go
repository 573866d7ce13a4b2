package amqpretry_test

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/topology"
)

func TestConfigDefaults(t *testing.T) {
	got := amqpretry.Config{}.WithDefaults()
	ms := time.Millisecond
	wantTiers := []time.Duration{
		1000 * ms, 1250 * ms, 1600 * ms, 2000 * ms, 2500 * ms, 3150 * ms, 4000 * ms, 5000 * ms, 6300 * ms, 8000 * ms,
		10 * time.Second, 12500 * ms, 16 * time.Second, 20 * time.Second, 25 * time.Second, 31500 * ms, 40 * time.Second, 50 * time.Second, 63 * time.Second, 80 * time.Second,
		100 * time.Second, 125 * time.Second, 160 * time.Second, 200 * time.Second, 250 * time.Second, 315 * time.Second, 400 * time.Second, 500 * time.Second,
		10 * time.Minute, 15 * time.Minute, 20 * time.Minute, 30 * time.Minute, 45 * time.Minute, time.Hour,
	}
	if len(wantTiers) != 34 {
		t.Fatalf("the test lists %d tiers", len(wantTiers))
	}
	want := amqpretry.Config{
		Backend: delay.TTLTiers(),
		Prefix:  "amqpretry",
		Policy: amqpretry.Policy{
			MaxAttempts: 5, Jitter: 0.2, Delays: []time.Duration{
				time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second,
				64 * time.Second, 128 * time.Second, 256 * time.Second, 512 * time.Second, 10 * time.Minute,
			},
		},
		Outage:      amqpretry.Outage{Consecutive: 10, Ratio: 0.8, ProbeInterval: time.Second},
		PoisonQueue: "amqpretry.poison",
		Topology:    topology.ModeDeclare,
		Logger:      watermill.NopLogger{},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Config{}.WithDefaults() =\n%+v\nwant\n%+v", got, want)
	}
	if err := got.Validate(); err != nil {
		t.Errorf("the defaults are invalid: %v", err)
	}
	// The default tiers are ascending, a whole number of milliseconds each, and no step
	// is wider than the default jitter (±20%: 1.2/0.8 = 1.5).
	for i := 1; i < len(wantTiers); i++ {
		if r := float64(wantTiers[i]) / float64(wantTiers[i-1]); r <= 1 || r > 1.5 {
			t.Errorf("tier %s after %s: ratio %.2f", wantTiers[i], wantTiers[i-1], r)
		}
	}
	if !slices.Equal(backend.DefaultTiers(), wantTiers) {
		t.Error("backend.DefaultTiers differs from the default ladder")
	}
}

func TestConfigDefaultsFollowAndKeep(t *testing.T) {
	// The poison queue follows the prefix.
	if got := (amqpretry.Config{Prefix: "shop"}).WithDefaults().PoisonQueue; got != "shop.poison" {
		t.Errorf("poison queue under prefix shop: %q", got)
	}
	// Set fields are kept.
	set := amqpretry.Config{
		Backend: delay.HeldRetries(2, 3*time.Second, delay.BinaryLevels(7)), Prefix: "p", PoisonQueue: "dead",
		Topology: topology.ModeVerify,
		Policy:   amqpretry.Policy{MaxAttempts: 2, Delays: amqpretry.Exponential(time.Minute, 3, time.Hour), Jitter: 0.5, Immediate: 1},
		Outage:   amqpretry.Outage{Consecutive: 3, Ratio: 0.5, ProbeInterval: time.Minute},
	}
	got := set.WithDefaults()
	got.Logger = nil
	if !reflect.DeepEqual(got, set) {
		t.Errorf("WithDefaults changed set fields:\n%+v\nwas\n%+v", got, set)
	}
	// A negative Jitter means none, and stays so through defaults applied again; the
	// delayed-retry backend holds every retry itself.
	if j := (amqpretry.Config{Policy: amqpretry.Policy{Jitter: -1}}).WithDefaults().WithDefaults().Policy.Jitter; j != -1 {
		t.Errorf("Jitter -1 (none) became %g", j)
	}
	// Held retries cannot stand in front of a backend that holds every retry already.
	c := amqpretry.Config{Backend: delay.HeldRetries(3, 0, delay.DelayedRetry(0))}
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "delay.HeldRetries(then)") {
		t.Errorf("held retries in front of delayed-retry: %v, want the error naming delay.HeldRetries's then", err)
	}
}

// TestDefaultPolicyJitterSurvivesDefaultTiers: the default policy (1 s doubling, ±20%
// jitter, at most 10 min), as the engine schedules it, on the default ttl-tiers ladder.
// Snapping up to a tier keeps the jitter: each attempt's delays land on at least two
// tiers, none takes more than 60% of them, and none is more than 28% later than asked.
// (On the old ladder, 1s 5s 30s 2m 10m 1h, delays asked for 1, 2, 4 and 8 s came back
// as 9% at 1 s, 72% at 5 s and 19% at 30 s.)
func TestDefaultPolicyJitterSurvivesDefaultTiers(t *testing.T) {
	tiers, err := backend.Open(delay.TTLTiers(), backend.Setup{Prefix: "amqpretry"})
	if err != nil {
		t.Fatal(err)
	}
	policy := amqpretry.Policy{MaxAttempts: 11} // the default schedule, attempts 1 to 10
	const samples = 2000
	for attempt := 1; attempt <= 10; attempt++ {
		counts := map[time.Duration]int{}
		for _, requested := range schedule(t, policy, attempt, samples) {
			effective, err := tiers.Effective(requested)
			if err != nil {
				t.Fatal(err)
			}
			if effective < requested || float64(effective) > 1.29*float64(requested) {
				t.Fatalf("attempt %d: %s asked, %s applied", attempt, requested, effective)
			}
			counts[effective]++
		}
		most := 0
		for _, n := range counts {
			most = max(most, n)
		}
		if len(counts) < 2 || most > samples*6/10 {
			t.Errorf("attempt %d: delays on %d tiers, the busiest with %d of %d: the jitter is lost", attempt, len(counts), most, samples)
		}
	}
}
