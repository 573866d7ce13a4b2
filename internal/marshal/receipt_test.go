package marshal

import (
	"context"
	"maps"
	"math"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/wire"
)

// typedDelivery has typed headers of every kind the encoding carries, some in the
// shapes decoding normalizes (a NaN with a payload, a timestamp with nanoseconds in
// UTC, an empty non-nil array, a nil byte slice), a header only the raw path carries
// (a key that is not valid UTF-8), broker-owned ones and a string one.
func typedDelivery() amqp.Delivery {
	return amqp.Delivery{
		RoutingKey: "orders",
		Body:       []byte("body"),
		Headers: amqp.Table{
			DefaultUUIDKey: "uuid-typed",
			"tenant":       int32(7),
			"flag":         true,
			"trace": amqp.Table{
				"span": int64(1234567890123), "sampled": true, "tags": []interface{}{"a", int32(2), nil},
				"empty": []interface{}{}, "deep": amqp.Table{"k": []byte{}}, "bad-utf8": "\xff\xfe",
			},
			"nan64":     math.Float64frombits(0x7ff8000000000abc),
			"nan32":     math.Float32frombits(0x7fc00abc),
			"neg-zero":  math.Copysign(0, -1),
			"f32":       float32(1.5),
			"dec":       amqp.Decimal{Scale: 2, Value: 12345},
			"at":        time.Unix(1700000000, 123).UTC(),
			"bytes":     []byte(nil),
			"bad-utf8":  "\xff\xfe",
			"u16":       uint16(65535),
			"i":         42,
			"void":      nil,
			"\xffraw":   int32(1),
			keys.XDeath: []interface{}{rejectedOnce()},
			"plain":     "text",
		},
	}
}

// copyLike copies msg as the middleware's copyOf does: a new message with the same
// UUID and payload, metadata less the delivery's own keys, and CopyContext.
func copyLike(msg *message.Message) *message.Message {
	cp := message.NewMessageWithContext(CopyContext(msg), msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		if !slices.Contains(keys.OfDelivery[:], k) {
			cp.Metadata[k] = v
		}
	}
	return cp
}

// decodingAsBefore marshals msg as Marshal did before it kept receipts: from a
// message with msg's metadata and no receipt, each typed value decoded.
func decodingAsBefore(t *testing.T, m Marshaler, msg *message.Message) amqp.Table {
	t.Helper()
	ref := message.NewMessage(msg.UUID, msg.Payload)
	ref.Metadata = maps.Clone(msg.Metadata)
	if receiptOf(ref) != nil {
		t.Fatal("a message Unmarshal did not return has a receipt")
	}
	p, err := m.Marshal(ref)
	if err != nil {
		t.Fatal(err)
	}
	return p.Headers
}

// identical reports whether a and b are the same Go value to the bit: the same types,
// NaNs with the same bits, nil and empty told apart (stricter than wire.Equal).
func identical(a, b interface{}) bool {
	if reflect.TypeOf(a) != reflect.TypeOf(b) {
		return false
	}
	switch x := a.(type) {
	case float32:
		return math.Float32bits(x) == math.Float32bits(b.(float32))
	case float64:
		return math.Float64bits(x) == math.Float64bits(b.(float64))
	case []byte:
		y := b.([]byte)
		return (x == nil) == (y == nil) && string(x) == string(y)
	case []interface{}:
		y := b.([]interface{})
		if len(x) != len(y) || (x == nil) != (y == nil) {
			return false
		}
		for i := range x {
			if !identical(x[i], y[i]) {
				return false
			}
		}
		return true
	case amqp.Table:
		y := b.(amqp.Table)
		if len(x) != len(y) || (x == nil) != (y == nil) {
			return false
		}
		for k, v := range x {
			w, ok := y[k]
			if !ok || !identical(v, w) {
				return false
			}
		}
		return true
	}
	return reflect.DeepEqual(a, b)
}

// sameHeaders fails t unless got and want are identical tables that also encode to
// the same AMQP field-table bytes, header by header.
func sameHeaders(t *testing.T, got, want amqp.Table) {
	t.Helper()
	if !identical(got, want) {
		t.Fatalf("headers\n%#v\nwant (decoded as before)\n%#v", got, want)
	}
	for k, v := range want {
		gb, gerr := wire.AppendTable(nil, amqp.Table{k: got[k]})
		wb, werr := wire.AppendTable(nil, amqp.Table{k: v})
		if string(gb) != string(wb) || (gerr == nil) != (werr == nil) {
			t.Fatalf("header %q on the wire: %x (%v), want %x (%v)", k, gb, gerr, wb, werr)
		}
	}
}

