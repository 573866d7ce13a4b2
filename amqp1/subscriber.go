package amqp1

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

const (
	// attachTimeout bounds one attempt to connect, declare the queue and attach.
	attachTimeout = 30 * time.Second
	// settleTimeout bounds writing one settlement (the broker does not answer it).
	settleTimeout = 10 * time.Second
)

// Subscriber consumes RabbitMQ queues over AMQP 1.0 and hands out each delivery as a
// Watermill message. It is safe for concurrent use.
type Subscriber struct {
	config   SubscriberConfig
	endpoint endpoint
	logger   watermill.LoggerAdapter
	conn     *connector

	closeCtx    context.Context // cancelled by Close
	closeCancel context.CancelFunc

	mu     sync.Mutex
	closed bool
	subs   sync.WaitGroup // Subscribe goroutines
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// NewSubscriber returns a Subscriber for config. It connects on the first Subscribe
// or SubscribeInitialize.
func NewSubscriber(config SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	e, _ := parseURI(config.URI, config.TLSConfig)
	ctx, cancel := context.WithCancel(context.Background())
	return &Subscriber{
		config:      config,
		endpoint:    e,
		logger:      logger,
		conn:        newConnector(e, config.ContainerID, logger),
		closeCtx:    ctx,
		closeCancel: cancel,
	}, nil
}

// Subscribe consumes the queue config.QueueName gives for topic (declaring it first,
// unless config.Queue.NoDeclare) and returns the channel its messages come on, one at
// a time: the next comes once this one is acked or nacked. Ack settles the delivery
// accepted. Nack settles it released (the broker delivers it again, and a quorum queue
// does not count it as a failed delivery), or modified as Redeliver asked.
//
// The first attach happens before Subscribe returns, so that a queue that cannot be
// declared or consumed, or a refused login, is an error here. Later, when the link or
// the connection is lost, the Subscriber attaches again with backoff and goes on; the
// broker redelivers the messages that were not settled (at-least-once).
//
// When ctx ends or Close is called, no further message is handed out, the context of
// the message handed out is cancelled, and the Subscriber waits up to
// config.CloseTimeout for its Ack or Nack before detaching and closing the channel.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrClosed
	}
	s.subs.Add(1)
	s.mu.Unlock()

	sub := &subscription{
		s:      s,
		queue:  s.config.QueueName(topic),
		fields: watermill.LogFields{"topic": topic},
	}
	sub.fields["queue"] = sub.queue
	runCtx, cancel := mergeCancel(ctx, s.closeCtx)
	link, err := sub.attach(runCtx)
	if err != nil {
		cancel()
		s.subs.Done()
		if s.closeCtx.Err() != nil {
			return nil, ErrClosed
		}
		return nil, fmt.Errorf("amqp1: subscribe to queue %q: %w", sub.queue, err)
	}
	s.logger.Info("Subscribed", sub.fields)
	out := make(chan *message.Message)
	go func() {
		defer s.subs.Done()
		defer cancel()
		defer close(out)
		sub.run(ctx, runCtx, out, link)
	}()
	return out, nil
}

// SubscribeInitialize declares the queue for topic (unless config.Queue.NoDeclare), so
// that messages published before the first Subscribe are kept.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return ErrClosed
	}
	if s.config.Queue.NoDeclare {
		return nil
	}
	queue := s.config.QueueName(topic)
	ctx, cancel := context.WithTimeout(s.closeCtx, attachTimeout)
	defer cancel()
	conn, err := s.conn.get(ctx)
	if err == nil {
		err = s.declare(ctx, conn, queue)
	}
	if err != nil {
		if errors.Is(err, ErrClosed) {
			return ErrClosed
		}
		return fmt.Errorf("amqp1: initialize queue %q: %w", queue, err)
	}
	return nil
}

func (s *Subscriber) declare(ctx context.Context, conn *amqp.Conn, queue string) error {
	err := withManagement(ctx, conn, func(m *management) error {
		return m.declareQueue(ctx, queue, s.config.Queue.Type, s.config.Queue.Arguments)
	})
	if err != nil {
		var connErr *amqp.ConnError
		if errors.As(err, &connErr) {
			s.conn.drop(conn)
		}
		return fmt.Errorf("declare: %w", err)
	}
	return nil
}

