package delay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/redact"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
)

var (
	// ErrNotConfirmed: the broker nacked the publish, or its channel or connection
	// closed before the confirm arrived, so it is unknown whether the broker has it.
	ErrNotConfirmed = errors.New("publish not confirmed by the broker")
	// ErrReturned: the broker returned the mandatory publish as unroutable.
	ErrReturned = errors.New("publish returned unroutable")
	// ErrTooLarge: the message's properties and headers do not fit in one frame of the
	// size the connection negotiated (frame_max, 128 KiB by default). The broker would
	// close the whole connection over it, so it is never sent. Its TooLarge method lets
	// the retry middleware recognise it without importing this package.
	ErrTooLarge error = tooLargeError{}
)

type tooLargeError struct{}

func (tooLargeError) Error() string  { return "message headers larger than the broker's frame_max" }
func (tooLargeError) TooLarge() bool { return true }

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
	// broker-owned headers, and must return a Headers table of its own (the hand-off
	// edits it). Default: xdeath.Marshaler{}.
	Marshaler wamqp.Marshaler
	// Topology says whether a route found gone when publishing (a deleted queue or
	// exchange of the library's) is declared again, once: only in topology.ModeDeclare.
	// Default: topology.ModeDeclare.
	Topology topology.Mode
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
	ch       *amqp.Channel
	returns  chan amqp.Return
	frameMax int // negotiated; 0 means no limit
	closes   chan *amqp.Error

	mu       sync.Mutex
	returned map[string]amqp.Return // by MessageId
	closeErr *amqp.Error            // why the broker closed ch, once known
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
		frameMax: h.conn.Config.FrameSize,
		closes:   ch.NotifyClose(make(chan *amqp.Error, 1)),
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
	return h.Ensure(topology.ModeDeclare, t)
}

// Ensure applies t on a short-lived channel of the hand-off connection as mode says:
// declares it, verifies it (topology.Verify) or, for topology.ModeNone, does nothing.
func (h *Handoff) Ensure(mode topology.Mode, t topology.Topology) error {
	if mode.OrDefault() == topology.ModeNone {
		return nil
	}
	conn, err := h.Connection()
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open %s channel: %w", mode.OrDefault(), err)
	}
	defer ch.Close() //nolint:errcheck // a failed declare has closed it already
	return topology.Ensure(ch, mode, t)
}

// PublishMessage marshals msg (without mutating it), adds headers, and publishes it to
// exchange with routing key key as Publish does.
func (h *Handoff) PublishMessage(ctx context.Context, exchange, key string, msg *message.Message, headers amqp.Table) error {
	return h.publishMessage(ctx, exchange, key, msg, headers, true)
}

// publishOwned is publishMessage for a route that leads to objects the library
// declares, owned. When the broker answers that the route is gone (the publish is
// returned unroutable, or the exchange does not exist), it declares owned again and
// publishes once more (in topology.ModeDeclare only): a poison queue, tier queue or exchange deleted while the
// application runs comes back at the first message that needs it, instead of every
// message failing and being redelivered. If the declaration fails (for example without
// configure permission), the first error is returned with the declaration's.
func (h *Handoff) publishOwned(ctx context.Context, exchange, key string, msg *message.Message, headers amqp.Table, mandatory bool, owned func() topology.Topology) error {
	err := h.publishMessage(ctx, exchange, key, msg, headers, mandatory)
	if err == nil || !routeGone(err) || h.cfg.Topology.OrDefault() != topology.ModeDeclare {
		return err
	}
	if derr := h.Declare(owned()); derr != nil {
		return errors.Join(err, fmt.Errorf("declare the route again: %w", derr))
	}
	h.cfg.Logger.Error("Route of a hand-off was gone; declared it again", err, watermill.LogFields{
		"message_uuid": msg.UUID, "exchange": exchange, "routing_key": key,
	})
	return h.publishMessage(ctx, exchange, key, msg, headers, mandatory)
}

// routeGone tells whether a publish failed because its exchange or destination does
// not exist.
func routeGone(err error) bool {
	var amqpErr *amqp.Error
	return errors.Is(err, ErrReturned) || errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound
}

func (h *Handoff) publishMessage(ctx context.Context, exchange, key string, msg *message.Message, headers amqp.Table, mandatory bool) error {
	p, err := h.cfg.Marshaler.Marshal(msg)
	if err != nil {
		return fmt.Errorf("marshal message %s: %w", msg.UUID, err)
	}
	// The tier a retry waited in last is no header of the message: only the ttl-tiers
	// backend sets it, anew, on each publish (headers below). Watermill's delay keys
	// are the backend's instructions, spent once parked: sent on, they would delay the
	// message again wherever it is republished.
	for _, k := range []string{TierHeader, wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
		delete(p.Headers, k)
	}
	if len(headers) > 0 {
		// p.Headers is the marshaler's own, already edited above: no clone.
		if p.Headers == nil {
			p.Headers = make(amqp.Table, len(headers))
		}
		maps.Copy(p.Headers, headers)
	}
	return h.publish(ctx, exchange, key, p, mandatory)
}

