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

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

// The client-side cost of one hand-off, without a broker:
//
//	cd benchmarks && go test -run '^$' -bench FailurePath -benchmem
//
// BenchmarkFailurePath runs the middleware's failure path (decide, copy, envelope,
// stamps, Delayer.Publish) with a Delayer that accepts everything; ...Marshal adds what
// delay.Handoff does to the copy before the socket (xdeath.Marshaler, the spent delay
// keys deleted, the frame-size check's wire size). BenchmarkFailurePathCeiling is the
// ceiling middleware's own work (ceiling.go) on the same message: its headers table.
// The message is what the subscriber hands the middleware on a first delivery
// (xdeath.Marshaler.Unmarshal of the retry path's prefilled message).

// acceptAll is a middleware.Delayer that accepts every message; with marshal it also
// marshals it as delay.Handoff does.
type acceptAll struct{ marshal bool }

var headerSink amqp.Table

// cloneHeaders: BENCH_CLONE_HEADERS=1 measures the hand-off as it was before the
// marshaled headers stopped being cloned.
var cloneHeaders = os.Getenv("BENCH_CLONE_HEADERS") == "1"

func (a acceptAll) Publish(_ string, msgs ...*message.Message) error {
	if !a.marshal {
		return nil
	}
	for _, m := range msgs {
		p, err := xdeath.Marshaler{}.Marshal(m)
		if err != nil {
			return err
		}
		for _, k := range []string{delay.TierHeader, wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
			delete(p.Headers, k)
		}
		if cloneHeaders { // what delay.Handoff did before it stopped cloning them
			p.Headers = maps.Clone(p.Headers)
		}
		p.Headers[delay.TierHeader] = "10m"
		if _, err := xdeath.WireSize(p.Headers); err != nil {
			return err
		}
		headerSink = p.Headers
	}
	return nil
}

func (acceptAll) Close() error { return nil }

func (acceptAll) Effective(d time.Duration) (time.Duration, error) { return d, nil }

// deliveredMessage is a first delivery of the retry path's queue as the subscriber
// unmarshals it.
func deliveredMessage(tb testing.TB) *message.Message {
	tb.Helper()
	const queue = "amqpretry-bench.000000.1234.rp.ours-0"
	p, err := xdeath.Marshaler{}.Marshal(benchMessages("rp", 1)[0])
	if err != nil {
		tb.Fatal(err)
	}
	msg, err := xdeath.Marshaler{Subscriber: "bench-subscriber"}.Unmarshal(amqp.Delivery{
		Headers: p.Headers, Body: p.Body, RoutingKey: queue, DeliveryMode: amqp.Persistent,
	})
	if err != nil {
		tb.Fatal(err)
	}
	msg.SetContext(context.Background())
	return msg
}

func failingRetry(tb testing.TB, d middleware.Delayer) message.HandlerFunc {
	tb.Helper()
	r, err := middleware.NewRetry(middleware.RetryConfig{
		Delay: d, Poison: d, PoisonTopic: "poison",
		Policy: middleware.Policy{MaxAttempts: 2, Delays: []time.Duration{retryPathDelay}},
		Queue:  func(string) string { return "amqpretry-bench.000000.1234.rp.ours-0" },
	})
	if err != nil {
		tb.Fatal(err)
	}
	return r.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errPlanned })
}

func benchFailure(b *testing.B, h message.HandlerFunc) {
	msg := deliveredMessage(b)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := h(msg); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkFailurePath(b *testing.B) { benchFailure(b, failingRetry(b, acceptAll{})) }

func BenchmarkFailurePathMarshal(b *testing.B) {
	benchFailure(b, failingRetry(b, acceptAll{marshal: true}))
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
	for _, c := range []struct {
		name string
		d    acceptAll
	}{{"failure path", acceptAll{}}, {"failure path + marshal", acceptAll{marshal: true}}} {
		h := failingRetry(t, c.d)
		allocs := testing.AllocsPerRun(1000, func() {
			if _, err := h(msg); err != nil {
				t.Fatal(err)
			}
		})
		t.Logf("%s: %.0f allocs per hand-off", c.name, allocs)
	}
	ours, err := xdeath.WireSize(headerSink)
	if err != nil {
		t.Fatal(err)
	}
	ceil, err := xdeath.WireSize(ceilingHeaders(msg))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("headers table on the wire: ours %d bytes (%d headers), ceiling %d bytes; body %d bytes", ours, len(headerSink), ceil, len(msg.Payload))
	t.Logf("ceiling headers: %.0f allocs", testing.AllocsPerRun(1000, func() { headerSink = ceilingHeaders(msg) }))
}
