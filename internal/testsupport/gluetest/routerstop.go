package gluetest

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

// AddHandlersSubscriberClosesWhenRunsContextEnds: the subscriber AddHandler builds is
// closed, with its connection, when the context given to router.Run is cancelled, not
// only on router.Close() (Watermill closes a handler's subscriber on Close only, and
// AddHandler returns no subscriber a user could close). Checked on the broker: once
// Run has returned and the Retry is closed, no connection of the subscriber's
// connection_name is left.
func AddHandlersSubscriberClosesWhenRunsContextEnds(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	name := fmt.Sprintf("%s.conn", s.prefix)
	s.sub.Connection = &amqp.Config{Properties: amqp.Table{"connection_name": name}}
	r := newRetry(t, m, s.sub, s.cfg)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, Logger())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.AddHandler(router, "orders", s.topic, func(*message.Message) error { return nil }); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- router.Run(ctx) }()
	<-router.Running()
	waitConnections(t, name, func(n int) bool { return n >= 1 }, "the subscriber's connection to open")

	cancel()
	select {
	case err := <-ran:
		if err != nil {
			t.Fatalf("router.Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("router.Run did not return within 30s of its context's end")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	waitConnections(t, name, func(n int) bool { return n == 0 }, "every connection to close after Run's context ended and the Retry closed (the subscriber's stayed open)")
}

// waitConnections polls the broker's connections named name until ok is true of their
// number, failing t after a deadline.
func waitConnections(t *testing.T, name string, ok func(int) bool, what string) {
	t.Helper()
	needle := []byte(fmt.Sprintf(`{"connection_name",%q}`, name))
	n := -1
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		out, err := brokertest.Ctl(ctx, "list_connections", "-q", "--no-table-headers", "client_properties")
		cancel()
		if err != nil {
			if brokertest.CI() {
				t.Fatalf("rabbitmqctl cannot list the broker's connections: %v", err)
			}
			t.Skipf("rabbitmqctl cannot list the broker's connections: %v", err)
		}
		if n = bytes.Count(out, needle); ok(n) {
			return
		}
	}
	t.Fatalf("waited 20s for %s: %d connections named %q", what, n, name)
}
