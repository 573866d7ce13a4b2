package wire

import (
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// nested returns v inside n tables.
func nested(n int, v interface{}) interface{} {
	for range n {
		v = amqp.Table{"k": v}
	}
	return v
}

func TestSize(t *testing.T) {
	for _, table := range []amqp.Table{
		{},
		{"s": "x", "b": []byte{1, 2}, "n": nil, "i": 7, "t": true},
		{"a": []interface{}{int8(-1), byte(2), int16(3), int32(4), int64(5), float32(1.5), 2.5, amqp.Decimal{Scale: 2, Value: 7}, time.Unix(9, 0), []interface{}{}}},
		{"deep": nested(10, amqp.Table{"x": "y"})},
	} {
		b, err := AppendTable(nil, table)
		if err != nil {
			t.Fatal(err)
		}
		n, err := Size(table)
		if err != nil || n != len(b) {
			t.Errorf("Size(%v) = %d, %v; the encoding has %d bytes", table, n, err, len(b))
		}
	}
	if _, err := Size(amqp.Table{"u": uint64(1)}); !errors.Is(err, ErrUnsupported) {
		t.Errorf("Size of a uint64: %v, want ErrUnsupported", err)
	}
}

// FuzzWireTable feeds arbitrary bytes to the wire-table reader: it must not panic, its
// errors wrap ErrMalformed, what it reads encodes and reads back to the same table,
// and Size agrees with the encoding.
func FuzzWireTable(f *testing.F) {
	for _, t := range []amqp.Table{
		{},
		{"\xff": int64(1), "s": "x", "b": []byte{1}, "n": nil},
		{"a": []interface{}{int8(-1), byte(2), int16(3), int32(4), float32(1.5), 2.5, amqp.Decimal{Scale: 2, Value: 7}, time.Unix(9, 0), true}},
		{"deep": nested(70, amqp.Table{})},
	} {
		b, err := AppendTable(nil, t)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0, 0, 0, 3, 1, 'k', 'Z'})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		table, err := ParseTable(data)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		b, err := AppendTable(nil, table)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		if n, err := Size(table); err != nil || n != len(b) {
			t.Fatalf("Size = %d, %v; the encoding has %d bytes", n, err, len(b))
		}
		again, err := ParseTable(b)
		if err != nil {
			t.Fatalf("read back: %v", err)
		}
		if !Equal(again, table) {
			t.Fatalf("read back\n%#v\nwant\n%#v", again, table)
		}
	})
}
