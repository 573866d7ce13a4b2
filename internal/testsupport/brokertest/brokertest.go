// Package brokertest gives integration tests a real RabbitMQ: its address, unique names
// and clean-up. Tests that need the broker call Dial; where no broker answers they are
// skipped, except under CI=true, where a missing broker fails the run.
package brokertest

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/redact"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
)

// DefaultURI is used when AMQP_URI is unset.
const DefaultURI = "amqp://guest:guest@127.0.0.1:5672/"

// URI returns AMQP_URI, or DefaultURI.
func URI() string {
	if u := os.Getenv("AMQP_URI"); u != "" {
		return u
	}
	return DefaultURI
}

// Dial connects to the test broker, or skips the test (fails it under CI=true) when
// none answers. The connection is closed when the test ends.
func Dial(t testing.TB) *amqp.Connection {
	t.Helper()
	conn, err := amqp.Dial(URI())
	if err != nil {
		msg := fmt.Sprintf("no RabbitMQ at AMQP_URI (%s): %v", Redact(URI()), err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg + "; under CI=true a missing broker is a failure")
		}
		t.Skip(msg + "; start one with `docker compose up -d` or set AMQP_URI")
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// CI tells whether the tests run under CI=true, where a missing broker or tool is a
// failure, never a skip.
func CI() bool { return os.Getenv("CI") == "true" }

// Redact hides the password of uri, as the library does.
func Redact(uri string) string { return redact.URI(uri) }

var seq atomic.Int64

// Prefix returns a name prefix unique to this test run and call. It deletes nothing:
// register what a test declares under it with Cleanup.
func Prefix(t testing.TB) string {
	t.Helper()
	name := strings.NewReplacer("/", "-", " ", "-").Replace(t.Name())
	if len(name) > 40 {
		name = name[:40]
	}
	return fmt.Sprintf("amqpretry-test.%s.%d.%d", name, time.Now().UnixNano()%1e9, seq.Add(1))
}

// Cleanup deletes the given queues and exchanges when the test ends, on a connection
// of its own; where no connection can be had (a broker out of file handles hangs every
// new one), the queues through rabbitmqctl. It fails the test when neither works, so
// that leftovers never go unnoticed: quorum queues left behind exhaust a RabbitMQ 3.x
// broker's file-handle budget (docs/broker-resources.md).
func Cleanup(t testing.TB, queues, exchanges []string) {
	t.Helper()
	t.Cleanup(func() {
		conn, err := amqp.DialConfig(URI(), amqp.Config{Dial: amqp.DefaultDial(10 * time.Second)})
		if err != nil {
			cleanupByCtl(t, queues, err)
			return
		}
		defer conn.Close()
		for _, q := range queues {
			if ch, err := conn.Channel(); err == nil {
				_, _ = ch.QueueDelete(q, false, false, false)
				_ = ch.Close()
			}
		}
		for _, e := range exchanges {
			if ch, err := conn.Channel(); err == nil {
				_ = ch.ExchangeDelete(e, false, false)
				_ = ch.Close()
			}
		}
	})
}

// cleanupByCtl deletes queues with rabbitmqctl, after dialErr, failing t if it cannot.
func cleanupByCtl(t testing.TB, queues []string, dialErr error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var left []string
	for _, q := range queues {
		if _, err := Ctl(ctx, "delete_queue", q); err != nil {
			left = append(left, q)
		}
	}
	if len(left) > 0 {
		t.Errorf("cleanup: no connection to the broker (%v) and rabbitmqctl failed: %d queues may be left: %s",
			redact.Error(dialErr, URI()), len(left), strings.Join(left, ", "))
	}
}

// CleanupTopology deletes the queues and exchanges of t when the test ends.
func CleanupTopology(tb testing.TB, t topology.Topology) {
	tb.Helper()
	var queues, exchanges []string
	for _, q := range t.Queues {
		queues = append(queues, q.Name)
	}
	for _, e := range t.Exchanges {
		exchanges = append(exchanges, e.Name)
	}
	Cleanup(tb, queues, exchanges)
}

// QueueLength returns how many messages are ready in queue.
func QueueLength(t testing.TB, queue string) int {
	t.Helper()
	ch, err := Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

// Wait returns once the broker at URI accepts a connection, or the last dial error after
// timeout.
func Wait(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		conn, err := amqp.Dial(URI())
		if err == nil {
			return conn.Close()
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Drain takes every message of queue, as a subscriber built by the library reads it
// (xdeath.Marshaler), and fails the test on any error.
func Drain(t testing.TB, queue string) []*message.Message {
	t.Helper()
	ch, err := Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	var out []*message.Message
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return out
		}
		msg, err := xdeath.Marshaler{}.Unmarshal(d)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, msg)
	}
}
