package wamqp2

import (
	"github.com/ThreeDotsLabs/watermill"
	amqp091 "github.com/rabbitmq/amqp091-go"

	amqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
)

// The topology builders' BuildTopology, the one method whose signature the two majors
// do not share (v2 passes the queue and the exchange, not the topic, and leaves the
// routing key to the config): the rest of the package, retry.go, is generated from
// wamqp3's (internal/cmd/majorgen).

func (b builder) BuildTopology(ch *amqp091.Channel, queue, exchange string, config amqp.Config, logger watermill.LoggerAdapter) error {
	key := ""
	if config.QueueBind.GenerateRoutingKey != nil {
		key = config.QueueBind.GenerateRoutingKey(queue)
	}
	s := subscribed(config, queue, exchange, key, "")
	return b.q.BuildTopology(ch, s, func() error { return b.inner.BuildTopology(ch, queue, exchange, config, logger) })
}

func (b poisonBuilder) BuildTopology(ch *amqp091.Channel, queue, _ string, _ amqp.Config, _ watermill.LoggerAdapter) error {
	return b.w.BuildPoisonTopology(ch, queue)
}
