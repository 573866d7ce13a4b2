package middleware

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

// TestBrokerLinesMarkTheHead: on the broker a key's head is an exchange named for its
// message, bound to the key's behind queue: marked when the key is blocked, moved
// when another message replaces it (the old mark deleted), and deleted with the queue
// when the key is unblocked; a key not blocked has no head. A block that cannot mark
// its head blocks nothing: a behind queue with no head would keep its key blocked for
// good (the head is marked first, its queue declared after).
func TestBrokerLinesMarkTheHead(t *testing.T) {
	conn := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	cfg := amqpretry.Config{Prefix: prefix, Backend: delay.TTLTiers(time.Second),
		OrderKey: func(msg *message.Message) string { return msg.Metadata.Get("key") }}
	plan, err := cfg.Plan()
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, plan)
	nm := names.Names{Prefix: prefix}
	work := prefix + ".orders"
	k := orderKey{work, "acc-1"}
	brokertest.Cleanup(t, []string{nm.Behind(work, k.key)}, []string{nm.BehindHead(work, k.key, "m1"), nm.BehindHead(work, k.key, "m2"), nm.BehindHead(work, k.key, "m4")})
	r, err := startTest(cfg.WithDefaults(), Transport{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.close()
	l := r.engine.order.lines
	exists := func(exchange string) bool {
		t.Helper()
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		defer ch.Close() //nolint:errcheck // closed by the broker on 404
		return ch.ExchangeDeclarePassive(exchange, "direct", true, true, false, false, nil) == nil
	}
	heads := func(want1, want2 bool) {
		t.Helper()
		for head, want := range map[string]bool{"m1": want1, "m2": want2} {
			if is, err := l.isHead(k, head); err != nil || is != want {
				t.Errorf("isHead(%s) = %v, %v; want %v", head, is, err, want)
			}
		}
	}
	heads(false, false)
	if err := l.block(k, "m1", ""); err != nil {
		t.Fatal(err)
	}
	heads(true, false)
	if err := l.block(k, "m1", ""); err != nil { // again: nothing changes
		t.Fatal(err)
	}
	heads(true, false)
	if err := l.block(k, "m2", "m1"); err != nil {
		t.Fatal(err)
	}
	heads(false, true)
	if exists(nm.BehindHead(work, k.key, "m1")) {
		t.Error("the replaced head's mark is still there")
	}
	// A message behind the key keeps it blocked.
	put, err := l.put(t.Context(), k, message.NewMessage("m3", []byte("x")))
	if err != nil || !put {
		t.Fatalf("put behind the key: %v, %v", put, err)
	}
	if ok, err := l.unblock(k, "m2"); err != nil || ok {
		t.Fatalf("unblock with a message behind the key = %v, %v; want false", ok, err)
	}
	heads(false, true)
	c, err := l.open(k)
	if err != nil {
		t.Fatal(err)
	}
	m, settle, err := c.next()
	if err != nil || m == nil || m.UUID != "m3" {
		t.Fatalf("next = %v, %v", m, err)
	}
	if err := settle(true); err != nil {
		t.Fatal(err)
	}
	c.close()
	if ok, err := l.unblock(k, "m2"); err != nil || !ok {
		t.Fatalf("unblock = %v, %v; want true", ok, err)
	}
	heads(false, false)
	if exists(nm.BehindHead(work, k.key, "m2")) {
		t.Error("the head's mark outlived its key's behind queue")
	}

	// m4's mark cannot be declared: an exchange of another type has its name.
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclare(nm.BehindHead(work, k.key, "m4"), "fanout", true, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	_ = ch.Close()
	if err := l.block(k, "m4", ""); err == nil {
		t.Fatal("block with a head that cannot be marked: no error")
	}
	if put, err := l.put(t.Context(), k, message.NewMessage("m5", []byte("x"))); err != nil || put {
		t.Errorf("put behind a key whose block failed = %v, %v; want false (not blocked: no behind queue)", put, err)
	}
}
