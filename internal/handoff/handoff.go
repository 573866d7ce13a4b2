// Package handoff is the one way the library moves a message into RabbitMQ: a
// confirmed publish on a connection of its own, never the consuming one. Only when the
// broker has confirmed a copy, and not returned it, may the caller ack the original.
package handoff

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/redact"
	"github.com/amqpretry/amqpretry/internal/wire"
	"github.com/amqpretry/amqpretry/topology"
)

var (
	// ErrNotConfirmed: the broker nacked the publish, or its channel or connection
	// closed before the confirm arrived, so it is unknown whether the broker has it.
	ErrNotConfirmed = errors.New("publish not confirmed by the broker")
	// ErrReturned: the broker returned the mandatory publish as unroutable.
	ErrReturned = errors.New("publish returned unroutable")
	// ErrTooLarge: the message's properties and headers do not fit in one frame of the
	// size the connection negotiated (frame_max, 128 KiB by default). The broker would
	// close the whole connection over it, so it is never sent.
	ErrTooLarge = errors.New("message headers larger than the broker's frame_max")
)

// Locale is the locale every connection of the library asks for: RabbitMQ knows no
// other.
const Locale = "en_US"

// DefaultConfirmTimeout bounds the wait for a publisher confirm.
const DefaultConfirmTimeout = 10 * time.Second

// Config configures Dial.
type Config struct {
	// URI of the broker. It never appears in errors or logs with its password.
	URI string
	// AMQP is passed to amqp091-go's DialConfig (TLS, heartbeat, properties).
	AMQP amqp.Config
	// ConfirmTimeout bounds the wait for each publisher confirm. Default (0):
	// DefaultConfirmTimeout, which amqpretry.Config.WithDefaults gives too.
	ConfirmTimeout time.Duration
	// Marshal turns a Watermill message into a publishing: the subscriber's options,
	// so that the UUID travels in the header the subscriber reads it from.
	Marshal marshal.Options
	// Topology says whether a route found gone when publishing (a deleted queue or
	// exchange of the library's) is declared again, once: only in ModeDeclare.
	Topology topology.Mode
	Logger   watermill.LoggerAdapter
}

// Handoff publishes with confirms. Every publish is persistent, carries a fresh
// MessageId and no expiration, and goes out on a confirm-mode channel of the hand-off's
// own connection. It is safe for concurrent use: concurrent publishes share one channel
// with deferred confirmations. After a channel or connection failure the next publish
// opens a new one.
type Handoff struct {
	cfg Config

	mu     sync.Mutex // guards conn, pc and closed
	conn   *amqp.Connection
	pc     *pubChannel
	closed bool // by Close: nothing is opened again
}

