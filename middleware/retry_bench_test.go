package middleware_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/middleware"
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

func (discard) Effective(d time.Duration) (time.Duration, error) { return d, nil }

func benchMessage() *message.Message {
	msg := message.NewMessage("01J0BENCHMARKMESSAGE00000", []byte(`{"order":"12345","amount":"42.00"}`))
	msg.Metadata.Set("content-type", "application/json")
	return msg
}

func bareHandler(*message.Message) ([]*message.Message, error) { return nil, nil }

// sink keeps the compiler from discarding the calls.
var sink []*message.Message

func runHandler(b *testing.B, h message.HandlerFunc) {
	b.Helper()
	msg := benchMessage()
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
	runHandler(b, bareHandler)
}

func BenchmarkRetrySuccessPath(b *testing.B) {
	r, err := middleware.NewRetry(middleware.RetryConfig{Delay: discard{}, Poison: discard{}, PoisonTopic: "poison"})
	if err != nil {
		b.Fatal(err)
	}
	runHandler(b, r.Middleware(bareHandler))
}
