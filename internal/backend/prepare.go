package backend

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/topology"
)

// Prepare readies b on the broker at start-up, as mode says: it refuses a backend the
// broker's version cannot run, then declares (or, in topology.ModeVerify, checks) b's
// publishing side.
func Prepare(b Backend, h *handoff.Handoff, mode topology.Mode) error {
	v := h.Version()
	de, isDE := b.(*delayedExchange)
	switch {
	case isDE && version.NoPlugins(v):
		return de.errPluginMissing(v, nil)
	case (b.Name() == delay.DelayedRetry || b.Name() == delay.DeliveryTime) && !version.DelayedRetry(v):
		return UnsupportedError(b.Name(), v)
	}
	err := h.Ensure(mode, b.Topology())
	switch {
	case err == nil:
		return nil
	case isDE && pluginMissing(err):
		return de.errPluginMissing(v, err)
	}
	return fmt.Errorf("%s topology (mode %s): %w", b.Name(), mode, err)
}

// UnsupportedError is the start-up error of a backend that retries in place (name) on
// a broker older than 4.3.
func UnsupportedError(name, brokerVersion string) error {
	if brokerVersion == "" {
		brokerVersion = "of unknown version"
	}
	why := "it would ignore the work queue's x-delayed-retry-* arguments and redeliver every nacked message at once, a hot loop"
	if name == delay.DeliveryTime {
		why = "it does not hold a delivery settled with x-opt-delivery-time"
	}
	return fmt.Errorf("%s is %w by this broker: retries held in the work queue need RabbitMQ 4.3 or later, and the broker is %s: %s; use %s or %s there",
		name, delay.ErrUnsupported, brokerVersion, why, delay.TTLTiers, delay.BinaryLevels)
}

// ApplyCommand returns the `amqpretry topology apply` command line that creates what s
// needs, with the poison queue and the work queues, giving only the flags that differ
// from the defaults. retries is the number of delayed retries held in the work queue
// (0 for none), retryDelay their delay.
func ApplyCommand(s Spec, poison string, retries int, retryDelay time.Duration, queues ...string) string {
	args := []string{"amqpretry", "topology", "apply", "--backend", s.Name}
	if s.Prefix != names.DefaultPrefix {
		args = append(args, "--prefix", s.Prefix)
	}
	switch {
	case s.Name == delay.TTLTiers && !slices.Equal(s.Tiers, DefaultTiers()):
		tiers := make([]string, len(s.Tiers))
		for i, t := range s.Tiers {
			tiers[i] = names.Tier(t)
		}
		args = append(args, "--tiers", strings.Join(tiers, ","))
	case s.Name == delay.BinaryLevels && s.Levels != DefaultLevels:
		args = append(args, "--levels", strconv.Itoa(s.Levels))
	}
	if retries > 0 && s.Name != delay.DelayedRetry {
		args = append(args, "--delayed-retries", strconv.Itoa(retries))
	}
	if (retries > 0 || s.Name == delay.DelayedRetry) && retryDelay != DefaultRetryDelay {
		args = append(args, "--retry-delay", retryDelay.String())
	}
	if poison != (names.Names{Prefix: s.Prefix}).Poison() {
		args = append(args, "--poison-queue", poison)
	}
	for _, q := range queues {
		args = append(args, "--queue", q)
	}
	return strings.Join(args, " ")
}
