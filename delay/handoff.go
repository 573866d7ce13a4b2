package delay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
)

var (
	// ErrNotConfirmed: the broker nacked the publish, or its channel or connection
	// closed before the confirm arrived, so it is unknown whether the broker has it.
	ErrNotConfirmed = errors.New("publish not confirmed by the broker")
	// ErrReturned: the broker returned the mandatory publish as unroutable.
	ErrReturned = errors.New("publish returned unroutable")
)

// DefaultConfirmTimeout bounds the wait for a publisher confirm.
const DefaultConfirmTimeout = 10 * time.Second

// HandoffConfig configures Dial.
type HandoffConfig struct {
	// URI of the broker, amqp:// or amqps://. Required. It never appears in errors or
	// logs with its password.
	URI string
	// AMQP is passed to amqp091-go's DialConfig (TLS, heartbeat, properties).
	// Default: amqp091-go's defaults.
	AMQP amqp.Config
	// ConfirmTimeout bounds the wait for each publisher confirm. Default: 10s.
	ConfirmTimeout time.Duration
	// Marshaler turns a Watermill message into a publishing. It must never send back
	// broker-owned headers. Default: xdeath.Marshaler{}.
	Marshaler wamqp.Marshaler
	// Logger. Default: watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Handoff is the one way this library moves a message into RabbitMQ. Every publish is
// persistent, mandatory, carries a fresh MessageId and no expiration, goes out on a
// channel of its own connection (never the consuming one) in confirm mode, and returns
// only when the broker has confirmed it and not returned it. Only then may the caller
// ack the original. (The delayed-exchange backend alone publishes non-mandatory, since
// the plugin returns every mandatory publish; it proves routability by binding first.)
// Handoff is safe for concurrent use: concurrent publishes share one channel with
// deferred confirmations. After a channel or connection failure the next publish opens
// a new one.
type Handoff struct {
	cfg HandoffConfig

	mu   sync.Mutex // guards conn and pc
	conn *amqp.Connection
	pc   *pubChannel
}

// pubChannel is one confirm-mode channel and the returns it has seen.
type pubChannel struct {
	ch      *amqp.Channel
	returns chan amqp.Return

	mu       sync.Mutex
	returned map[string]amqp.Return // by MessageId
}

// returnsBuffer must exceed the publishes that can be in flight between two drains;
// amqp091-go blocks its reader on a full return listener.
const returnsBuffer = 4096

// Dial connects to the broker and opens the confirm channel.
func Dial(cfg HandoffConfig) (*Handoff, error) {
	if cfg.URI == "" {
		return nil, errors.New("invalid config: URI: required")
	}
	if cfg.ConfirmTimeout <= 0 {
		cfg.ConfirmTimeout = DefaultConfirmTimeout
	}
	if cfg.Marshaler == nil {
		cfg.Marshaler = xdeath.Marshaler{}
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if cfg.AMQP.Locale == "" {
		cfg.AMQP.Locale = "en_US"
	}
	h := &Handoff{cfg: cfg}
	if _, err := h.channel(); err != nil {
		return nil, err
	}
	return h, nil
}

// channel returns the open confirm channel, reconnecting when it or its connection
// has closed.
func (h *Handoff) channel() (*pubChannel, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.pc != nil && !h.pc.ch.IsClosed() {
		return h.pc, nil
	}
	if h.conn == nil || h.conn.IsClosed() {
		conn, err := h.dial()
		if err != nil {
			return nil, err
		}
		h.conn = conn
		h.cfg.Logger.Debug("Hand-off connection opened", watermill.LogFields{"amqp_uri": Redact(h.cfg.URI)})
	}
	ch, err := h.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open hand-off channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("put hand-off channel in confirm mode: %w", err)
	}
	h.pc = &pubChannel{
		ch:       ch,
		returns:  ch.NotifyReturn(make(chan amqp.Return, returnsBuffer)),
		returned: map[string]amqp.Return{},
	}
	return h.pc, nil
}

// dial opens a new connection to the broker.
func (h *Handoff) dial() (*amqp.Connection, error) {
	conn, err := amqp.DialConfig(h.cfg.URI, h.cfg.AMQP)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", Redact(h.cfg.URI), redactErr(err))
	}
	return conn, nil
}

// Connection returns the hand-off connection (for example to read the broker's server
// properties), reconnecting if needed.
func (h *Handoff) Connection() (*amqp.Connection, error) {
	if _, err := h.channel(); err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.conn, nil
}