// Close stops every subscription: no further message is handed out, the contexts of
// the messages handed out are cancelled, and Close waits up to config.CloseTimeout for
// their Acks and Nacks (settling them as usual) before detaching the links, closing
// the connection and the channels. A message still unsettled then goes back to its
// queue. Later calls return nil.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()

	s.closeCancel()
	done := make(chan struct{})
	go func() {
		s.subs.Wait()
		close(done)
	}()
	// Each subscription bounds its own wait by CloseTimeout; this bounds a link stuck
	// on the network as well.
	timer := time.NewTimer(s.config.CloseTimeout + settleTimeout)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		s.logger.Error("Subscriptions did not stop in time, closing the connection under them",
			fmt.Errorf("subscriptions still running %s after Close (CloseTimeout %s)", s.config.CloseTimeout+settleTimeout, s.config.CloseTimeout), nil)
	}
	s.conn.close()
	<-done
	s.logger.Debug("Subscriber closed", nil)
	return nil
}

// subscription is one Subscribe call's consumer.
type subscription struct {
	s      *Subscriber
	queue  string
	fields watermill.LogFields
}

// receiveLink is a receiver on a session of its own.
type receiveLink struct {
	conn    *amqp.Conn
	session *amqp.Session
	rcv     *amqp.Receiver
}

// attach connects if needed, declares the queue (unless NoDeclare) and attaches a
// receiver to it.
func (sub *subscription) attach(ctx context.Context) (*receiveLink, error) {
	s := sub.s
	ctx, cancel := context.WithTimeout(ctx, attachTimeout)
	defer cancel()
	conn, err := s.conn.get(ctx)
	if err != nil {
		return nil, err
	}
	if !s.config.Queue.NoDeclare {
		if err := s.declare(ctx, conn, sub.queue); err != nil {
			return nil, err
		}
	}
	session, err := conn.NewSession(ctx, nil)
	if err != nil {
		sub.dropIfDead(conn, err)
		return nil, fmt.Errorf("begin session: %w", err)
	}
	rcv, err := session.NewReceiver(ctx, QueueAddress(sub.queue), &amqp.ReceiverOptions{
		Credit:                    int32(s.config.Credit),
		RequestedSenderSettleMode: amqp.SenderSettleModeUnsettled.Ptr(),
		SettlementMode:            amqp.ReceiverSettleModeFirst.Ptr(),
	})
	if err != nil {
		closeSession(session)
		sub.dropIfDead(conn, err)
		return nil, fmt.Errorf("attach receiver: %w", err)
	}
	if r := s.config.retry; r != nil {
		// A new consumer: the Retry forgets what it knew of the queue's order keys.
		if err := r.Bind(nil, sub.queue); err != nil {
			(&receiveLink{conn: conn, session: session, rcv: rcv}).detach()
			return nil, err
		}
	}
	return &receiveLink{conn: conn, session: session, rcv: rcv}, nil
}

func (sub *subscription) dropIfDead(conn *amqp.Conn, err error) {
	var connErr *amqp.ConnError
	if errors.As(err, &connErr) {
		sub.s.conn.drop(conn)
	}
}

// detach closes the receiver, then its session: the broker returns the messages the
// link kept unsettled, which a quorum queue does not count as failed deliveries.
func (l *receiveLink) detach() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = l.rcv.Close(ctx)
	_ = l.session.Close(ctx)
}

// run consumes until runCtx ends, attaching again whenever the link is lost.
func (sub *subscription) run(ctx, runCtx context.Context, out chan<- *message.Message, link *receiveLink) {
	s := sub.s
	b := newBackoff(s.config.ReconnectInitialInterval, s.config.ReconnectMaxInterval)
	for {
		err := sub.consume(ctx, runCtx, out, link)
		link.detach()
		if runCtx.Err() != nil {
			s.logger.Debug("Subscription stopped", sub.fields)
			return
		}
		s.logger.Error("Link lost, attaching again", err, sub.fields)
		for {
			pause := b.pause()
			select {
			case <-time.After(pause):
			case <-runCtx.Done():
				return
			}
			link, err = sub.attach(runCtx)
			if err == nil {
				break
			}
			if runCtx.Err() != nil {
				return
			}
			s.logger.Error("Cannot attach, trying again", err, sub.fields.Add(watermill.LogFields{"pause": pause.String()}))
		}
		b.reset()
		s.logger.Info("Attached again", sub.fields)
	}
}

// errStopped ends consume without the link having failed.
var errStopped = errors.New("subscription stopped")

