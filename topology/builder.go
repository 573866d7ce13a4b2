package topology

import (
	"errors"
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
	// Mode: ModeDeclare (default) runs Inner, then declares Binder's declarations.
	// ModeVerify declares no queue or exchange: it checks passively the subscriber's
	// queue (and exchange, if any) with the settings of the watermill-amqp config, binds
	// the queue to the exchange as amqp.DefaultTopologyBuilder would, and verifies
	// Binder's declarations (Verify); Inner is not run. ModeNone does nothing at all,
	// Inner included. A missing object fails with an error wrapping ErrMissing that
	// names it and, when Binder implements ApplyCommander, the command that creates it.
	Mode Mode
}

// ApplyCommander is implemented by a WorkQueueBinder that can tell the command creating
// what a work queue needs (for example `amqpretry topology apply --prefix p --queue q`).
// Builder and the verify mode quote it in their errors.
type ApplyCommander interface {
	ApplyCommand(queues ...string) string
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
	switch b.Mode.OrDefault() {
	case ModeNone:
		return nil
	case ModeVerify:
		return b.verify(ch, queueName, exchangeName, config, logger)
	case ModeDeclare:
	default:
		return fmt.Errorf("topology builder for queue %q: %w", queueName, b.Mode.Validate())
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
// In ModeVerify it checks the exchange passively, in ModeNone it does nothing.
func (b Builder) ExchangeDeclare(ch *amqp.Channel, exchangeName string, config wamqp.Config) error {
	switch b.Mode.OrDefault() {
	case ModeNone:
		return nil
	case ModeVerify:
		e := config.Exchange
		if err := ch.ExchangeDeclarePassive(exchangeName, e.Type, e.Durable, e.AutoDeleted, e.Internal, e.NoWait, e.Arguments); err != nil {
			return b.hint(checkError("exchange", exchangeName, err), "")
		}
		return nil
	}
	return b.inner().ExchangeDeclare(ch, exchangeName, config)
}

// verify is BuildTopology in ModeVerify.
func (b Builder) verify(ch *amqp.Channel, queueName, exchangeName string, config wamqp.Config, logger watermill.LoggerAdapter) error {
	q := config.Queue
	if _, err := ch.QueueDeclarePassive(queueName, q.Durable, q.AutoDelete, q.Exclusive, q.NoWait, q.Arguments); err != nil {
		return b.hint(checkError("queue", queueName, err), queueName)
	}
	if exchangeName != "" {
		if err := b.ExchangeDeclare(ch, exchangeName, config); err != nil {
			return err
		}
		key := ""
		if config.QueueBind.GenerateRoutingKey != nil {
			key = config.QueueBind.GenerateRoutingKey(queueName)
		}
		if err := ch.QueueBind(queueName, key, exchangeName, config.QueueBind.NoWait, config.QueueBind.Arguments); err != nil {
			return b.hint(bindError(Binding{Exchange: exchangeName, Destination: queueName, Key: key}, err), queueName)
		}
	}
	if err := Verify(ch, b.Binder.WorkQueue(queueName)); err != nil {
		return b.hint(fmt.Errorf("retry topology for queue %q: %w", queueName, err), queueName)
	}
	logger.Debug("Retry topology verified", watermill.LogFields{"amqp_queue_name": queueName})
	return nil
}

// hint adds to an ErrMissing error the command that creates what is missing.
func (b Builder) hint(err error, queue string) error {
	if !errors.Is(err, ErrMissing) {
		return err
	}
	cmd := "amqpretry topology apply"
	if c, ok := b.Binder.(ApplyCommander); ok {
		if queue == "" {
			cmd = c.ApplyCommand()
		} else {
			cmd = c.ApplyCommand(queue)
		}
	}
	return fmt.Errorf("%w; create it with `%s` (topology mode %s declares nothing)", err, cmd, ModeVerify)
}
