package marshal

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/wire"
)

func mustEncode(tb testing.TB, v interface{}) string {
	tb.Helper()
	s, err := EncodeValue(v)
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

// FuzzDecodeValue checks that DecodeValue never panics, fails only with
// ErrMalformed, and that whatever it decodes encodes to a canonical form
// that decodes to the same value.
func FuzzDecodeValue(f *testing.F) {
	for _, v := range []interface{}{
		nil, true, int8(-1), int16(2), int32(3), int64(-4), 5, byte(6), uint16(7), uint32(8),
		float32(0.5), 1e-300, amqp.Decimal{Scale: 1, Value: 2}, "s", "\xff", []byte{1}, t1,
		[]interface{}{rejectedOnce()}, amqp.Table{"a": []interface{}{amqp.Table{}, nil}},
	} {
		f.Add(mustEncode(f, v))
	}
	for _, s := range []string{
		``, `null`, `{}`, `{"int8":1,"int8":2}`, `{"float64":"NaN"}`, `{"float32":"0x1p-2"}`,
		`{"string-base64":"aGk="}`, `{"bytes":""}`, `{"array":[]}`, `{"table":{"\ud800":{"void":null}}}`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		v, err := DecodeValue(s)
		if err != nil {
			if !errors.Is(err, wire.ErrMalformed) {
				t.Fatalf("DecodeValue error %v does not wrap ErrMalformed", err)
			}
			return
		}
		enc, err := EncodeValue(v)
		if err != nil {
			t.Fatalf("EncodeValue(%#v) of a decoded value: %v", v, err)
		}
		v2, err := DecodeValue(enc)
		if err != nil {
			t.Fatalf("DecodeValue(%s) of an encoded value: %v", enc, err)
		}
		if !wire.Equal(v, v2) {
			t.Fatalf("round trip changed %#v to %#v", v, v2)
		}
		if enc2 := mustEncode(t, v2); enc2 != enc {
			t.Fatalf("encoding not canonical: %s, then %s", enc, enc2)
		}
		if f := fresh(v); !identical(f, v2) {
			t.Fatalf("fresh(%#v) = %#v, want %#v as decoded", v, f, v2)
		}
	})
}

// FuzzMarshalerRoundTrip builds an arbitrary header table from bytes and
// checks that Unmarshal followed by Marshal gives back exactly the headers
// that are not broker-owned nor reserved, without modifying the delivery; and
// that the retry subscriber's marshaler publishes the same, less the tier
// header, and never keeps a broker-owned non-string header in its metadata.
// A copy (CopyContext) publishes, decoding nothing, the very values decoding
// its metadata gives; and fresh gives for every header value what decoding its
// encoding gives.
func FuzzMarshalerRoundTrip(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte("\x05\x01a\x11\x03\x0d\x02hi\x0b\x00\x00\x00\x00\x00\x00\xf8\x7f"))
	f.Add([]byte("\x08\x02CC\x10\x02\x0f\x01\x02\x03\x04\x05\x06\x07\x08\x0e\x03\xff\x00\x01"))
	f.Add([]byte("\x04\x07x-death\x10\x01\x11\x02\x05count\x05\x00\x00\x00\x00\x00\x00\x00\x01\x05queue\x0d\x01q"))
	f.Fuzz(func(t *testing.T, data []byte) {
		headers := (&generator{data: data}).table(0)
		d := amqp.Delivery{Headers: headers}
		msg, err := Marshaler{}.Unmarshal(d)
		if err != nil {
			t.Fatalf("Unmarshal: %v", err)
		}
		if !wire.Equal(d.Headers, (&generator{data: data}).table(0)) {
			t.Fatal("Unmarshal modified the delivery headers")
		}
		p, err := Marshaler{}.Marshal(msg)
		if err != nil {
			t.Fatalf("Marshal: %v", err)
		}
		want := amqp.Table{DefaultUUIDKey: ""}
		for k, v := range headers {
			if !keys.BrokerOwned(k) && !keys.Reserved(k) {
				want[k] = v
			}
		}
		if !wire.Equal(p.Headers, want) {
			t.Fatalf("round trip gave\n%#v\nwant\n%#v", p.Headers, want)
		}

		retry := Marshaler{Options{Retry: true, Delivered: deliveredAs("s")}}
		rmsg, err := retry.Unmarshal(d)
		if err != nil {
			t.Fatalf("retry Unmarshal: %v", err)
		}
		for k, v := range rmsg.Metadata {
			if _, isString := headers[k].(string); keys.BrokerOwned(k) && !isString {
				t.Fatalf("retry metadata keeps broker-owned %q = %q", k, v)
			}
		}
		rp, err := retry.Marshal(rmsg)
		if err != nil {
			t.Fatalf("retry Marshal: %v", err)
		}
		delete(want, keys.Tier)
		if !wire.Equal(rp.Headers, want) {
			t.Fatalf("retry round trip gave\n%#v\nwant\n%#v", rp.Headers, want)
		}

		for _, c := range []struct {
			m   Marshaler
			msg *message.Message
		}{{Marshaler{}, msg}, {retry, rmsg}} {
			cp := copyLike(c.msg)
			before := decodedSoFar()
			cpp, err := c.m.Marshal(cp)
			if err != nil {
				t.Fatalf("Marshal of a copy: %v", err)
			}
			if n := decodedSoFar() - before; n != 0 {
				t.Fatalf("Marshal of a copy decoded %d values, want 0", n)
			}
			if ref := decodingAsBefore(t, c.m, cp); !identical(cpp.Headers, ref) {
				t.Fatalf("copy gave\n%#v\nwant (decoded)\n%#v", cpp.Headers, ref)
			}
		}
		for k, v := range headers {
			if enc, err := EncodeValue(v); err == nil {
				if dec, err := DecodeValue(enc); err != nil || !identical(fresh(v), dec) {
					t.Fatalf("%s: fresh(%#v) = %#v, want %#v (%v)", k, v, fresh(v), dec, err)
				}
			}
		}
	})
}

