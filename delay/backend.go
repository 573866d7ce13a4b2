package delay

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// backends is the parse table, the default first: adding a backend is a file of its
// own in this package (an unexported value type embedding lib, and its constructor)
// and its line here.
var backends = []Backend{
	ttlTiersValue{},
	binaryLevelsValue{},
	delayedExchangeValue{},
	delayedRetryValue{},
	deliveryTimeValue{},
	memoryValue{},
}

// lib is embedded in every backend value: it seals Backend (isBackend), and lists the
// backends for the library (backend.Opener's Backends).
type lib struct{}

func (lib) isBackend() {}

// Backends lists every backend, each with its defaults, the default first.
func (lib) Backends() []backend.Opener {
	out := make([]backend.Opener, len(backends))
	for i, b := range backends {
		out[i] = b.(backend.Opener)
	}
	return out
}

// names lists the names of the backends, the default first: what Parse takes.
func knownNames() []string {
	out := make([]string, len(backends))
	for i, b := range backends {
		out[i] = b.Name()
	}
	return out
}

// maxTTL is the longest TTL RabbitMQ accepts (315,360,000,000 ms, ten years).
const maxTTL = 315_360_000_000 * time.Millisecond

var errDetached = errors.New("backend built for planning cannot park messages")

func validateTiers(tiers []time.Duration) error {
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

// Every value opens, through backend.Open; HeldRetries also fronts its backend.
var (
	_ backend.Opener  = ttlTiersValue{}
	_ backend.Opener  = binaryLevelsValue{}
	_ backend.Opener  = delayedExchangeValue{}
	_ backend.Opener  = delayedRetryValue{}
	_ backend.Opener  = deliveryTimeValue{}
	_ backend.Opener  = memoryValue{}
	_ backend.Opener  = heldRetriesValue{}
	_ backend.Fronted = heldRetriesValue{}
	_ backend.AMQP1   = deliveryTime{}
)
