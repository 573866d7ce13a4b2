package amqp1

import (
	"crypto/tls"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/amqpretry/amqpretry/middleware"
)

// Defaults of the config fields left zero.
const (
	defaultPublishTimeout           = 30 * time.Second
	defaultCredit                   = 1
	defaultCloseTimeout             = 30 * time.Second
	defaultReconnectInitialInterval = 100 * time.Millisecond
	defaultReconnectMaxInterval     = 10 * time.Second
	defaultQueueType                = "quorum"
)

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// URI of the broker: amqp://user:password@host:port/vhost, or amqps://... The
	// vhost is the path, percent-encoded; none (or "/") is the default vhost "/". The
	// port defaults to 5672 (amqps: 5671), where RabbitMQ 4 serves AMQP 1.0 beside
	// 0-9-1. Without user information the connection authenticates with SASL
	// ANONYMOUS. The password never appears in logs or errors. Required.
	//
	// The query parameters of amqp091-go's URIs work here too, so one URI serves both
	// transports: cacertfile, certfile, keyfile (PEM files) and server_name_indication
	// when TLSConfig is nil, and auth_mechanism=external (SASL EXTERNAL: the broker
	// logs the client certificate in; rabbitmq_auth_mechanism_ssl), e.g.
	// amqps://broker:5671/?cacertfile=/etc/ssl/ca.pem&certfile=c.pem&keyfile=c.key&auth_mechanism=external
	URI string

	// TLSConfig is used for amqps URIs. Default: the system's roots (or the URI's
	// cacertfile), TLS 1.2 or later, and the URI's host as the server name.
	TLSConfig *tls.Config

	// ContainerID is the AMQP container-id the connection opens with, which RabbitMQ
	// shows for it (rabbitmqctl list_connections container_id). Default:
	// "watermill-amqp1-" and random hex.
	ContainerID string

	// Address maps a topic to the address messages are sent to. Default:
	// QueueAddress(topic), the queue named after the topic. ExchangeAddress builds
	// exchange addresses. The Publisher declares nothing: publishing to a queue that
	// does not exist fails (the broker refuses the link, amqp:not-found).
	Address func(topic string) string

	// PublishTimeout bounds, for each message, the wait for a connection and link and
	// for the broker's outcome; the message's context bounds it too. Default: 30s.
	PublishTimeout time.Duration
}

func (c *PublisherConfig) setDefaults() {
	if c.Address == nil {
		c.Address = QueueAddress
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = defaultPublishTimeout
	}
}

// Validate reports the first thing wrong with the config, after defaults.
func (c PublisherConfig) Validate() error {
	c.setDefaults()
	if _, err := parseURI(c.URI, c.TLSConfig); err != nil {
		return fmt.Errorf("amqp1: PublisherConfig.URI: %w", err)
	}
	if c.PublishTimeout < 0 {
		return errors.New("amqp1: PublisherConfig.PublishTimeout must not be negative")
	}
	return nil
}

// SubscriberConfig configures a Subscriber.
type SubscriberConfig struct {
	// URI of the broker, as in PublisherConfig. Required.
	URI string

	// TLSConfig is used for amqps URIs, as in PublisherConfig.
	TLSConfig *tls.Config

	// ContainerID, as in PublisherConfig.
	ContainerID string

	// QueueName maps a topic to the queue consumed. Default: the topic itself.
	QueueName func(topic string) string

	// Queue says whether and how Subscribe and SubscribeInitialize declare the queue.
	Queue QueueConfig

	// Credit is the AMQP link credit: how many messages the broker may send ahead of
	// their settlement (watermill-amqp's prefetch count). Messages are still handed
	// out one at a time per Subscribe call; a higher credit saves the round trip
	// between one message's settlement and the next delivery, at the cost of messages
	// kept by this subscriber while others could take them. Messages kept but not yet
	// handed out are returned when the link closes, without counting as a failed
	// delivery. Default: 1.
	Credit int

	// CloseTimeout bounds how long Close, or the end of a Subscribe context, waits
	// for the messages already handed out to be acked or nacked. A message neither
	// acked nor nacked by then returns to the queue when the link closes. Default: 30s.
	CloseTimeout time.Duration

	// ReconnectInitialInterval and ReconnectMaxInterval bound the pause between
	// attempts to attach again after the link or the connection was lost: it starts
	// at the first, doubles up to the second, with 20% jitter, and starts over once
	// attached. Defaults: 100ms and 10s.
	ReconnectInitialInterval time.Duration
	ReconnectMaxInterval     time.Duration

	// retry, set by Retry.AddHandler, makes the Subscriber present each delivery as
	// the retry middleware reads it (see retryView).
	retry *middleware.Retry
}

// QueueConfig says how the Subscriber declares the queues it consumes. The
// declaration is idempotent, through RabbitMQ 4's management node over AMQP 1.0
// (nothing else to enable): an existing queue of the same type and arguments is used
// as it is, one that differs makes Subscribe fail with the broker's reason.
type QueueConfig struct {
	// NoDeclare leaves declaring to someone else: the queue must exist.
	NoDeclare bool

	// Type is the queue type: "quorum" or "classic". Default: "quorum", the type on
	// which Redeliver's delivery time, its annotations and DeliveryCount work.
	Type string

	// Arguments are further queue arguments (x-delivery-limit, x-dead-letter-exchange,
	// x-delayed-retry-type, ...), as AMQP values (int64 for numbers).
	Arguments map[string]any
}

func (c *SubscriberConfig) setDefaults() {
	if c.QueueName == nil {
		c.QueueName = func(topic string) string { return topic }
	}
	if c.Queue.Type == "" {
		c.Queue.Type = defaultQueueType
	}
	if c.Credit == 0 {
		c.Credit = defaultCredit
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = defaultCloseTimeout
	}
	if c.ReconnectInitialInterval == 0 {
		c.ReconnectInitialInterval = defaultReconnectInitialInterval
	}
	if c.ReconnectMaxInterval == 0 {
		c.ReconnectMaxInterval = defaultReconnectMaxInterval
	}
}

// Validate reports the first thing wrong with the config, after defaults.
func (c SubscriberConfig) Validate() error {
	c.setDefaults()
	if _, err := parseURI(c.URI, c.TLSConfig); err != nil {
		return fmt.Errorf("amqp1: SubscriberConfig.URI: %w", err)
	}
	switch c.Queue.Type {
	case "quorum", "classic":
	default:
		return fmt.Errorf("amqp1: SubscriberConfig.Queue.Type %q is not quorum or classic", c.Queue.Type)
	}
	if _, ok := c.Queue.Arguments[queueTypeArg]; ok {
		return errors.New("amqp1: SubscriberConfig.Queue.Arguments: set the queue type with Queue.Type, not x-queue-type")
	}
	if c.Credit < 1 || c.Credit > math.MaxInt32 {
		return fmt.Errorf("amqp1: SubscriberConfig.Credit %d is not between 1 and %d", c.Credit, math.MaxInt32)
	}
	if c.CloseTimeout < 0 {
		return errors.New("amqp1: SubscriberConfig.CloseTimeout must not be negative")
	}
	if c.ReconnectInitialInterval < 0 || c.ReconnectMaxInterval < c.ReconnectInitialInterval {
		return errors.New("amqp1: SubscriberConfig: need 0 <= ReconnectInitialInterval <= ReconnectMaxInterval")
	}
	return nil
}
