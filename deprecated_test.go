//lint:file-ignore SA1019 the deprecated fields are what this test compiles against

package amqpretry_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
)

// TestDeprecatedFlatSettings: code written against the flat backend settings
// (Config.Tiers, Levels, DelayedRetryDelay, Memory) still compiles and means the same
// for one release: a backend value that leaves its own setting zero takes the flat
// one, and its own wins (docs/migration.md).
func TestDeprecatedFlatSettings(t *testing.T) {
	plan := func(cfg amqpretry.Config) []string {
		t.Helper()
		p, err := cfg.Plan("q")
		if err != nil {
			t.Fatal(err)
		}
		var delayQueues []string
		for _, q := range p.Queues {
			if q.Role == "delay" {
				delayQueues = append(delayQueues, q.Name)
			}
		}
		return delayQueues
	}
	if got := plan(amqpretry.Config{Tiers: []time.Duration{time.Second, time.Minute}}); !slices.Equal(got, []string{"amqpretry.delay.1s", "amqpretry.delay.1m"}) {
		t.Errorf("Tiers without a backend: delay queues %v", got)
	}
	if got := plan(amqpretry.Config{Backend: delay.TTLTiers{Tiers: []time.Duration{time.Second}}, Tiers: []time.Duration{time.Minute}}); !slices.Equal(got, []string{"amqpretry.delay.1s"}) {
		t.Errorf("the value's own Tiers against the flat ones: delay queues %v, want the value's", got)
	}
	if got := plan(amqpretry.Config{Backend: delay.BinaryLevels{}, Levels: 3}); len(got) != 3 {
		t.Errorf("BinaryLevels{} with the flat Levels 3: delay queues %v", got)
	}
	if v := (amqpretry.Config{Backend: delay.DelayedRetry{}, DelayedRetryDelay: 3 * time.Second}).Derived(); v.Caps.Longest != 3*time.Second {
		t.Errorf("DelayedRetry{} with the flat DelayedRetryDelay 3s: keeps %s", v.Caps.Longest)
	}
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubsub.Close()
	if err := (amqpretry.Config{Backend: delay.Memory{}, Memory: pubsub}).Validate(); err != nil {
		t.Errorf("Memory{} with the flat Memory: %v", err)
	}
	if err := (amqpretry.Config{Backend: delay.Memory{}}).Validate(); err == nil || !strings.Contains(err.Error(), "Memory: required for the memory backend") {
		t.Errorf("Memory{} without a publisher: %v", err)
	}
}