func decodedSoFar() int64 {
	_, decoded := WorkDone()
	return decoded
}

type subscriberKey struct{}

// TestCopyPublishesTypedHeadersWithoutDecoding: a delivery with typed headers, through
// Unmarshal (watermill-amqp then sets the message's context), a copy as the
// middleware's and Marshal, decodes nothing, and the copy publishes the very headers
// that decoding gave; so does the message itself. For the plain marshaler (the typed
// x-death, the raw header) and the retry subscriber's.
func TestCopyPublishesTypedHeadersWithoutDecoding(t *testing.T) {
	for _, m := range []Marshaler{{}, {Options{Retry: true, Delivered: deliveredAs("s")}}, {Options{MessageUUIDHeaderKey: "tenant"}}} {
		msg, err := m.Unmarshal(typedDelivery())
		if err != nil {
			t.Fatal(err)
		}
		msg.SetContext(context.WithValue(context.Background(), subscriberKey{}, "subscriber's"))
		if _, ok := msg.Metadata[keys.RawHeaders]; !ok {
			t.Fatal("no raw header: the test misses the raw path")
		}
		cp := copyLike(msg)
		cp.Metadata[keys.Attempt] = "2" // the envelope
		cp.Metadata[keys.Error] = "boom"
		want := decodingAsBefore(t, m, cp)

		before := decodedSoFar()
		p, err := m.Marshal(cp)
		if err != nil {
			t.Fatal(err)
		}
		if n := decodedSoFar() - before; n != 0 {
			t.Errorf("retry %v: Marshal of the copy decoded %d values, want 0", m.Retry, n)
		}
		sameHeaders(t, p.Headers, want)

		// A copy of the copy (a backend's), and the message itself.
		cp2 := cp.Copy()
		cp2.SetContext(cp.Context())
		for _, again := range []*message.Message{cp2, msg} {
			before = decodedSoFar()
			p, err = m.Marshal(again)
			if err != nil {
				t.Fatal(err)
			}
			if n := decodedSoFar() - before; n != 0 {
				t.Errorf("retry %v: Marshal decoded %d values, want 0", m.Retry, n)
			}
			sameHeaders(t, p.Headers, decodingAsBefore(t, m, again))
		}
	}
}

// TestPublishedTablesAreNew: what Marshal publishes for a kept value is new each time:
// a PostprocessPublishing that changes a nested table changes no later copy.
func TestPublishedTablesAreNew(t *testing.T) {
	m := Marshaler{Options{PostprocessPublishing: func(p amqp.Publishing) amqp.Publishing {
		p.Headers["trace"].(amqp.Table)["span"] = "changed"
		p.Headers["bytes"] = append(p.Headers["bytes"].([]byte), 1)
		return p
	}}}
	msg, err := m.Unmarshal(typedDelivery())
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := m.Marshal(copyLike(msg)); err != nil {
			t.Fatal(err)
		}
	}
	p, err := Marshaler{}.Marshal(copyLike(msg))
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Headers["trace"].(amqp.Table)["span"]; got != int64(1234567890123) {
		t.Errorf("trace.span = %#v after two copies' postprocessing, want int64(1234567890123)", got)
	}
}

