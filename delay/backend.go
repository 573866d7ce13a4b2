package delay

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// backends is the parse table, the default first: adding a backend is a file of its
// own in this package (a value type implementing Backend) and its line here.
var backends = []Backend{
	TTLTiers{},
	BinaryLevels{},
	DelayedExchange{},
	DelayedRetry{},
	DeliveryTime{},
	Memory{},
}

// maxTTL is the longest TTL RabbitMQ accepts (315,360,000,000 ms, ten years).
const maxTTL = 315_360_000_000 * time.Millisecond

var errDetached = errors.New("backend built for planning cannot park messages")

// Open validates b's settings and s.Prefix and opens b, parking through s.Env (without
// a hand-off it only plans and sizes). Errors name the configuration field at fault.
func Open(b Backend, s backend.Setup) (backend.Backend, error) {
	if b == nil {
		return nil, errors.New("Backend: nil; leave it nil in amqpretry.Config for the default, or use delay.Parse")
	}
	if s.Env.Logger == nil {
		s.Env.Logger = watermill.NopLogger{}
	}
	if strings.ContainsAny(s.Prefix, "*# ") {
		return nil, fmt.Errorf("Prefix: %q must not contain '*', '#' or spaces", s.Prefix)
	}
	opened, err := b.Open(s)
	if err != nil {
		return nil, err
	}
	for _, name := range allNames(opened.Topology()) {
		if len(name) > names.MaxBytes {
			return nil, fmt.Errorf("Prefix: makes the name %q %d bytes long, over AMQP's %d", name, len(name), names.MaxBytes)
		}
	}
	return opened, nil
}

// Dial connects a hand-off to the broker and opens its confirm channel.
func Dial(cfg backend.HandoffConfig) (backend.Handoff, error) {
	p, err := dial(cfg)
	if err != nil {
		return nil, err // a nil interface, not a nil *publisher
	}
	return p, nil
}

func allNames(t topology.Topology) []string {
	var out []string
	for _, e := range t.Exchanges {
		out = append(out, e.Name)
	}
	for _, q := range t.Queues {
		out = append(out, q.Name)
	}
	return out
}

func validateTiers(tiers []time.Duration) error {
	if len(tiers) == 0 {
		return errors.New("Tiers: empty; leave it nil for the default ladder")
	}
	for i, t := range tiers {
		switch {
		case t < time.Millisecond || t > maxTTL:
			return fmt.Errorf("Tiers[%d]: %s is outside 1ms to %s", i, t, maxTTL)
		case t%time.Millisecond != 0:
			return fmt.Errorf("Tiers[%d]: %s is not a whole number of milliseconds", i, t)
		case slices.Contains(tiers[:i], t):
			return fmt.Errorf("Tiers[%d]: %s appears twice", i, t)
		}
	}
	return nil
}

// delivery is a delivery exchange of the given name and kind, with the parking
// exchange and queue as its alternate exchange: a dead letter that matches no binding
// is parked, never stuck at the head of a delay queue (at-least-once dead lettering
// would retry it forever).
func delivery(n names.Names, exchange, kind string) topology.Topology {
	return topology.Topology{
		Exchanges: []topology.Exchange{
			{Name: n.Parking(), Kind: "fanout"},
			{Name: exchange, Kind: kind, Args: map[string]interface{}{declare.AlternateExchangeArg: n.Parking()}},
		},
		Queues:   []topology.Queue{declare.ReviewQueue(n.Parking(), "parking")},
		Bindings: []topology.Binding{{Exchange: n.Parking(), Destination: n.Parking()}},
	}
}

// delayQueueArgs are the arguments of a queue that keeps messages for ttl and then
// dead-letters them, at least once, to dlx.
func delayQueueArgs(ttl time.Duration, dlx string) map[string]interface{} {
	return map[string]interface{}{
		declare.QueueTypeArg:          declare.QueueTypeQuorum,
		declare.MessageTTLArg:         ttl.Milliseconds(),
		declare.DeadLetterExchangeArg: dlx,
		declare.DeadLetterStrategyArg: declare.DeadLetterAtLeastOnce,
		declare.OverflowArg:           declare.OverflowRejectPublish,
	}
}

// wholeMillis rounds d up to whole milliseconds, at least 1 ms: the precision of the
// backends that take a delay in milliseconds.
func wholeMillis(d time.Duration) time.Duration {
	ms := d / time.Millisecond
	if d%time.Millisecond > 0 {
		ms++
	}
	return max(ms, 1) * time.Millisecond
}
