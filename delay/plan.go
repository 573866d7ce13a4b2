package delay

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
)

// Planner describes a RabbitMQ backend's topology without a broker: what New declares
// (Topology), what each work queue needs (WorkQueue), and the command that creates
// both (ApplyCommand). The amqpretry command and package ops build `topology plan`,
// `apply` and `verify` from it.
type Planner interface {
	topology.WorkQueueBinder
	topology.ApplyCommander
	// Name is the backend's name.
	Name() string
	// Topology is what the backend declares on the publishing side.
	Topology() topology.Topology
}

// NewPlanner returns the Planner of the backend cfg names, without connecting (Handoff
// is not needed). The memory backend has no broker topology and is refused.
func NewPlanner(cfg Config) (Planner, error) {
	cfg.setDefaults()
	if cfg.Backend == BackendMemory {
		return nil, errors.New("invalid config: Backend: the memory backend has no broker topology")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	n := names{cfg.Prefix}
	switch cfg.Backend {
	case BackendBinaryLevels:
		return &binaryLevels{names: n, levels: cfg.Levels}, nil
	case BackendDelayedExchange:
		return &delayedExchange{names: n, bound: map[string]bool{}}, nil
	default:
		tiers := slices.Clone(cfg.Tiers)
		slices.Sort(tiers)
		return &ttlTiers{names: n, tiers: tiers}, nil
	}
}

// Plan returns everything the backend cfg names needs on the broker for the given work
// queues: its own topology, then each queue's delivery binding, without duplicates. The
// work queues themselves are not in it (they belong to the application).
func Plan(cfg Config, workQueues ...string) (topology.Topology, error) {
	p, err := NewPlanner(cfg)
	if err != nil {
		return topology.Topology{}, err
	}
	t := p.Topology()
	for _, q := range workQueues {
		t = t.Merge(p.WorkQueue(q))
	}
	return unique(t), nil
}

// unique drops repeated declarations, keeping the first.
func unique(t topology.Topology) topology.Topology {
	var out topology.Topology
	seen := map[string]bool{}
	first := func(key string) bool {
		if seen[key] {
			return false
		}
		seen[key] = true
		return true
	}
	for _, e := range t.Exchanges {
		if first(fmt.Sprintf("e|%s|%s|%v", e.Name, e.Kind, e.Args)) {
			out.Exchanges = append(out.Exchanges, e)
		}
	}
	for _, q := range t.Queues {
		if first(fmt.Sprintf("q|%s|%v", q.Name, q.Args)) {
			out.Queues = append(out.Queues, q)
		}
	}
	for _, b := range t.Bindings {
		if first(fmt.Sprintf("b|%s|%s|%s|%v|%v", b.Exchange, b.Destination, b.Key, b.ToExchange, b.Args)) {
			out.Bindings = append(out.Bindings, b)
		}
	}
	return out
}

// ParkingQueue is the parking queue of the RabbitMQ backends under prefix ("" is
// DefaultPrefix): retries whose work queue was gone when they came due.
func ParkingQueue(prefix string) string {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	return names{prefix}.parking()
}

// DelayQueue is one queue in which the backend holds messages for a fixed TTL.
type DelayQueue struct {
	// Name of the queue.
	Name string
	// TTL is its queue-level message TTL: how long a message waits at most, once it
	// has reached the head.
	TTL time.Duration
}

// DelayQueues lists the delay queues of the backend cfg names (tiers or levels), in
// the order of its topology. The delayed-exchange backend has none.
func DelayQueues(cfg Config) ([]DelayQueue, error) {
	t, err := Plan(cfg)
	if err != nil {
		return nil, err
	}
	var out []DelayQueue
	for _, q := range t.Queues {
		if ms, ok := xdeath.Integer(q.Args[topology.MessageTTLArg]); ok {
			out = append(out, DelayQueue{Name: q.Name, TTL: time.Duration(ms) * time.Millisecond})
		}
	}
	return out, nil
}

// ApplyCommand returns the `amqpretry topology apply` command line that creates the
// topology of the backend cfg names and the delivery bindings of queues, with the
// flags that differ from the defaults. It is quoted in the errors of the verify mode.
func ApplyCommand(cfg Config, queues ...string) string {
	cfg.setDefaults()
	args := []string{"amqpretry", "topology", "apply", "--backend", cfg.Backend}
	if cfg.Prefix != DefaultPrefix {
		args = append(args, "--prefix", cfg.Prefix)
	}
	switch {
	case cfg.Backend == BackendTTLTiers && !slices.Equal(cfg.Tiers, DefaultTiers):
		tiers := make([]string, len(cfg.Tiers))
		for i, t := range cfg.Tiers {
			tiers[i] = TierName(t)
		}
		args = append(args, "--tiers", strings.Join(tiers, ","))
	case cfg.Backend == BackendBinaryLevels && cfg.Levels != DefaultLevels:
		args = append(args, "--levels", strconv.Itoa(cfg.Levels))
	}
	for _, q := range queues {
		args = append(args, "--queue", q)
	}
	return strings.Join(args, " ")
}

// ApplyCommand implements topology.ApplyCommander.
func (b *ttlTiers) ApplyCommand(queues ...string) string {
	return ApplyCommand(Config{Backend: BackendTTLTiers, Prefix: b.names.prefix, Tiers: b.tiers}, queues...)
}

// ApplyCommand implements topology.ApplyCommander.
func (b *binaryLevels) ApplyCommand(queues ...string) string {
	return ApplyCommand(Config{Backend: BackendBinaryLevels, Prefix: b.names.prefix, Levels: b.levels}, queues...)
}

// ApplyCommand implements topology.ApplyCommander.
func (b *delayedExchange) ApplyCommand(queues ...string) string {
	return ApplyCommand(Config{Backend: BackendDelayedExchange, Prefix: b.names.prefix}, queues...)
}

// ensure applies t on a short-lived channel of the hand-off connection as cfg.Topology
// says (declare, verify or nothing). In the verify mode, a missing object is named
// with the command that creates it.
func ensure(cfg Config, t topology.Topology) error {
	err := cfg.Handoff.Ensure(cfg.Topology, t)
	if errors.Is(err, topology.ErrMissing) {
		return fmt.Errorf("%w; create it with `%s` as a user with configure permission (topology mode %s declares nothing)",
			err, ApplyCommand(cfg), topology.ModeVerify)
	}
	return err
}

// checkBrokerPassive is the capability check of the verify and none modes: the
// probe redeclares amq.direct, which needs configure permission, so it is skipped. The
// version comes from the server properties; in the verify mode, the delayed-exchange
// backend's own exchange, checked passively, stands in for the plugin probe (it can
// only exist where the plugin is enabled). Where nothing tells, the error says so and
// the plugin is reported unknown.
func checkBrokerPassive(cfg Config) (Capabilities, error) {
	conn, err := cfg.Handoff.Connection()
	if err != nil {
		return Capabilities{}, err
	}
	var c Capabilities
	c.Version, _ = conn.Properties["version"].(string)
	mode := cfg.Topology.OrDefault()
	if mode != topology.ModeVerify || cfg.Backend != BackendDelayedExchange {
		return c, fmt.Errorf("not probed in topology mode %s (the probe needs configure permission)", mode)
	}
	ch, err := conn.Channel()
	if err != nil {
		return c, fmt.Errorf("open probe channel: %w", err)
	}
	defer ch.Close() //nolint:errcheck // a failed check has closed it already
	name := names{cfg.Prefix}.delayedExchange()
	if err := ch.ExchangeDeclarePassive(name, topology.ExchangeDelayedMessage, true, false, false, false, nil); err != nil {
		var amqpErr *amqp.Error
		if errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound {
			return c, fmt.Errorf("exchange %q does not exist, so the %s plugin could not be checked without configure permission", name, pluginName)
		}
		return c, fmt.Errorf("check exchange %q: %w", name, err)
	}
	c.DelayedMessagePlugin = true
	return c, nil
}

// VersionWarning returns the capability check's warning about a RabbitMQ version that
// loses retries (3.13.0 to 3.13.2), or "".
func VersionWarning(version string) string { return versionWarning(version) }
