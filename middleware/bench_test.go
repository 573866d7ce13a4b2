package middleware

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// The success path of the retry middleware against the bare handler it wraps:
//
//	go test -run '^$' -bench 'BareHandler|RetrySuccessPath' -benchmem ./middleware
//
// The difference between the two is what every message that does not fail pays for
// the middleware (ns/op and allocs/op). The failure path needs a broker hand-off and is
// measured by the benchmarks module (benchmarks/, retry_path_ratio).

// discard is a message.Publisher that accepts everything; the success path never
// publishes.
type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

func benchMessage() *message.Message {
	msg := message.NewMessage("01J0BENCHMARKMESSAGE00000", []byte(`{"order":"12345","amount":"42.00"}`))
	msg.Metadata.Set("content-type", "application/json")
	return msg
}

func bareHandler(*message.Message) ([]*message.Message, error) { return nil, nil }

// sink keeps the compiler from discarding the calls.
var sink []*message.Message

func runHandler(b *testing.B, h message.HandlerFunc, msg *message.Message) {
	b.Helper()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		out, err := h(msg)
		if err != nil {
			b.Fatal(err)
		}
		sink = out
	}
}

func BenchmarkBareHandler(b *testing.B) {
	runHandler(b, bareHandler, benchMessage())
}

func BenchmarkRetrySuccessPath(b *testing.B) {
	// In-process, as retry.Start builds it on the memory backend.
	b.Run("in-process", func(b *testing.B) {
		r, err := startTest(amqpretry.Config{Backend: delay.Memory(discard{})}.WithDefaults(), Transport{})
		if err != nil {
			b.Fatal(err)
		}
		defer r.close()
		runHandler(b, r.Middleware(bareHandler), benchMessage())
	})
	// Wired to its subscriber, as on a broker: the delivery carries the Retry's id, and
	// the middleware records its chain on the message's context.
	b.Run("wired", func(b *testing.B) {
		e, _ := newEngine(b, amqpretry.Config{}, &fakeBackend{})
		e.wiring.ID = "retry-1"
		msg := benchMessage()
		msg.Metadata.Set(keys.Subscriber, "retry-1")
		h := e.Middleware(bareHandler)
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			msg.SetContext(context.Background()) // a new delivery: a chain of its own
			out, err := h(msg)
			if err != nil {
				b.Fatal(err)
			}
			sink = out
		}
	})
}

// The success path with Config.Dedup in this process's memory against without it, a
// new message UUID each time (each checked, handled and recorded; the store full at
// its 100,000 keys after as many, forgetting the oldest):
//
//	go test -run '^$' -bench 'Dedup' -benchmem ./middleware
//
// The pgdedup module measures the same with its PostgreSQL store.
func BenchmarkDedup(b *testing.B) {
	for _, keep := range []time.Duration{0, time.Hour} {
		name := "off"
		if keep > 0 {
			name = "memory"
		}
		b.Run(name, func(b *testing.B) {
			r, err := startTest(amqpretry.Config{Backend: delay.Memory(discard{}), Dedup: keep}.WithDefaults(),
				Transport{Queue: func(string) string { return "work" }})
			if err != nil {
				b.Fatal(err)
			}
			defer r.close()
			ids := make([]string, b.N)
			for i := range ids {
				ids[i] = fmt.Sprintf("01J0BENCHMARKMESSAGE%06d", i)
			}
			h, msg := r.Middleware(bareHandler), benchMessage()
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				msg.UUID = ids[i]
				out, err := h(msg)
				if err != nil {
					b.Fatal(err)
				}
				sink = out
			}
			b.StopTimer()
			if st := r.Stats(); st.Duplicates != 0 {
				b.Fatalf("%d duplicates: every message is new", st.Duplicates)
			}
		})
	}
}