// generator turns fuzz bytes into AMQP values of every type the typed encoding
// carries, shaped as amqp091-go decodes them: local timestamps, nil for empty
// arrays, non-nil byte slices. Table keys are valid UTF-8. (The corpus under
// testdata depends on this exact mapping: change it only with the corpus.)
type generator struct {
	data []byte
}

func (g *generator) bytes(n int) []byte {
	b := make([]byte, n)
	g.data = g.data[copy(b, g.data):]
	return b
}

func (g *generator) uint(n int) uint64 {
	var u uint64
	for _, c := range g.bytes(n) {
		u = u<<8 | uint64(c)
	}
	return u
}

func (g *generator) string() string {
	return string(g.bytes(int(g.uint(1) % 8)))
}

func (g *generator) table(depth int) amqp.Table {
	t := amqp.Table{}
	for n := g.uint(1) % 6; n > 0; n-- {
		t[strings.ToValidUTF8(g.string(), "?")] = g.value(depth + 1)
	}
	return t
}

func (g *generator) value(depth int) interface{} {
	kinds := uint64(18)
	if depth >= 5 {
		kinds = 16 // no more arrays and tables
	}
	switch g.uint(1) % kinds {
	case 0:
		return nil
	case 1:
		return g.uint(1)&1 == 1
	case 2:
		return int8(g.uint(1))
	case 3:
		return int16(g.uint(2))
	case 4:
		return int32(g.uint(4))
	case 5:
		return int64(g.uint(8))
	case 6:
		return int(g.uint(8))
	case 7:
		return uint8(g.uint(1))
	case 8:
		return uint16(g.uint(2))
	case 9:
		return uint32(g.uint(4))
	case 10:
		return math.Float32frombits(uint32(g.uint(4)))
	case 11:
		return math.Float64frombits(g.uint(8))
	case 12:
		return amqp.Decimal{Scale: uint8(g.uint(1)), Value: int32(g.uint(4))}
	case 13:
		return g.string()
	case 14:
		return []byte(g.string())
	case 15:
		return time.Unix(int64(g.uint(8)), 0)
	case 16:
		var a []interface{}
		for n := g.uint(1) % 4; n > 0; n-- {
			a = append(a, g.value(depth+1))
		}
		return a
	default:
		return g.table(depth)
	}
}