// TestChangedTypedHeaderIsDecoded: a handler that changes a typed header's metadata
// string (or the list of typed keys) gets its value decoded; the others are kept.
func TestChangedTypedHeaderIsDecoded(t *testing.T) {
	m := Marshaler{Options{Retry: true, Delivered: deliveredAs("s")}}
	msg, err := m.Unmarshal(typedDelivery())
	if err != nil {
		t.Fatal(err)
	}
	msg.SetContext(context.Background())
	msg.Metadata["tenant"] = mustEncode(t, int64(99)) // the handler's
	msg.Metadata["flag"] = "not JSON"
	delete(msg.Metadata, "i")
	cp := copyLike(msg)
	want := decodingAsBefore(t, m, cp)

	before := decodedSoFar()
	p, err := m.Marshal(cp)
	if err != nil {
		t.Fatal(err)
	}
	if n := decodedSoFar() - before; n != 2 {
		t.Errorf("Marshal decoded %d values, want 2 (tenant, flag)", n)
	}
	if p.Headers["tenant"] != int64(99) || p.Headers["flag"] != "not JSON" {
		t.Errorf("tenant, flag = %#v, %#v; want int64(99), the string", p.Headers["tenant"], p.Headers["flag"])
	}
	if _, ok := p.Headers["i"]; ok {
		t.Error("a typed header the handler deleted is published")
	}
	sameHeaders(t, p.Headers, want)

	// A list the handler changed: its keys are typed, the kept values still used.
	cp.Metadata["extra"] = mustEncode(t, uint8(3))
	cp.Metadata[keys.TypedHeaders] = `["at","bytes","dec","extra","f32","flag","nan32","nan64","neg-zero","tenant","trace","u16","void"]`
	want = decodingAsBefore(t, m, cp)
	before = decodedSoFar()
	if p, err = m.Marshal(cp); err != nil {
		t.Fatal(err)
	}
	if n := decodedSoFar() - before; n != 3 {
		t.Errorf("Marshal decoded %d values, want 3 (extra, tenant, flag)", n)
	}
	if p.Headers["extra"] != uint8(3) {
		t.Errorf("extra = %#v, want uint8(3)", p.Headers["extra"])
	}
	sameHeaders(t, p.Headers, want)
}

// TestReceiptsAreDropped: 100k messages with typed headers, unmarshaled, copied and
// marshaled by concurrent goroutines, leave no receipt behind once collected.
func TestReceiptsAreDropped(t *testing.T) {
	const goroutines, perGoroutine = 8, 100_000 / 8
	base := receipts.live.Load()
	m := Marshaler{Options{Retry: true, Delivered: deliveredAs("s")}}
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d := amqp.Delivery{Body: []byte("b"), Headers: amqp.Table{"n": int64(g), "t": amqp.Table{"ok": true}}}
			for range perGoroutine {
				msg, err := m.Unmarshal(d)
				if err == nil {
					_, err = m.Marshal(copyLike(msg))
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n := receipts.live.Load() - base; n > goroutines*perGoroutine {
		t.Fatalf("%d receipts live for %d messages", n, goroutines*perGoroutine)
	}
	// Cleanups run after a collection, on their own goroutine, each dropping its entry
	// and then the count: collect until every one of this test's has run and the table
	// has what is counted (a cleanup between the two is caught mid-way).
	left := func() int64 {
		n := int64(0)
		receipts.m.Range(func(any, any) bool { n++; return true })
		return n
	}
	for deadline := time.Now().Add(time.Minute); receipts.live.Load() > base || left() != receipts.live.Load(); {
		if time.Now().After(deadline) {
			t.Fatalf("after a minute of collections: %d receipts in the table, %d counted, %d before the test", left(), receipts.live.Load(), base)
		}
		runtime.GC()
		runtime.Gosched()
	}
}

// TestCopyOutlivesMessage: a copy keeps its receipt when the message it was made of
// is gone.
func TestCopyOutlivesMessage(t *testing.T) {
	m := Marshaler{}
	cp := func() *message.Message {
		msg, err := m.Unmarshal(typedDelivery())
		if err != nil {
			t.Fatal(err)
		}
		return copyLike(msg)
	}()
	runtime.GC()
	runtime.GC()
	before := decodedSoFar()
	p, err := m.Marshal(cp)
	if err != nil {
		t.Fatal(err)
	}
	if n := decodedSoFar() - before; n != 0 {
		t.Errorf("Marshal decoded %d values, want 0", n)
	}
	sameHeaders(t, p.Headers, decodingAsBefore(t, m, cp))
}

// TestFresh: fresh gives what decoding the encoding gives, to the bit.
func TestFresh(t *testing.T) {
	for k, v := range typedDelivery().Headers {
		enc, err := EncodeValue(v)
		if err != nil {
			continue
		}
		want, err := DecodeValue(enc)
		if err != nil {
			t.Fatal(err)
		}
		if got := fresh(v); !identical(got, want) {
			t.Errorf("%s: fresh(%#v) = %#v, want %#v", k, v, got, want)
		}
	}
}
