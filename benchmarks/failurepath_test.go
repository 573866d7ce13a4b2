package main

import (
	"context"
	"maps"
	"os"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/wire"
	"github.com/amqpretry/amqpretry/middleware"
)

// The client-side cost of one hand-off, without a broker:
//
//	cd benchmarks && go test -run '^$' -bench FailurePath -benchmem
//
// BenchmarkFailurePath runs the middleware's failure path (decide, copy, envelope,
// stamps, Park) in-process, on the memory backend with the retry path's 10 min delay:
// its Park copies the message once more and starts a timer, which the ttl-tiers
// backend does not (it marshals and publishes). BenchmarkFailurePathMarshal is what the
// hand-off does to such an enveloped copy before the socket (the subscriber's
// marshaler, the spent delay keys deleted, the tier header, the frame-size check's wire
// size): the ttl-tiers failure path costs about the first (less the memory backend's
// copy and timer) plus the second. BenchmarkFailurePathCeiling is the ceiling
// middleware's own work (ceiling.go) on the same message: its headers table. The
// message is what the subscriber hands the middleware on a first delivery (the retry
// subscriber's marshaler's Unmarshal of the retry path's prefilled message).

const benchQueue = "amqpretry-bench.000000.1234.rp.ours-0"

var headerSink amqp.Table

// cloneHeaders: BENCH_CLONE_HEADERS=1 measures the hand-off as it was before the
// marshaled headers stopped being cloned.
var cloneHeaders = os.Getenv("BENCH_CLONE_HEADERS") == "1"

// handoffMarshal does to msg what the ttl-tiers hand-off does before the socket.
func handoffMarshal(msg *message.Message) error {
	p, err := marshal.Marshaler{}.Marshal(msg)
	if err != nil {
		return err
	}
	for _, k := range []string{keys.Tier, wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
		delete(p.Headers, k)
	}
	if cloneHeaders { // what the hand-off did before it stopped cloning them
		p.Headers = maps.Clone(p.Headers)
	}
	p.Headers[keys.Tier] = "10m"
	if _, err := wire.Size(p.Headers); err != nil {
		return err
	}
	headerSink = p.Headers
	return nil
}

// capture is the memory backend's publisher: it keeps the last copy delivered.
type capture struct{ last chan *message.Message }

func (c capture) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		select {
		case c.last <- m:
		default:
		}
	}
	return nil
}

func (capture) Close() error { return nil }

// deliveredMessage is a first delivery of the retry path's queue as the retry
// subscriber's marshaler unmarshals it.
func deliveredMessage(tb testing.TB) *message.Message {
	return delivered(tb, nil)
}

// typedHeaders are the non-string headers of BenchmarkFailurePathTyped's message: an
// int, a bool and a nested table, as amqp091-go reads them.
func typedHeaders() amqp.Table {
	return amqp.Table{
		"tenant-shard": int32(17),
		"priority-hi":  true,
		"trace":        amqp.Table{"span": int64(1234567890123), "sampled": true, "tags": []interface{}{"a", int32(2)}},
	}
}

// delivered is deliveredMessage with extra headers on the delivery.
func delivered(tb testing.TB, extra amqp.Table) *message.Message {
	tb.Helper()
	p, err := marshal.Marshaler{}.Marshal(benchMessages("rp", 1)[0])
	if err != nil {
		tb.Fatal(err)
	}
	maps.Copy(p.Headers, extra)
	msg, err := marshal.Marshaler{Options: marshal.Options{Retry: true, Delivered: func(m *message.Message, _ int) { m.Metadata[keys.Subscriber] = "bench-subscriber" }}}.Unmarshal(amqp.Delivery{
		Headers: p.Headers, Body: p.Body, RoutingKey: benchQueue, DeliveryMode: amqp.Persistent,
	})
	if err != nil {
		tb.Fatal(err)
	}
	msg.SetContext(context.Background())
	return msg
}

