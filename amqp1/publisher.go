package amqp1

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Publisher sends Watermill messages over AMQP 1.0 and returns once the broker has
// accepted each of them. It is safe for concurrent use.
type Publisher struct {
	config   PublisherConfig
	endpoint endpoint
	logger   watermill.LoggerAdapter
	conn     *connector

	mu       sync.Mutex
	links    map[string]*sendLink // by address
	closed   bool
	inFlight sync.WaitGroup // Publish calls under way
}

// sendLink is a sender on a session of its own.
type sendLink struct {
	conn    *amqp.Conn
	session *amqp.Session
	sender  *amqp.Sender
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher for config. It connects on the first Publish, and
// again on the first Publish after the connection or a link was lost.
func NewPublisher(config PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	e, _ := parseURI(config.URI, config.TLSConfig)
	return &Publisher{
		config:   config,
		endpoint: e,
		logger:   logger,
		conn:     newConnector(e, config.ContainerID, logger),
		links:    map[string]*sendLink{},
	}, nil
}

// Publish sends msgs, in order, to the address config.Address gives for topic, and
// waits until the broker has settled every one of them. It returns nil only when the
// broker accepted all of them; otherwise the error wraps ErrNotAccepted (the broker
// refused a message: rejected, released or modified), ErrNotConfirmed (the link or
// connection was lost, or the time ran out, before the outcome came) or the cause, and
// names the first message that failed. Messages before it were accepted; later ones
// may have been. A link or connection lost makes the next Publish attach or connect
// again (a connection found closed before sending is replaced at once).
//
// Each message is sent durable, with its payload as the body, its metadata as
// application properties, and its UUID as the application property
// _watermill_message_uuid and as the message-id.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	p.inFlight.Add(1)
	p.mu.Unlock()
	defer p.inFlight.Done()

	address := p.config.Address(topic)
	type pending struct {
		msg     *message.Message
		link    *sendLink
		receipt amqp.SendReceipt
		ctx     context.Context
	}
	sent := make([]pending, 0, len(msgs))
	cancels := make([]context.CancelFunc, 0, len(msgs))
	defer func() {
		for _, cancel := range cancels {
			cancel()
		}
	}()

	for _, msg := range msgs {
		ctx, cancel := context.WithTimeout(msg.Context(), p.config.PublishTimeout)
		cancels = append(cancels, cancel)
		link, err := p.link(ctx, address)
		if err != nil {
			return p.publishError(msg, address, err)
		}
		receipt, err := link.sender.SendWithReceipt(ctx, toAMQP(msg), nil)
		if err != nil {
			p.fail(link, err)
			return p.publishError(msg, address, err)
		}
		sent = append(sent, pending{msg: msg, link: link, receipt: receipt, ctx: ctx})
	}
	for _, s := range sent {
		state, err := s.receipt.Wait(s.ctx)
		if err != nil {
			p.fail(s.link, err)
			return p.publishError(s.msg, address, err)
		}
		if err := outcomeError(state); err != nil {
			return fmt.Errorf("amqp1: publish message %s to %s: %w", s.msg.UUID, describe(address), err)
		}
		p.logger.Trace("Message published", watermill.LogFields{
			"message_uuid": s.msg.UUID, "topic": topic, "address": address,
		})
	}
	return nil
}