// ErrClosed: the hand-off was closed; it opens no connection again.
var ErrClosed = errors.New("hand-off closed")

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
func Dial(cfg Config) (*Handoff, error) {
	if cfg.ConfirmTimeout <= 0 {
		cfg.ConfirmTimeout = DefaultConfirmTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if cfg.AMQP.Locale == "" {
		cfg.AMQP.Locale = Locale
	}
	h := &Handoff{cfg: cfg}
	if _, err := h.channel(); err != nil {
		return nil, err
	}
	return h, nil
}

// DialConn opens a plain connection to uri, its errors redacted.
func DialConn(uri string, cfg amqp.Config) (*amqp.Connection, error) {
	if cfg.Locale == "" {
		cfg.Locale = Locale
	}
	// amqp091-go writes into the Properties map it is given; the subscriber may dial
	// with the same Config at the same moment (a failover): give it a map of its own.
	if cfg.Properties != nil {
		cfg.Properties = maps.Clone(cfg.Properties)
	}
	conn, err := amqp.DialConfig(uri, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", redact.URI(uri), redact.Error(err, uri, amqp.ErrSyntax, amqp.ErrCredentials, amqp.ErrSASL, amqp.ErrVhost))
	}
	return conn, nil
}

// channel returns the open confirm channel, reconnecting when it or its connection
// has closed.
func (h *Handoff) channel() (*pubChannel, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, ErrClosed
	}
	if h.pc != nil && !h.pc.ch.IsClosed() {
		return h.pc, nil
	}
	if h.conn == nil || h.conn.IsClosed() {
		conn, err := DialConn(h.cfg.URI, h.cfg.AMQP)
		if err != nil {
			return nil, err
		}
		h.conn = conn
		h.cfg.Logger.Debug("Hand-off connection opened", watermill.LogFields{"amqp_uri": redact.URI(h.cfg.URI)})
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

// Version is the broker's version from the server properties ("4.3.6"), or "".
func (h *Handoff) Version() string {
	conn, err := h.Connection()
	if err != nil {
		return ""
	}
	v, _ := conn.Properties["version"].(string)
	return v
}

// Ensure applies t on a short-lived channel of the hand-off connection as mode says.
func (h *Handoff) Ensure(mode topology.Mode, t topology.Topology) error {
	if mode == topology.ModeNone {
		return nil
	}
	conn, err := h.Connection()
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open topology channel: %w", err)
	}
	defer ch.Close() //nolint:errcheck // a failed declare has closed it already
	return declare.Ensure(ch, mode, t)
}

// Publish marshals msg (without mutating it), adds headers, and publishes it to
// exchange with routing key key. When the broker answers that the route is gone (the
// publish is returned unroutable, or the exchange does not exist) and owned is not
// nil, it declares owned again and publishes once more (in topology.ModeDeclare
// only): a poison queue, tier queue or exchange of the library's deleted while the
// application runs comes back at the first message that needs it. Non-mandatory, a
// publish that no queue takes is confirmed as well: the caller must know it is
// routable.
func (h *Handoff) Publish(ctx context.Context, exchange, key string, msg *message.Message, headers amqp.Table, mandatory bool, owned func() topology.Topology) error {
	p, err := marshal.Marshaler{Options: h.cfg.Marshal}.Marshal(msg)
	if err != nil {
		return fmt.Errorf("marshal message %s: %w", msg.UUID, err)
	}
	// p.Headers is the marshaler's own: no clone.
	maps.Copy(p.Headers, headers)
	err = h.publish(ctx, exchange, key, p, mandatory)
	if err == nil || owned == nil || !RouteGone(err) || (h.cfg.Topology != topology.ModeDeclare && h.cfg.Topology != "") {
		return err
	}
	if derr := h.Ensure(topology.ModeDeclare, owned()); derr != nil {
		return errors.Join(err, fmt.Errorf("declare the route again: %w", derr))
	}
	h.cfg.Logger.Error("Route of a hand-off was gone; declared it again", err, watermill.LogFields{
		"message_uuid": msg.UUID, "exchange": exchange, "routing_key": key,
	})
	return h.publish(ctx, exchange, key, p, mandatory)
}

// ToQueue publishes msg to queue, a poison queue, through the default exchange,
// mandatory. A queue that is gone is declared again (declare.HoldingQueue).
func (h *Handoff) ToQueue(ctx context.Context, queue string, msg *message.Message) error {
	owned := func() topology.Topology {
		return topology.Topology{Queues: []topology.Queue{declare.HoldingQueue(queue, "poison")}}
	}
	return h.Publish(ctx, "", queue, msg, nil, true, owned)
}

// RouteGone tells whether a publish failed because its exchange or destination does
// not exist.
func RouteGone(err error) bool {
	return errors.Is(err, ErrReturned) || declare.IsCode(err, amqp.NotFound)
}

// publish publishes p and waits for the broker's confirm. It returns nil only if the
// broker confirmed the message and, when mandatory, did not return it.
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
// delivery mode and priority (2), the timestamp (8), and the headers table, sized
// without encoding it.
func fitsFrame(p amqp.Publishing, frameMax int) error {
	if frameMax <= 0 {
		return nil
	}
	headers, err := wire.Size(p.Headers)
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

// Close closes the hand-off connection, for good (a publish after it fails with
// ErrClosed, opening nothing), waiting at most ConfirmTimeout for the broker
// (a node that lost its majority may never answer).
func (h *Handoff) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	if h.conn == nil || h.conn.IsClosed() {
		return nil
	}
	return h.conn.CloseDeadline(time.Now().Add(h.cfg.ConfirmTimeout))
}

// Cause names why a hand-off failed, for metrics labels and logs: returned, nacked,
// timeout, connection, too-large or other.
func Cause(err error) string {
	var amqpErr *amqp.Error
	switch {
	case errors.Is(err, ErrReturned):
		return "returned"
	case errors.Is(err, ErrTooLarge):
		return "too-large"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.As(err, &amqpErr), errors.Is(err, amqp.ErrClosed), errors.As(err, new(*net.OpError)):
		return "connection"
	case errors.Is(err, ErrNotConfirmed):
		return "nacked"
	}
	return "other"
}