// Declare declares t on a short-lived channel of the hand-off connection.
func (h *Handoff) Declare(t topology.Topology) error {
	conn, err := h.Connection()
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open declare channel: %w", err)
	}
	defer ch.Close() //nolint:errcheck // a failed declare has closed it already
	return topology.Declare(ch, t)
}

// PublishMessage marshals msg (without mutating it), adds headers, and publishes it to
// exchange with routing key key as Publish does.
func (h *Handoff) PublishMessage(ctx context.Context, exchange, key string, msg *message.Message, headers amqp.Table) error {
	return h.publishMessage(ctx, exchange, key, msg, headers, true)
}

func (h *Handoff) publishMessage(ctx context.Context, exchange, key string, msg *message.Message, headers amqp.Table, mandatory bool) error {
	p, err := h.cfg.Marshaler.Marshal(msg)
	if err != nil {
		return fmt.Errorf("marshal message %s: %w", msg.UUID, err)
	}
	if len(headers) > 0 {
		p.Headers = maps.Clone(p.Headers)
		if p.Headers == nil {
			p.Headers = amqp.Table{}
		}
		maps.Copy(p.Headers, headers)
	}
	return h.publish(ctx, exchange, key, p, mandatory)
}

// Publish publishes p to exchange with routing key key and waits for the broker's
// confirm. It returns nil only if the broker confirmed the message and did not return it.
func (h *Handoff) Publish(ctx context.Context, exchange, key string, p amqp.Publishing) error {
	return h.publish(ctx, exchange, key, p, true)
}

// publish is Publish with the mandatory flag as a parameter. Non-mandatory, a publish
// that no queue takes is confirmed as well: the caller must know it is routable.
func (h *Handoff) publish(ctx context.Context, exchange, key string, p amqp.Publishing, mandatory bool) error {
	p.DeliveryMode = amqp.Persistent
	p.Expiration = ""
	p.MessageId = watermill.NewULID()

	pc, err := h.channel()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, h.cfg.ConfirmTimeout)
	defer cancel()

	dc, err := pc.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, mandatory, false, p)
	if err != nil {
		return fmt.Errorf("publish to exchange %q with key %q: %w", exchange, key, err)
	}
	ok, err := dc.WaitContext(ctx)
	// The broker sends basic.return before the ack, and amqp091-go hands the return to
	// our buffered listener before it processes the ack, so it is in the buffer now.
	ret, returned := pc.takeReturn(p.MessageId)
	switch {
	case err != nil:
		return fmt.Errorf("publish to exchange %q with key %q: %w: %w", exchange, key, ErrNotConfirmed, err)
	case !ok:
		return fmt.Errorf("publish to exchange %q with key %q: %w", exchange, key, ErrNotConfirmed)
	case returned:
		return fmt.Errorf("publish to exchange %q with key %q: %w: %d %s", exchange, key, ErrReturned, ret.ReplyCode, ret.ReplyText)
	}
	return nil
}

// takeReturn moves every buffered return into the map and takes the one for id.
func (pc *pubChannel) takeReturn(id string) (amqp.Return, bool) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	for drained := false; !drained; {
		select {
		case r, open := <-pc.returns:
			if open {
				pc.returned[r.MessageId] = r
			}
			drained = !open
		default:
			drained = true
		}
	}
	r, ok := pc.returned[id]
	delete(pc.returned, id)
	return r, ok
}

// Close closes the hand-off connection.
func (h *Handoff) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.conn == nil || h.conn.IsClosed() {
		return nil
	}
	return h.conn.Close()
}

// QueuePublisher returns a message.Publisher that hands each message to the queue named
// by the topic, through the default exchange. The poison queue is fed this way.
func (h *Handoff) QueuePublisher() message.Publisher {
	return queuePublisher{h}
}

type queuePublisher struct{ h *Handoff }

func (q queuePublisher) Publish(queue string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		if err := q.h.PublishMessage(msg.Context(), "", queue, msg, nil); err != nil {
			return err
		}
	}
	return nil
}

func (q queuePublisher) Close() error { return nil }

// Redact returns uri with its password replaced by "xxxxx".
func Redact(uri string) string {
	u, err := url.Parse(uri)
	if err != nil {
		return "(unparseable amqp uri)"
	}
	return u.Redacted()
}

// redactErr keeps a URI parse error from carrying the password.
func redactErr(err error) error {
	var uerr *url.Error
	if errors.As(err, &uerr) {
		return fmt.Errorf("%s: %w", uerr.Op, uerr.Err)
	}
	return err
}