// consume hands out the link's deliveries one at a time until the link fails or
// runCtx ends.
func (sub *subscription) consume(ctx, runCtx context.Context, out chan<- *message.Message, link *receiveLink) error {
	for {
		m, err := link.rcv.Receive(runCtx, nil)
		if err != nil {
			if runCtx.Err() != nil {
				return errStopped
			}
			return err
		}
		if err := sub.handle(ctx, runCtx, out, link, m); err != nil {
			return err
		}
	}
}

// handle turns one delivery into a Watermill message, hands it out and settles it
// as the handler says. It returns errStopped when runCtx ended (after settling what
// was handed out, if that came in time) and the settlement's error when the link
// failed.
func (sub *subscription) handle(ctx, runCtx context.Context, out chan<- *message.Message, link *receiveLink, m *amqp.Message) error {
	s := sub.s
	msg, err := fromAMQP(m)
	if err != nil {
		// Redelivering it would fail again, forever: reject it (dead-lettered if the
		// queue has a dead-letter target, dropped otherwise).
		s.logger.Error("Cannot read message, rejecting it", err, sub.fields)
		return sub.settle(link, m, &amqp.StateRejected{Error: &amqp.Error{
			Condition:   amqp.ErrCondDecodeError,
			Description: err.Error(),
		}})
	}
	if s.config.retry != nil {
		retryView(msg, m, s.config.retry)
	}
	fields := sub.fields.Add(watermill.LogFields{"message_uuid": msg.UUID})

	d := &delivery{msg: m}
	msgCtx, cancelMsg := context.WithCancel(context.WithValue(ctx, deliveryKey{}, d))
	defer cancelMsg()
	stop := context.AfterFunc(s.closeCtx, cancelMsg)
	defer stop()
	msg.SetContext(msgCtx)

	select {
	case out <- msg:
		s.logger.Trace("Message handed out", fields)
	case <-runCtx.Done():
		// Not handed out: return it at once.
		d.markSettled()
		if err := sub.settle(link, m, &amqp.StateReleased{}); err != nil {
			return err
		}
		return errStopped
	}

	var timeout <-chan time.Time
	stopping := runCtx.Done()
	for {
		select {
		case <-msg.Acked():
			d.markSettled()
			if err := sub.settle(link, m, &amqp.StateAccepted{}); err != nil {
				return err
			}
			s.logger.Trace("Message acked", fields)
		case <-msg.Nacked():
			var state amqp.DeliveryState = &amqp.StateReleased{}
			if mod := d.nackOutcome(); mod != nil {
				state = &amqp.StateModified{
					DeliveryFailed:     mod.DeliveryFailed,
					UndeliverableHere:  mod.UndeliverableHere,
					MessageAnnotations: mod.Annotations,
				}
			}
			if err := sub.settle(link, m, state); err != nil {
				return err
			}
			s.logger.Trace("Message nacked", fields.Add(watermill.LogFields{"outcome": outcomeName(state)}))
		case <-stopping:
			stopping = nil
			cancelMsg()
			t := time.NewTimer(s.config.CloseTimeout)
			defer t.Stop()
			timeout = t.C
			continue
		case <-timeout:
			s.logger.Info("Message neither acked nor nacked within the close timeout; it goes back to the queue", fields)
			return errStopped
		}
		if runCtx.Err() != nil {
			return errStopped
		}
		return nil
	}
}

// settle sends the outcome of a delivery. An error means the link is gone: the broker
// will deliver the message again.
func (sub *subscription) settle(link *receiveLink, m *amqp.Message, state amqp.DeliveryState) error {
	ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
	defer cancel()
	var err error
	switch st := state.(type) {
	case *amqp.StateAccepted:
		err = link.rcv.AcceptMessage(ctx, m)
	case *amqp.StateReleased:
		err = link.rcv.ReleaseMessage(ctx, m)
	case *amqp.StateRejected:
		err = link.rcv.RejectMessage(ctx, m, st.Error)
	case *amqp.StateModified:
		err = link.rcv.ModifyMessage(ctx, m, &amqp.ModifyMessageOptions{
			DeliveryFailed:    st.DeliveryFailed,
			UndeliverableHere: st.UndeliverableHere,
			Annotations:       st.MessageAnnotations,
		})
	}
	if err != nil {
		return fmt.Errorf("settle %s: %w", outcomeName(state), err)
	}
	return nil
}

func outcomeName(state amqp.DeliveryState) string {
	switch state.(type) {
	case *amqp.StateAccepted:
		return "accepted"
	case *amqp.StateReleased:
		return "released"
	case *amqp.StateRejected:
		return "rejected"
	case *amqp.StateModified:
		return "modified"
	}
	return fmt.Sprint(state)
}
