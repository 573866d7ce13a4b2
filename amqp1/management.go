package amqp1

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/Azure/go-amqp"

	"github.com/amqpretry/amqpretry/topology"
)

// managementAddress is RabbitMQ 4's HTTP-over-AMQP management node: a request is a
// message whose subject is the HTTP method and whose "to" is the path; the reply's
// subject is the HTTP status code.
const managementAddress = "/management"

var managementSeq atomic.Uint64

// management is a pair of links to the management node on a session of its own.
// Requests are serialized: the node answers them in order on the receiving link.
type management struct {
	mu      sync.Mutex
	session *amqp.Session
	snd     *amqp.Sender
	rcv     *amqp.Receiver
	seq     uint64
}

// errManagement is a reply whose status code is not the one expected.
type errManagement struct {
	status int
	reason string
}

func (e *errManagement) Error() string {
	return fmt.Sprintf("management node answered %d: %s", e.status, e.reason)
}

func openManagement(ctx context.Context, conn *amqp.Conn) (*management, error) {
	session, err := conn.NewSession(ctx, nil)
	if err != nil {
		return nil, err
	}
	name := "amqp1-management-" + strconv.FormatUint(managementSeq.Add(1), 10)
	props := map[string]any{"paired": true}
	// The receiving link first: its credit must have reached the broker before the
	// first request, or the broker refuses the reply ("insufficient credit"). The
	// sending link's attach round trip gives go-amqp the time to send that flow.
	rcv, err := session.NewReceiver(ctx, managementAddress, &amqp.ReceiverOptions{
		Name:                      name,
		Properties:                props,
		TargetAddress:             managementAddress,
		RequestedSenderSettleMode: amqp.SenderSettleModeSettled.Ptr(),
		Credit:                    1,
	})
	if err != nil {
		_ = session.Close(ctx)
		return nil, err
	}
	snd, err := session.NewSender(ctx, managementAddress, &amqp.SenderOptions{
		Name:                        name,
		Properties:                  props,
		SourceAddress:               managementAddress,
		SettlementMode:              amqp.SenderSettleModeSettled.Ptr(),
		RequestedReceiverSettleMode: amqp.ReceiverSettleModeFirst.Ptr(),
	})
	if err != nil {
		_ = session.Close(ctx)
		return nil, err
	}
	return &management{session: session, snd: snd, rcv: rcv}, nil
}

func (m *management) close(ctx context.Context) error {
	return m.session.Close(ctx)
}

// request sends one request and waits for its reply. body is a map for PUT and POST,
// nil for GET and DELETE (sent as AMQP null).
func (m *management) request(ctx context.Context, method, path string, body any) (int, any, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.seq++
	id := strconv.FormatUint(m.seq, 10)
	if body == nil {
		body = amqp.Null{}
	}
	replyTo := "$me"
	req := &amqp.Message{
		Value: body,
		Properties: &amqp.MessageProperties{
			MessageID: id,
			To:        &path,
			Subject:   &method,
			ReplyTo:   &replyTo,
		},
	}
	if err := m.snd.Send(ctx, req, &amqp.SendOptions{Settled: true}); err != nil {
		return 0, nil, err
	}
	for {
		reply, err := m.rcv.Receive(ctx, nil)
		if err != nil {
			return 0, nil, err
		}
		if reply.Properties == nil || reply.Properties.Subject == nil {
			return 0, nil, errors.New("management node answered without a status code")
		}
		if reply.Properties.CorrelationID != id {
			continue // the reply to an earlier request whose wait was abandoned
		}
		status, err := strconv.Atoi(*reply.Properties.Subject)
		if err != nil {
			return 0, nil, fmt.Errorf("management node answered status %q", *reply.Properties.Subject)
		}
		return status, reply.Value, nil
	}
}

// declareQueue declares a durable queue, idempotently: an existing queue with the same
// type and arguments is fine, one that differs is an error naming the difference.
func (m *management) declareQueue(ctx context.Context, queue, queueType string, args map[string]any) error {
	arguments := make(map[string]any, len(args)+1)
	for k, v := range args {
		arguments[k] = v
	}
	if queueType != "" {
		arguments[queueTypeArg] = queueType
	}
	status, value, err := m.request(ctx, "PUT", QueueAddress(queue), map[string]any{
		"durable":     true,
		"exclusive":   false,
		"auto_delete": false,
		"arguments":   arguments,
	})
	if err != nil {
		return err
	}
	if status != 200 && status != 201 {
		err := &errManagement{status: status, reason: fmt.Sprint(value)}
		if c, ok := parseClash(err.reason); ok {
			return clashError(queue, c, err)
		}
		return err
	}
	return nil
}

// clashError names, for a queue declared with other arguments than the existing
// queue's, what it has, what the config asks for, and the fix.
func clashError(queue string, c clash, err error) error {
	fix := fmt.Sprintf("SubscriberConfig.Queue.Arguments %s: %q", c.arg, c.has)
	switch {
	case c.arg == "x-queue-type":
		fix = fmt.Sprintf("SubscriberConfig.Queue.Type %q", c.has)
	case c.has == "none":
		fix = "SubscriberConfig.Queue.Arguments without " + c.arg
	}
	return fmt.Errorf("work queue %q: %w: it has %s %s, the subscriber config asks for %s (%w); an existing queue's arguments cannot change: "+
		"give the subscriber config the queue's own, %s, or set SubscriberConfig.Queue.NoDeclare so that it is not declared; see docs/switching-backends.md",
		queue, topology.ErrMismatch, c.arg, c.has, c.asked, err, fix)
}

// deleteQueue deletes a queue; a queue that does not exist is not an error.
func (m *management) deleteQueue(ctx context.Context, queue string) error {
	status, value, err := m.request(ctx, "DELETE", QueueAddress(queue), nil)
	if err != nil {
		return err
	}
	if status != 200 && status != 404 {
		return &errManagement{status: status, reason: fmt.Sprint(value)}
	}
	return nil
}

// managementAttempts is how many link pairs withManagement opens at most: the broker
// refuses a request that reaches it before the reply link's credit ("insufficient
// credit"), which a loaded machine can delay past the sending link's attach.
const managementAttempts = 5

// withManagement opens a management link pair on conn, runs fn and closes the pair.
// An attempt that fails on the links (not on the broker's answer) is tried again on a
// new pair, after a pause that doubles from 50 ms, up to managementAttempts in all.
func withManagement(ctx context.Context, conn *amqp.Conn, fn func(*management) error) error {
	var err error
	for attempt := 0; attempt < managementAttempts; attempt++ {
		if attempt > 0 {
			select {
			case <-time.After(50 * time.Millisecond << (attempt - 1)):
			case <-ctx.Done():
				return err
			}
		}
		var m *management
		m, err = openManagement(ctx, conn)
		if err != nil {
			return err
		}
		err = fn(m)
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = m.close(closeCtx)
		cancel()
		var me *errManagement
		if err == nil || errors.As(err, &me) || ctx.Err() != nil {
			return err
		}
	}
	return err
}
