package ops

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/derived"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/redact"
	"github.com/amqpretry/amqpretry/topology"
)

// Config configures New.
type Config struct {
	// URI of the broker, amqp:// or amqps://. Required. It never appears in results
	// or errors with its password.
	URI string
	// AMQP is passed to amqp091-go's DialConfig (TLS, heartbeat). Default:
	// amqp091-go's.
	AMQP amqp.Config
	// Retry is the application's retry configuration, its defaults from
	// Retry.WithDefaults(). Only what names and shapes the broker side counts: Backend
	// (with its settings, held retries included), Prefix, PoisonQueue, and
	// nothing else. Policy, Classify, Topology and the
	// rest are not used (a policy the backend cannot keep is the application's error,
	// not the topology's). The memory backend has nothing on the broker and is
	// refused.
	Retry amqpretry.Config
	// Logger. Default: watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// Rabbitmqctl, if set, runs rabbitmqctl with args against the broker at URI (the
	// same node: the caller checks) and returns its output. The waiting retries
	// (Source Waiting) are read through it, with rabbitmqctl eval (admin rights), the
	// only way to read them without changing them; it also finds the delay queues left
	// under the prefix by another backend, and runs RabbitMQ 4.3's retry now.
	Rabbitmqctl func(ctx context.Context, args ...string) ([]byte, error)
}

// Ops runs the operations on one broker: status, topology, the poison and parking
// queues. It has two connections: one to read (basic.get, passive declarations) and
// the library's confirmed hand-off to publish, so that a failed publish never closes
// the channel with the messages read. Call its methods one at a time; Close it when
// done.
type Ops struct {
	uri     string
	retry   amqpretry.Config // defaults applied; see topologyConfig
	backend backend.Backend
	names   names.Names
	// holds: the work queues hold retries (the Config's work queue arguments).
	holds   bool
	parking bool // the backend has a parking queue
	handoff backend.Handoff
	conn    *amqp.Connection
	ctl     func(ctx context.Context, args ...string) ([]byte, error) // Config.Rabbitmqctl
	vhost   string
}

// Source names the queue List, Redrive and Purge work on.
type Source string

// Values of Source.
const (
	// Poison is the poison queue (Config.Retry.PoisonQueue): messages that failed for
	// good, with their failure envelope.
	Poison Source = "poison"
	// Parking is the parking queue (<prefix>.parking) of the backends with a delivery
	// exchange (ttl-tiers, binary-levels): retries whose work queue was gone when they
	// came due. HasParking tells whether a Config's backend has one.
	Parking Source = "parking"
)

// New validates cfg, touching nothing on the broker when it is invalid, then connects.
func New(cfg Config) (*Ops, error) {
	retry, err := topologyConfig(cfg.Retry)
	if err != nil {
		return nil, err
	}
	if cfg.URI == "" {
		return nil, errors.New("invalid config: URI: required")
	}
	v := derived.Of(retry)
	if v.Err != nil {
		return nil, fmt.Errorf("invalid config: %w", v.Err)
	}
	b := v.Backend
	o := &Ops{uri: cfg.URI, retry: retry, backend: b, names: names.Names{Prefix: retry.Prefix}, ctl: cfg.Rabbitmqctl, vhost: "/"}
	if u, err := amqp.ParseURI(cfg.URI); err == nil {
		o.vhost = u.Vhost
	}
	o.holds = v.WorkQueueArgs != nil
	o.parking = hasParking(b, o.names)
	h, err := handoff.Dial(backend.HandoffConfig{
		URI: cfg.URI, AMQP: cfg.AMQP, ConfirmTimeout: backend.DefaultConfirmTimeout,
		// A redrive never declares: a message whose queue is gone stays where it is.
		Topology: topology.ModeNone, Logger: cfg.Logger,
	})
	if err != nil {
		return nil, o.redact(err)
	}
	conn, err := backend.DialConn(cfg.URI, cfg.AMQP)
	if err != nil {
		_ = h.Close()
		return nil, o.redact(err)
	}
	o.handoff, o.conn = h, conn
	return o, nil
}

// topologyConfig returns r with its defaults, validated for what ops uses: the fields
// that decide the topology (Config.Plan checks those, not the policy).
func topologyConfig(r amqpretry.Config) (amqpretry.Config, error) {
	r = r.WithDefaults()
	if v := derived.Of(r); v.InProcess {
		return r, fmt.Errorf("invalid config: Retry.Backend: the %s backend has nothing on the broker (it keeps its retries in the application's process)", v.Name)
	}
	if _, err := r.Plan(); err != nil {
		return r, err
	}
	return r, nil
}