// failingRetry is the middleware in-process (memory backend) around a handler that
// always fails; its copies go to pub after d.
func failingRetry(tb testing.TB, pub capture, d time.Duration) message.HandlerFunc {
	tb.Helper()
	cfg := amqpretry.Config{
		Backend: delay.Memory(pub),
		Policy:  amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{d}, Jitter: -1},
	}.WithDefaults()
	r, err := middleware.New(cfg, middleware.Transport{Queue: func(string) string { return benchQueue }})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = r.Close() })
	return r.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errPlanned })
}

func benchFailure(b *testing.B, h message.HandlerFunc) {
	benchFailureOf(b, h, deliveredMessage(b))
}

func benchFailureOf(b *testing.B, h message.HandlerFunc, msg *message.Message) {
	ctx := msg.Context()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		// Each delivery comes with a context of its own: the Retry does nothing with
		// one it has handed off already (a middleware outside running it again).
		msg.SetContext(ctx)
		if _, err := h(msg); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkFailurePath(b *testing.B) {
	benchFailure(b, failingRetry(b, capture{}, retryPathDelay))
}

// envelopedCopy is a copy the middleware handed to the backend for msg.
func envelopedCopy(tb testing.TB, msg *message.Message) *message.Message {
	tb.Helper()
	pub := capture{last: make(chan *message.Message, 1)}
	h := failingRetry(tb, pub, time.Millisecond)
	if _, err := h(msg); err != nil {
		tb.Fatal(err)
	}
	select {
	case cp := <-pub.last:
		return cp
	case <-time.After(10 * time.Second):
		tb.Fatal("no copy from the memory backend within 10 s")
	}
	return nil
}

func BenchmarkFailurePathMarshal(b *testing.B) {
	cp := envelopedCopy(b, deliveredMessage(b))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := handoffMarshal(cp); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFailurePathTyped is BenchmarkFailurePath on a message with typed headers
// (typedHeaders).
func BenchmarkFailurePathTyped(b *testing.B) {
	benchFailureOf(b, failingRetry(b, capture{}, retryPathDelay), delivered(b, typedHeaders()))
}

// BenchmarkFailurePathMarshalTyped is BenchmarkFailurePathMarshal on the copy of a
// message with typed headers (typedHeaders).
func BenchmarkFailurePathMarshalTyped(b *testing.B) {
	cp := envelopedCopy(b, delivered(b, typedHeaders()))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := handoffMarshal(cp); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkFailurePathCeiling(b *testing.B) {
	msg := deliveredMessage(b)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		headerSink = ceilingHeaders(msg)
	}
}

// TestFailurePathAllocs logs the allocations of one hand-off and the size of the
// headers it sends, ours and the ceiling's (no thresholds: figures for the report).
func TestFailurePathAllocs(t *testing.T) {
	msg := deliveredMessage(t)
	ctx := msg.Context()
	h := failingRetry(t, capture{}, retryPathDelay)
	allocs := testing.AllocsPerRun(1000, func() {
		msg.SetContext(ctx) // a delivery of its own, as in benchFailureOf
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	})
	t.Logf("failure path (memory backend: its copy and timer included): %.0f allocs per hand-off", allocs)
	msg.SetContext(ctx)
	cp := envelopedCopy(t, msg)
	t.Logf("hand-off marshal: %.0f allocs", testing.AllocsPerRun(1000, func() {
		if err := handoffMarshal(cp); err != nil {
			t.Fatal(err)
		}
	}))
	ours, err := wire.Size(headerSink)
	if err != nil {
		t.Fatal(err)
	}
	ceil, err := wire.Size(ceilingHeaders(msg))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("headers table on the wire: ours %d bytes (%d headers), ceiling %d bytes; body %d bytes", ours, len(headerSink), ceil, len(msg.Payload))
	t.Logf("ceiling headers: %.0f allocs", testing.AllocsPerRun(1000, func() { headerSink = ceilingHeaders(msg) }))
}
