package xdeath

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
)

func mustEncode(tb testing.TB, v interface{}) string {
	tb.Helper()
	s, err := marshal.EncodeValue(v)
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

// FuzzFromMetadata feeds arbitrary metadata to FromMetadata and Marshal:
// neither may panic, errors must wrap ErrMalformed, and a published message
// must carry no broker-owned header nor any of the marshaler's reserved keys.
func FuzzFromMetadata(f *testing.F) {
	death := mustEncode(f, []interface{}{rejectedOnce(), amqp.Table{fieldCount: int64(2), "extra": 1.5}})
	f.Add(`["x-death"]`, death, "rejected")
	f.Add(`["x-death","x-first-death-reason"]`, death, `{"string":"expired"}`)
	f.Add(`["x-first-death-reason"]`, `{"array":[]}`, `{"int64":1}`)
	f.Add(`[]`, death, "")
	f.Add(`["x-death"]`, `{"array":[{"table":{"count":{"int64":-1}}}]}`, "")
	f.Add(`["x-death"]`, `{"array":[{"table":{"routing-keys":{"array":[{"int8":1}]}}}]}`, "")
	f.Add(`null`, `{"void":null}`, "")
	f.Fuzz(func(t *testing.T, typed, death, reason string) {
		md := message.Metadata{keys.TypedHeaders: typed, headerDeath: death, headerFirstDeathReason: reason, "user": reason}
		info, err := FromMetadata(md)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("FromMetadata error %v does not wrap ErrMalformed", err)
			}
		} else {
			for i, d := range info.Deaths {
				if d.Count < 0 {
					t.Fatalf("death %d has a negative count %d", i, d.Count)
				}
			}
		}

		msg := message.NewMessage("u", nil)
		msg.Metadata = md
		p, err := Marshaler{}.Marshal(msg)
		if err != nil {
			t.Fatalf("Marshal failed on metadata: %v", err)
		}
		for k := range p.Headers {
			if keys.BrokerOwned(k) || keys.Reserved(k) {
				t.Fatalf("published header %q", k)
			}
		}
		if p.Headers["user"] != reason {
			t.Fatalf("user header %#v, want %q", p.Headers["user"], reason)
		}
	})
}