// link returns the sender for address, attaching it (and connecting) when needed.
func (p *Publisher) link(ctx context.Context, address string) (*sendLink, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	if l, ok := p.links[address]; ok {
		select {
		case <-l.conn.Done():
			// The connection ended while the link was idle: attach again rather
			// than fail a message that was never sent.
			delete(p.links, address)
		default:
			return l, nil
		}
	}
	conn, err := p.conn.get(ctx)
	if err != nil {
		return nil, err
	}
	session, err := conn.NewSession(ctx, nil)
	if err != nil {
		p.dropIfDead(conn, err)
		return nil, fmt.Errorf("begin session: %w", err)
	}
	sender, err := session.NewSender(ctx, address, &amqp.SenderOptions{
		SettlementMode:              amqp.SenderSettleModeUnsettled.Ptr(),
		RequestedReceiverSettleMode: amqp.ReceiverSettleModeFirst.Ptr(),
	})
	if err != nil {
		closeSession(session)
		p.dropIfDead(conn, err)
		return nil, fmt.Errorf("attach sender: %w", err)
	}
	l := &sendLink{conn: conn, session: session, sender: sender}
	p.links[address] = l
	p.logger.Debug("Sender attached", watermill.LogFields{"address": address})
	return l, nil
}

// fail forgets link when err says it is gone, so that the next Publish attaches again.
func (p *Publisher) fail(l *sendLink, err error) {
	if !linkGone(err) {
		return
	}
	p.mu.Lock()
	for address, cur := range p.links {
		if cur == l {
			delete(p.links, address)
		}
	}
	p.mu.Unlock()
	p.logger.Info("Sender lost", watermill.LogFields{"err": err})
	closeSession(l.session)
	p.dropIfDead(l.conn, err)
}

func (p *Publisher) dropIfDead(conn *amqp.Conn, err error) {
	var connErr *amqp.ConnError
	if errors.As(err, &connErr) {
		p.conn.drop(conn)
	}
}

func (p *Publisher) publishError(msg *message.Message, address string, err error) error {
	if errors.Is(err, ErrClosed) {
		return ErrClosed
	}
	if linkGone(err) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return fmt.Errorf("amqp1: publish message %s to %s: %w: %w", msg.UUID, describe(address), ErrNotConfirmed, err)
	}
	return fmt.Errorf("amqp1: publish message %s to %s: %w", msg.UUID, describe(address), err)
}

// Close waits for the Publish calls under way, then closes the links and the
// connection. Later calls return nil.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()

	p.inFlight.Wait()

	p.mu.Lock()
	links := p.links
	p.links = nil
	p.mu.Unlock()
	for _, l := range links {
		closeSession(l.session)
	}
	p.conn.close()
	return nil
}

// outcomeError is nil for accepted, else an error wrapping ErrNotAccepted that says
// which outcome, with the broker's reason for a rejection.
func outcomeError(state amqp.DeliveryState) error {
	switch s := state.(type) {
	case *amqp.StateAccepted:
		return nil
	case *amqp.StateRejected:
		if s.Error != nil {
			return fmt.Errorf("%w: rejected: %s: %s", ErrNotAccepted, s.Error.Condition, s.Error.Description)
		}
		return fmt.Errorf("%w: rejected", ErrNotAccepted)
	case *amqp.StateReleased:
		return fmt.Errorf("%w: released (nothing to route it to)", ErrNotAccepted)
	case *amqp.StateModified:
		return fmt.Errorf("%w: modified", ErrNotAccepted)
	default:
		return fmt.Errorf("%w: outcome %v", ErrNotAccepted, state)
	}
}

// linkGone reports whether err means the link, its session or its connection ended.
func linkGone(err error) bool {
	var (
		linkErr    *amqp.LinkError
		sessionErr *amqp.SessionError
		connErr    *amqp.ConnError
	)
	return errors.As(err, &linkErr) || errors.As(err, &sessionErr) || errors.As(err, &connErr)
}

// describe names an address in messages: `queue "orders"` for /queues/orders.
func describe(address string) string {
	if name, ok := strings.CutPrefix(address, "/queues/"); ok {
		if decoded, err := url.PathUnescape(name); err == nil {
			name = decoded
		}
		return fmt.Sprintf("queue %q", name)
	}
	return fmt.Sprintf("address %q", address)
}

// closeSession ends a session without waiting long: the broker returns the messages
// its links kept unsettled.
func closeSession(s *amqp.Session) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.Close(ctx)
}
