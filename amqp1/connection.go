package amqp1

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill"
)

// connector owns one AMQP connection, dialled on first use and again on the first use
// after it was lost. Publisher and Subscriber each have one; every link they open is on
// a session of its own on it, so that a link error ends that link only.
type connector struct {
	endpoint    endpoint
	containerID string
	logger      watermill.LoggerAdapter

	closeCtx context.Context // cancelled by close: ends a dial under way
	cancel   context.CancelFunc

	mu     sync.Mutex
	conn   *amqp.Conn
	closed bool
}

func newConnector(e endpoint, containerID string, logger watermill.LoggerAdapter) *connector {
	if containerID == "" {
		containerID = randomContainerID()
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &connector{endpoint: e, containerID: containerID, logger: logger, closeCtx: ctx, cancel: cancel}
}

func randomContainerID() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return "watermill-amqp1-" + hex.EncodeToString(b)
}

// get returns the live connection, dialling a new one when there is none or it was
// lost. Concurrent callers wait for one dial.
func (c *connector) get(ctx context.Context) (*amqp.Conn, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClosed
	}
	if c.conn != nil {
		select {
		case <-c.conn.Done():
			c.logger.Info("Connection lost", watermill.LogFields{"amqp_uri": c.endpoint.redacted, "err": c.conn.Err()})
			c.conn = nil
		default:
			return c.conn, nil
		}
	}
	ctx, cancel := mergeCancel(ctx, c.closeCtx)
	defer cancel()
	start := time.Now()
	conn, err := amqp.Dial(ctx, c.endpoint.addr, c.endpoint.connOptions(c.containerID))
	if err != nil {
		if c.closeCtx.Err() != nil {
			return nil, ErrClosed
		}
		return nil, fmt.Errorf("connect to %s: %w", c.endpoint.redacted, err)
	}
	c.conn = conn
	c.logger.Info("Connected", watermill.LogFields{
		"amqp_uri":     c.endpoint.redacted,
		"container_id": c.containerID,
		"elapsed":      time.Since(start).String(),
	})
	return conn, nil
}

// drop forgets conn if it is still the current connection and closes it, so that the
// next get dials again. Called when a link on it failed in a way a new link on the same
// connection would not fix.
func (c *connector) drop(conn *amqp.Conn) {
	c.mu.Lock()
	if c.conn == conn {
		c.conn = nil
	}
	c.mu.Unlock()
	_ = conn.Close()
}

// close closes the connection and refuses any later get. go-amqp's error from closing
// is diagnostic only (it repeats why the connection had ended): it is logged, not
// returned.
func (c *connector) close() {
	c.cancel()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	c.closed = true
	if c.conn == nil {
		return
	}
	if err := c.conn.Close(); err != nil {
		c.logger.Debug("Connection closed with an error", watermill.LogFields{"amqp_uri": c.endpoint.redacted, "err": err})
	}
	c.conn = nil
}

// mergeCancel returns a context that is ctx, also cancelled when other is.
func mergeCancel(ctx, other context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(other, cancel)
	return ctx, func() {
		stop()
		cancel()
	}
}
