package xdeath

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// This file is the AMQP 0-9-1 field-table wire codec, as amqp091-go writes and reads
// it. Marshaler uses it for the headers the typed metadata encoding cannot carry
// (RawHeadersKey), and WireSize for the size of a header frame.

// WireSize returns the number of bytes t takes on the wire as an AMQP field table,
// its 4-byte length included, as amqp091-go encodes it. It fails for a value of a Go
// type amqp091-go cannot publish.
func WireSize(t amqp.Table) (int, error) {
	buf := wireBuffers.Get().(*[]byte)
	b, err := appendTable((*buf)[:0], t)
	n := len(b)
	if cap(b) <= 1<<20 { // do not keep a huge table's buffer
		*buf = b
	}
	wireBuffers.Put(buf)
	return n, err
}

// wireBuffers keeps WireSize, called on every hand-off, from allocating.
var wireBuffers = sync.Pool{New: func() any { b := make([]byte, 0, 4096); return &b }}

// appendTable appends the wire encoding of t (length, then entries in key order).
func appendTable(b []byte, t amqp.Table) ([]byte, error) {
	start := len(b)
	b = append(b, 0, 0, 0, 0)
	keys := make([]string, 0, len(t))
	for k := range t {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if len(k) > math.MaxUint8 {
			return nil, pathError(ErrUnsupported, k, "table key longer than 255 bytes")
		}
		b = append(b, byte(len(k)))
		b = append(b, k...)
		var err error
		if b, err = appendField(b, t[k]); err != nil {
			return nil, err
		}
	}
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-4))
	return b, nil
}

// appendField appends the type byte and value of v, as amqp091-go's writeField does.
func appendField(b []byte, v interface{}) ([]byte, error) {
	switch x := v.(type) {
	case nil:
		return append(b, 'V'), nil
	case bool:
		if x {
			return append(b, 't', 1), nil
		}
		return append(b, 't', 0), nil
	case byte:
		return append(b, 'B', x), nil
	case int8:
		return append(b, 'b', byte(x)), nil
	case int16:
		return binary.BigEndian.AppendUint16(append(b, 's'), uint16(x)), nil
	case int:
		return binary.BigEndian.AppendUint32(append(b, 'I'), uint32(x)), nil
	case int32:
		return binary.BigEndian.AppendUint32(append(b, 'I'), uint32(x)), nil
	case int64:
		return binary.BigEndian.AppendUint64(append(b, 'l'), uint64(x)), nil
	case float32:
		return binary.BigEndian.AppendUint32(append(b, 'f'), math.Float32bits(x)), nil
	case float64:
		return binary.BigEndian.AppendUint64(append(b, 'd'), math.Float64bits(x)), nil
	case amqp.Decimal:
		return binary.BigEndian.AppendUint32(append(b, 'D', x.Scale), uint32(x.Value)), nil
	case string:
		return append(binary.BigEndian.AppendUint32(append(b, 'S'), uint32(len(x))), x...), nil
	case []byte:
		return append(binary.BigEndian.AppendUint32(append(b, 'x'), uint32(len(x))), x...), nil
	case time.Time:
		return binary.BigEndian.AppendUint64(append(b, 'T'), uint64(x.Unix())), nil
	case []interface{}:
		start := len(b) + 1
		b = append(b, 'A', 0, 0, 0, 0)
		for _, e := range x {
			var err error
			if b, err = appendField(b, e); err != nil {
				return nil, err
			}
		}
		binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-4))
		return b, nil
	case amqp.Table:
		return appendTable(append(b, 'F'), x)
	}
	return nil, pathError(ErrUnsupported, "", "type %T has no AMQP field encoding", v)
}

// wireReader reads what appendTable wrote. Every read is bounds-checked: the input
// comes from metadata that anyone may have changed.
type wireReader struct{ b []byte }

func (r *wireReader) take(n int) ([]byte, error) {
	if n < 0 || n > len(r.b) {
		return nil, fmt.Errorf("%w: wire table: want %d bytes, have %d", ErrMalformed, n, len(r.b))
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v, nil
}

func (r *wireReader) uint32() (uint32, error) {
	v, err := r.take(4)
	if err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint32(v), nil
}

// sized returns a reader over the next length-prefixed section.
func (r *wireReader) sized() (*wireReader, error) {
	n, err := r.uint32()
	if err != nil {
		return nil, err
	}
	if uint64(n) > uint64(len(r.b)) {
		return nil, fmt.Errorf("%w: wire table: section of %d bytes, have %d", ErrMalformed, n, len(r.b))
	}
	v, err := r.take(int(n))
	return &wireReader{v}, err
}

// parseTable reads one field table that fills b exactly.
func parseTable(b []byte) (amqp.Table, error) {
	r := &wireReader{b}
	t, err := r.table()
	if err == nil && len(r.b) > 0 {
		err = fmt.Errorf("%w: wire table: %d bytes after the table", ErrMalformed, len(r.b))
	}
	return t, err
}

func (r *wireReader) table() (amqp.Table, error) {
	sec, err := r.sized()
	if err != nil {
		return nil, err
	}
	t := amqp.Table{}
	for len(sec.b) > 0 {
		n, err := sec.take(1)
		if err != nil {
			return nil, err
		}
		key, err := sec.take(int(n[0]))
		if err != nil {
			return nil, err
		}
		if t[string(key)], err = sec.field(); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// field reads one typed value into the Go type amqp091-go's readField gives.
func (r *wireReader) field() (interface{}, error) {
	kind, err := r.take(1)
	if err != nil {
		return nil, err
	}
	fixed := map[byte]int{'t': 1, 'B': 1, 'b': 1, 's': 2, 'I': 4, 'l': 8, 'f': 4, 'd': 8, 'D': 5, 'T': 8}
	if n, ok := fixed[kind[0]]; ok {
		v, err := r.take(n)
		if err != nil {
			return nil, err
		}
		switch kind[0] {
		case 't':
			return v[0] != 0, nil
		case 'B':
			return v[0], nil
		case 'b':
			return int8(v[0]), nil
		case 's':
			return int16(binary.BigEndian.Uint16(v)), nil
		case 'I':
			return int32(binary.BigEndian.Uint32(v)), nil
		case 'l':
			return int64(binary.BigEndian.Uint64(v)), nil
		case 'f':
			return math.Float32frombits(binary.BigEndian.Uint32(v)), nil
		case 'd':
			return math.Float64frombits(binary.BigEndian.Uint64(v)), nil
		case 'D':
			return amqp.Decimal{Scale: v[0], Value: int32(binary.BigEndian.Uint32(v[1:]))}, nil
		default: // 'T'
			return time.Unix(int64(binary.BigEndian.Uint64(v)), 0), nil
		}
	}
	switch kind[0] {
	case 'V':
		return nil, nil
	case 'S', 'x':
		sec, err := r.sized()
		if err != nil {
			return nil, err
		}
		if kind[0] == 'S' {
			return string(sec.b), nil
		}
		return slices.Clone(sec.b), nil
	case 'A':
		sec, err := r.sized()
		if err != nil {
			return nil, err
		}
		var arr []interface{}
		for len(sec.b) > 0 {
			v, err := sec.field()
			if err != nil {
				return nil, err
			}
			arr = append(arr, v)
		}
		return arr, nil
	case 'F':
		return r.table()
	}
	return nil, fmt.Errorf("%w: wire table: unknown field type %q", ErrMalformed, kind[0])
}
