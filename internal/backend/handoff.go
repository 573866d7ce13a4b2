package backend

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/redact"
	"github.com/amqpretry/amqpretry/topology"
)

// Handoff is the one way the library moves a message into RabbitMQ: a confirmed
// publish on a connection of its own, never the consuming one. Only when the broker
// has confirmed a copy, and not returned it, may the caller ack the original. Package
// internal/handoff implements it (handoff.Dial connects one): the backends park through it, the middleware
// publishes poisoned messages through it, and ops its moves. Every publish is
// persistent, carries a fresh MessageId and no expiration. It is safe for concurrent
// use. After a channel or connection failure the next publish opens a new one.
type Handoff interface {
	// Publish marshals msg (without mutating it), adds headers, and publishes it to
	// exchange with routing key key, confirmed. When the broker answers that the route
	// is gone (the publish is returned unroutable, or the exchange does not exist) and
	// owned is not nil, it declares owned again and publishes once more (in
	// topology.ModeDeclare only). Non-mandatory, a publish that no queue takes is
	// confirmed as well: the caller must know it is routable.
	Publish(ctx context.Context, exchange, key string, msg *message.Message, headers amqp.Table, mandatory bool, owned func() topology.Topology) error
	// ToQueue publishes msg to queue, a poison queue, through the default exchange,
	// mandatory. A queue that is gone is declared again (declare.ReviewQueue).
	ToQueue(ctx context.Context, queue string, msg *message.Message) error
	// Ensure applies t as mode says, on a throwaway channel of the connection.
	Ensure(mode topology.Mode, t topology.Topology) error
	// Version is the broker's version, "" when unknown.
	Version() string
	// Connection returns the open connection, for checks on channels of their own.
	Connection() (*amqp.Connection, error)
	// Close closes the connection, for good (a publish after it fails with
	// ErrClosed, opening nothing), waiting at most ConfirmTimeout for the broker.
	Close() error
}

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

// Heartbeat is the heartbeat of the connections the library configures itself (the
// subscriber's, when its config gives no amqp.Config, and Cluster's).
const Heartbeat = 10 * time.Second

// DefaultConfirmTimeout bounds the wait for each publisher confirm of the library's
// hand-offs, poisonings, redrives and releases (a constant: docs/reliability.md).
const DefaultConfirmTimeout = 10 * time.Second

// HandoffAttempts is how many hand-offs of one message may fail in a row before it is
// poisoned instead (amqpretry.ReasonHandoffFailed); between them the middleware pauses
// (HandoffPause). docs/reliability.md and docs/troubleshooting.md give the figure.
const HandoffAttempts = 5

// handoffAttemptsForTest, above 0, replaces HandoffAttempts for the Retrys built while
// it is set (SetHandoffAttemptsForTest).
var handoffAttemptsForTest atomic.Int64

// SetHandoffAttemptsForTest makes the Retrys built from now on poison a message after
// n failed hand-offs in a row instead of HandoffAttempts, until restore is called: a
// hook for the test harness (a matrix that shortens itself), never for production.
func SetHandoffAttemptsForTest(n int) (restore func()) {
	old := handoffAttemptsForTest.Swap(int64(n))
	return func() { handoffAttemptsForTest.Store(old) }
}

// HandoffLimit is how many hand-offs of one message may fail in a row in a Retry
// built now: HandoffAttempts, or what SetHandoffAttemptsForTest set.
func HandoffLimit() int {
	if n := handoffAttemptsForTest.Load(); n > 0 {
		return int(n)
	}
	return HandoffAttempts
}

// HandoffConfig configures Dial.
type HandoffConfig struct {
	// URI of the broker. It never appears in errors or logs with its password.
	URI string
	// AMQP is passed to amqp091-go's DialConfig (TLS, heartbeat, properties).
	AMQP amqp.Config
	// ConfirmTimeout bounds the wait for each publisher confirm. Default (0):
	// DefaultConfirmTimeout, what the library always gives.
	ConfirmTimeout time.Duration
	// Marshal turns a Watermill message into a publishing: the subscriber's options,
	// so that the UUID travels in the header the subscriber reads it from.
	Marshal marshal.Options
	// Topology says whether a route found gone when publishing (a deleted queue or
	// exchange of the library's) is declared again, once: only in ModeDeclare.
	Topology topology.Mode
	Logger   watermill.LoggerAdapter
}

// ErrClosed: the hand-off was closed; it opens no connection again.
var ErrClosed = errors.New("hand-off closed")

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

// RouteGone tells whether a publish failed because its exchange or destination does
// not exist.
func RouteGone(err error) bool {
	return errors.Is(err, ErrReturned) || amqperr.IsCode(err, amqp.NotFound)
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

// HandoffPause is the pause after the n-th failed hand-off of a message in a row (1 is
// the first): 100ms doubling to 5s, so that nothing is redelivered at wire speed. The
// README's figures about the hand-off's pacing are checked against it.
func HandoffPause(n int) time.Duration {
	const first, most = 100 * time.Millisecond, 5 * time.Second
	if n > 6 {
		return most
	}
	return min(first<<max(n-1, 0), most)
}
