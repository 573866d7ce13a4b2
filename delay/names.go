package delay

import (
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
)

// names are the exchange and queue names the RabbitMQ backends declare, all under one
// prefix. Backends that share a prefix never declare one name two ways.
type names struct{ prefix string }

// ttl-tiers.
func (n names) delayExchange() string            { return n.prefix + ".delay" }
func (n names) tierQueue(t time.Duration) string { return n.prefix + ".delay." + TierName(t) }
func (n names) deliverExchange() string          { return n.prefix + ".deliver" }

// binary-levels: level l is both a topic exchange and a queue of this name.
func (n names) level(l int) string            { return n.prefix + ".level." + strconv.Itoa(l) }
func (n names) levelsDeliverExchange() string { return n.prefix + ".levels.deliver" }

// delayed-exchange.
func (n names) delayedExchange() string { return n.prefix + ".delayed" }

// parking is shared by every backend with a delivery exchange.
func (n names) parking() string { return n.prefix + ".parking" }

// delivery is the delivery exchange of the given name and kind, with the parking
// exchange and queue as its alternate exchange: a dead letter that matches no binding
// is parked, never stuck at the head of a delay queue (at-least-once dead lettering
// would retry it forever).
func (n names) delivery(exchange, kind string) topology.Topology {
	return topology.Topology{
		Exchanges: []topology.Exchange{
			{Name: n.parking(), Kind: amqp.ExchangeFanout},
			{Name: exchange, Kind: kind, Args: amqp.Table{topology.AlternateExchangeArg: n.parking()}},
		},
		Queues:   []topology.Queue{{Name: n.parking()}},
		Bindings: []topology.Binding{{Exchange: n.parking(), Destination: n.parking()}},
	}
}

// delayQueueArgs are the arguments of a queue that holds messages for ttl and then
// dead-letters them, at least once, to dlx.
func delayQueueArgs(ttl time.Duration, dlx string) amqp.Table {
	return amqp.Table{
		topology.QueueTypeArg:          topology.QueueTypeQuorum,
		topology.MessageTTLArg:         ttl.Milliseconds(),
		topology.DeadLetterExchangeArg: dlx,
		topology.DeadLetterStrategyArg: topology.DeadLetterAtLeastOnce,
		topology.OverflowArg:           topology.OverflowRejectPublish,
	}
}
