package ops_test

import (
	"testing"
	"time"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/ops"
)

// TestHasPluginWaiting: only a backend whose waiting retries its plugin alone counts
// (delayed-exchange) answers true, without a broker; a Config naming no valid backend
// answers false.
func TestHasPluginWaiting(t *testing.T) {
	for _, c := range []struct {
		name    string
		backend delay.Backend
		want    bool
	}{
		{"default", nil, false},
		{"delayed-exchange", delay.DelayedExchange(), true},
		{"binary-levels", delay.BinaryLevels(12), false},
		{"delayed-retry", delay.DelayedRetry(time.Second), false},
		{"held retries before ttl-tiers", delay.HeldRetries(2, time.Second, nil), false},
		{"invalid", delay.BinaryLevels(40), false},
	} {
		if got := ops.HasPluginWaiting(amqpretry.Config{Backend: c.backend}); got != c.want {
			t.Errorf("%s: HasPluginWaiting = %v, want %v", c.name, got, c.want)
		}
	}
}
