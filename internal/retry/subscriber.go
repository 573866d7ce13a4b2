package retry

import (
	"crypto/tls"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/marshal"
)

// Sub is what a transport package reads from its watermill-amqp subscriber config.
type Sub struct {
	URI             string
	AMQP            *amqp.Config
	TLS             *tls.Config
	QueueName       func(topic string) string
	NoRequeueOnNack bool
	QueueArgs       amqp.Table
	// Marshal holds the options of the subscriber's marshaler, nil when it is of a
	// type the retry cannot use (MarshalerType names it).
	Marshal       *marshal.Options
	MarshalerType string
}

// New validates sub and cfg, every invalid field named, and only then starts a Retry.
func New(sub Sub, cfg amqpretry.Config) (*Retry, error) {
	withDefaults := cfg.WithDefaults()
	// Validate reads the policy as given (an explicit value is checked apart from its
	// default), so it takes cfg itself.
	if err := errors.Join(sub.validate(withDefaults), cfg.Validate()); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	cfg = withDefaults
	conn := Conn{URI: sub.URI, QueueArgs: sub.QueueArgs, Queue: sub.QueueName}
	if sub.Marshal != nil {
		conn.Marshal = *sub.Marshal
	}
	switch {
	case sub.AMQP != nil:
		conn.AMQP = *sub.AMQP
	default:
		conn.AMQP = amqp.Config{TLSClientConfig: sub.TLS, Heartbeat: 10 * time.Second}
	}
	return Start(cfg, conn)
}

// validate reports every invalid field of sub, for cfg (with defaults).
func (sub Sub) validate(cfg amqpretry.Config) error {
	if sub.URI == "" {
		if cfg.Backend != delay.Memory {
			return fmt.Errorf("Subscriber: Connection.AmqpURI: required for the %s backend", cfg.Backend)
		}
		return nil
	}
	var errs []error
	if cfg.Backend == delay.DeliveryTime {
		errs = append(errs, fmt.Errorf("Backend: %s is %w on the AMQP 0-9-1 transport (watermill-amqp): it settles a failed delivery with an AMQP 1.0 outcome; use the AMQP 1.0 transport, package github.com/amqpretry/amqpretry/amqp1, or another Backend (%s, %s, %s)",
			cfg.Backend, delay.ErrUnsupported, delay.TTLTiers, delay.BinaryLevels, delay.DelayedRetry))
	}
	if sub.QueueName == nil {
		errs = append(errs, errors.New("Subscriber: Queue.GenerateName: required"))
	}
	if sub.NoRequeueOnNack {
		errs = append(errs, errors.New("Subscriber: Consume.NoRequeueOnNack: must be false, or a failed hand-off would drop the message instead of requeueing it"))
	}
	if sub.Marshal == nil {
		errs = append(errs, fmt.Errorf("Subscriber: Marshaler: %s cannot read dead-lettered messages; use the DefaultMarshaler or xdeath.Marshaler", sub.MarshalerType))
	}
	if backend.HoldsRetries(cfg.Backend, cfg.HeldRetries) {
		if t, ok := sub.QueueArgs[declare.QueueTypeArg]; ok && t != declare.QueueTypeQuorum {
			errs = append(errs, fmt.Errorf("Subscriber: Queue.Arguments: %s %v: delayed retries need quorum work queues", declare.QueueTypeArg, t))
		}
	}
	return errors.Join(errs...)
}