// publish publishes p to exchange with routing key key and waits for the broker's
// confirm. It returns nil only if the broker confirmed the message and, when mandatory,
// did not return it. Non-mandatory, a publish that no queue takes is confirmed as well:
// the caller must know it is routable.
func (h *Handoff) publish(ctx context.Context, exchange, key string, p amqp.Publishing, mandatory bool) error {
	p.DeliveryMode = amqp.Persistent
	p.Expiration = ""
	p.MessageId = watermill.NewULID()

	pc, err := h.channel()
	if err != nil {
		return err
	}
	if err := fitsFrame(p, pc.frameMax); err != nil {
		return fmt.Errorf("publish to exchange %q with key %q: %w", exchange, key, err)
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
	case !ok && pc.closeReason() != nil:
		return fmt.Errorf("publish to exchange %q with key %q: %w: %w", exchange, key, ErrNotConfirmed, pc.closeReason())
	case !ok:
		return fmt.Errorf("publish to exchange %q with key %q: %w", exchange, key, ErrNotConfirmed)
	case returned:
		return fmt.Errorf("publish to exchange %q with key %q: %w: %d %s", exchange, key, ErrReturned, ret.ReplyCode, ret.ReplyText)
	}
	return nil
}

// fitsFrame checks that p's content header frame fits in frameMax bytes (0: no
// limit): frame header and end (8 bytes), class, weight and body size (12), property
// flags (2), every short-string property at its full length plus its length byte, the
// delivery mode and priority (2), the timestamp (8), and the headers table.
func fitsFrame(p amqp.Publishing, frameMax int) error {
	if frameMax <= 0 {
		return nil
	}
	headers, err := xdeath.WireSize(p.Headers)
	if err != nil {
		return fmt.Errorf("headers: %w", err)
	}
	size := 8 + 12 + 2 + 2 + 8 + headers
	for _, s := range []string{p.ContentType, p.ContentEncoding, p.CorrelationId, p.ReplyTo, p.Expiration, p.MessageId, p.Type, p.UserId, p.AppId} {
		size += 1 + len(s)
	}
	if size > frameMax {
		return fmt.Errorf("%w: header frame of %d bytes (headers table %d) over frame_max %d", ErrTooLarge, size, headers, frameMax)
	}
	return nil
}

// closeReason returns the error the broker closed the channel with, if it has. The
// channel sends it to its close listener before it nacks the pending confirms, so it
// is there when a confirm comes back negative.
func (pc *pubChannel) closeReason() *amqp.Error {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.closeErr == nil {
		select {
		case e := <-pc.closes:
			pc.closeErr = e
		default:
		}
	}
	return pc.closeErr
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
// by the topic, through the default exchange. The poison queue is fed this way. A
// queue that is gone (the publish is returned) is declared again, durable and classic,
// and the message published once more.
func (h *Handoff) QueuePublisher() message.Publisher {
	return queuePublisher{h}
}

type queuePublisher struct{ h *Handoff }

func (q queuePublisher) Publish(queue string, msgs ...*message.Message) error {
	owned := func() topology.Topology { return topology.Topology{Queues: []topology.Queue{{Name: queue}}} }
	for _, msg := range msgs {
		if err := q.h.publishOwned(msg.Context(), "", queue, msg, nil, true, owned); err != nil {
			return err
		}
	}
	return nil
}

func (q queuePublisher) Close() error { return nil }

// Redact returns uri with its password replaced by "xxxxx", or a placeholder when uri
// is not an amqp:// or amqps:// URI with a host.
func Redact(uri string) string { return redact.URI(uri) }

// redactErr keeps a URI parse error from carrying the password.
func redactErr(err error) error {
	var uerr *url.Error
	if errors.As(err, &uerr) {
		return fmt.Errorf("%s: %w", uerr.Op, uerr.Err)
	}
	return err
}

// Causes of a failed hand-off, as FailureCause names them.
const (
	CauseReturned   = "returned"   // unroutable, returned by the broker
	CauseNacked     = "nacked"     // the broker nacked the publish
	CauseTimeout    = "timeout"    // no confirm within ConfirmTimeout
	CauseConnection = "connection" // the channel or connection failed or closed
	CauseTooLarge   = "too-large"  // larger than frame_max, never sent
	CauseOther      = "other"
)

// FailureCause names why a hand-off failed, from a small fixed set (the Cause
// constants), for metrics labels and logs.
func FailureCause(err error) string {
	var amqpErr *amqp.Error
	switch {
	case errors.Is(err, ErrReturned):
		return CauseReturned
	case errors.Is(err, ErrTooLarge):
		return CauseTooLarge
	case errors.Is(err, context.DeadlineExceeded):
		return CauseTimeout
	case errors.As(err, &amqpErr), errors.Is(err, amqp.ErrClosed), errors.As(err, new(*net.OpError)):
		return CauseConnection
	case errors.Is(err, ErrNotConfirmed):
		return CauseNacked
	}
	return CauseOther
}
