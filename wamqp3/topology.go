package wamqp3

import (
	"github.com/ThreeDotsLabs/watermill"
	amqp091 "github.com/rabbitmq/amqp091-go"

	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
)

// The topology builders' BuildTopology, the one method whose signature the two majors
// do not share (v3's parameters come in amqp.BuildTopologyParams, with the topic): the
// rest of the package, retry.go, is generated into wamqp2 (internal/cmd/majorgen).

func (b builder) BuildTopology(ch *amqp091.Channel, p amqp.BuildTopologyParams, config amqp.Config, logger watermill.LoggerAdapter) error {
	s := subscribed(config, p.QueueName, p.ExchangeName, p.RoutingKey, p.Topic)
	return b.q.BuildTopology(ch, s, func() error { return b.inner.BuildTopology(ch, p, config, logger) })
}

func (b poisonBuilder) BuildTopology(ch *amqp091.Channel, p amqp.BuildTopologyParams, _ amqp.Config, _ watermill.LoggerAdapter) error {
	return b.w.BuildPoisonTopology(ch, p.QueueName)
}