// HasParking tells whether the backend retry names (with retry's defaults) has a
// parking queue, the Source Parking, where a retry whose work queue is gone when it
// comes due waits: a backend whose retries come due through a delivery exchange
// (ttl-tiers, binary-levels). False for a Config naming no valid backend. It touches no broker: a
// caller that shows the parking queue asks this before it connects, and gets the
// answer New gets.
func HasParking(retry amqpretry.Config) bool {
	retry = retry.WithDefaults()
	v := derived.Of(retry)
	if v.Err != nil {
		return false
	}
	return hasParking(v.Backend, names.Names{Prefix: retry.Prefix})
}

// HasPluginWaiting tells whether the backend retry names (with retry's defaults) keeps
// its waiting retries where only its plugin counts them (delayed-exchange's
// delayed-message plugin): List, Redrive and Purge of Waiting then refuse
// (ErrPluginWaiting), and Status counts them (Status.PluginWaiting). False for a
// Config naming no valid backend. It touches no broker: a caller that needs
// rabbitmqctl for the other backends' waiting retries asks this before it connects,
// and gets the answer New's Ops gets.
func HasPluginWaiting(retry amqpretry.Config) bool {
	v := derived.Of(retry)
	if v.Err != nil {
		return false
	}
	_, ok := v.Backend.(backend.Sealed)
	return ok
}

// BehindQueues is the name pattern of the queues where the later messages of a blocked
// order key wait (amqpretry.Config.OrderKey), "<prefix>.behind.*", for a caller that
// looks for them among queue names before it asks for Blocked. It touches no broker.
func BehindQueues(retry amqpretry.Config) string {
	return names.Names{Prefix: retry.WithDefaults().Prefix}.BehindQueues()
}

// hasParking tells whether b declares the parking queue under n: ops's one answer to
// HasParking.
func hasParking(b backend.Backend, n names.Names) bool {
	return slices.ContainsFunc(b.Topology().Queues, func(q topology.Queue) bool { return q.Name == n.Parking() })
}

// holdsRetries tells whether the work queues hold retries (RabbitMQ 4.3's delayed
// retry: the delayed-retry backend, or delay.HeldRetries), and so must be quorum queues, and
// retries may wait in them: ops's one answer to that.
func (o *Ops) holdsRetries() bool { return o.holds }

// Close closes both connections.
func (o *Ops) Close() error {
	return o.redact(errors.Join(o.conn.Close(), o.handoff.Close()))
}

// redact keeps the URI's password out of err.
func (o *Ops) redact(err error) error {
	return redact.Error(err, o.uri, amqp.ErrCredentials, amqp.ErrSASL, amqp.ErrVhost, amqp.ErrSyntax, amqp.ErrClosed, topology.ErrMissing, topology.ErrMismatch)
}

// queue returns the name of the queue s names.
func (o *Ops) queue(s Source) (string, error) {
	switch s {
	case Poison:
		return o.retry.PoisonQueue, nil
	case Parking:
		if !o.parking {
			return "", fmt.Errorf("the %s backend has no parking queue", o.retry.Backend)
		}
		return o.names.Parking(), nil
	}
	return "", fmt.Errorf("unknown source %q (known: %s, %s)", s, Poison, Parking)
}

// channel opens a channel on the reading connection.
func (o *Ops) channel() (*amqp.Channel, error) {
	ch, err := o.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", o.redact(err))
	}
	return ch, nil
}

// inspect declares queue passively: its ready messages and consumers, or exists=false.
func (o *Ops) inspect(queue string) (q amqp.Queue, exists bool, err error) {
	ch, err := o.channel()
	if err != nil {
		return q, false, err
	}
	defer ch.Close() //nolint:errcheck // closed by the broker on 404
	q, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	switch {
	case err == nil:
		return q, true, nil
	case amqperr.IsCode(err, amqp.NotFound):
		return q, false, nil
	}
	return q, false, fmt.Errorf("queue %q: %w", queue, o.redact(err))
}

// exchangeExists declares exchange passively.
func (o *Ops) exchangeExists(exchange, kind string) (bool, error) {
	ch, err := o.channel()
	if err != nil {
		return false, err
	}
	defer ch.Close() //nolint:errcheck // closed by the broker on 404
	err = ch.ExchangeDeclarePassive(exchange, kind, true, false, false, false, nil)
	switch {
	case err == nil:
		return true, nil
	case amqperr.IsCode(err, amqp.NotFound):
		return false, nil
	}
	return false, fmt.Errorf("exchange %q: %w", exchange, o.redact(err))
}
