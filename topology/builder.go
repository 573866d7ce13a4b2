package topology

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"
)

// WorkQueueBinder tells what a work queue needs so that retries can find their way back
// to it: typically a binding of the queue to the delay backend's delivery exchange.
// Every delay backend implements it.
type WorkQueueBinder interface {
	WorkQueue(queue string) Topology
}

// Builder is a watermill-amqp TopologyBuilder. It declares the subscriber's queue and
// exchange as Inner does, then the declarations Binder asks for that queue. The
// watermill-amqp Subscriber runs it on Subscribe and again after every reconnect, so the
// bindings come back if someone deletes them.
type Builder struct {
	// Inner declares the user's own queue, exchange and binding.
	// Default: &amqp.DefaultTopologyBuilder{}.
	Inner wamqp.TopologyBuilder
	// Binder gives the declarations each work queue needs. Required.
	Binder WorkQueueBinder
}

var _ wamqp.TopologyBuilder = Builder{}

func (b Builder) inner() wamqp.TopologyBuilder {
	if b.Inner == nil {
		return &wamqp.DefaultTopologyBuilder{}
	}
	return b.Inner
}

// BuildTopology implements amqp.TopologyBuilder.
func (b Builder) BuildTopology(ch *amqp.Channel, queueName, exchangeName string, config wamqp.Config, logger watermill.LoggerAdapter) error {
	if b.Binder == nil {
		return fmt.Errorf("topology builder for queue %q: no Binder set", queueName)
	}
	if err := b.inner().BuildTopology(ch, queueName, exchangeName, config, logger); err != nil {
		return err
	}
	if err := Declare(ch, b.Binder.WorkQueue(queueName)); err != nil {
		return fmt.Errorf("retry topology for queue %q: %w", queueName, err)
	}
	logger.Debug("Retry bindings declared", watermill.LogFields{"amqp_queue_name": queueName})
	return nil
}

// ExchangeDeclare implements amqp.TopologyBuilder by delegating to Inner.
func (b Builder) ExchangeDeclare(ch *amqp.Channel, exchangeName string, config wamqp.Config) error {
	return b.inner().ExchangeDeclare(ch, exchangeName, config)
}
