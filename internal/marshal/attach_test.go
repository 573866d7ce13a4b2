package marshal

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/ctxkey"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// TestGuardAttachedByDelivered: a guard not attached (NewGuard) reaches the Retry's
// Delivered in the context of the first message it unmarshals, where the Retry
// attaches its Reads; the message's own context is given back after, and later
// messages carry nothing. Before it is attached a guard lets every message through.
func TestGuardAttachedByDelivered(t *testing.T) {
	reads := &Reads{}
	g := NewGuard()
	var carried []bool
	m := Marshaler{Options{Retry: true, Guard: g, Delivered: func(msg *message.Message, _ int) {
		msg.Metadata[keys.Subscriber] = "r1"
		got, ok := msg.Context().Value(ctxkey.Guard{}).(*Guard)
		carried = append(carried, ok)
		if ok {
			got.Attach(reads)
		}
	}}}
	if err := g.admit(message.NewMessage("u0", nil), true); err != nil || g.reads.Load() != nil {
		t.Fatalf("admit before Attach: %v, attached to %p", err, g.reads.Load())
	}
	for _, uuid := range []string{"u1", "u2"} {
		msg, err := m.Unmarshal(delivery(uuid, false))
		if err != nil {
			t.Fatal(err)
		}
		if msg.Context() != context.Background() {
			t.Errorf("%s: context %v, want its own back", uuid, msg.Context())
		}
	}
	if len(carried) != 2 || !carried[0] || carried[1] {
		t.Errorf("guard carried to Delivered: %v, want on the first message only", carried)
	}
	if g.reads.Load() != reads {
		t.Errorf("guard attached to %p, want the Retry's %p", g.reads.Load(), reads)
	}
	g.Attach(&Reads{})
	if g.reads.Load() != reads {
		t.Error("a second Attach replaced the first")
	}
}
