// Package wire is the AMQP 0-9-1 field-table wire codec, as amqp091-go writes and
// reads it: the marshaler carries headers that the typed metadata encoding cannot
// (package xdeath), and the hand-off sizes a header frame before it sends one.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

var (
	// ErrMalformed is wrapped by every error about input that does not have the
	// expected shape (xdeath exports it).
	ErrMalformed = errors.New("malformed value")
	// ErrUnsupported is wrapped by every error about a value that has no AMQP field
	// encoding.
	ErrUnsupported = errors.New("unsupported value")
)

// PathError wraps sentinel with the location of the offending value, for example
// "malformed value: x-death[1].count: want integer, got string".
func PathError(sentinel error, path, format string, args ...interface{}) error {
	msg := fmt.Sprintf(format, args...)
	if path == "" {
		return fmt.Errorf("%w: %s", sentinel, msg)
	}
	return fmt.Errorf("%w: %s: %s", sentinel, path, msg)
}

// Size returns the number of bytes t takes on the wire as an AMQP field table, its
// 4-byte length included, as amqp091-go encodes it, by adding up the lengths without
// encoding anything. It fails for a value of a Go type amqp091-go cannot publish.
func Size(t amqp.Table) (int, error) {
	n := 4
	for k, v := range t {
		if len(k) > math.MaxUint8 {
			return 0, PathError(ErrUnsupported, k, "table key longer than 255 bytes")
		}
		if s, ok := v.(string); ok { // most headers: sized here, as fieldSize would
			n += 1 + len(k) + 5 + len(s)
			continue
		}
		fn, err := fieldSize(v)
		if err != nil {
			return 0, err
		}
		n += 1 + len(k) + fn
	}
	return n, nil
}

// fieldSize is the size of v as appendField writes it, its type byte included.
func fieldSize(v interface{}) (int, error) {
	switch x := v.(type) {
	case nil:
		return 1, nil
	case bool, byte, int8:
		return 2, nil
	case int16:
		return 3, nil
	case int, int32, float32:
		return 5, nil
	case int64, float64, time.Time:
		return 9, nil
	case amqp.Decimal:
		return 6, nil
	case string:
		return 5 + len(x), nil
	case []byte:
		return 5 + len(x), nil
	case []interface{}:
		n := 5
		for _, e := range x {
			en, err := fieldSize(e)
			if err != nil {
				return 0, err
			}
			n += en
		}
		return n, nil
	case amqp.Table:
		n, err := Size(x)
		return 1 + n, err
	}
	return 0, PathError(ErrUnsupported, "", "type %T has no AMQP field encoding", v)
}

// AppendTable appends the wire encoding of t (length, then entries in key order).
func AppendTable(b []byte, t amqp.Table) ([]byte, error) {
	start := len(b)
	b = append(b, 0, 0, 0, 0)
	keys := make([]string, 0, len(t))
	for k := range t {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if len(k) > math.MaxUint8 {
			return nil, PathError(ErrUnsupported, k, "table key longer than 255 bytes")
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
		return AppendTable(append(b, 'F'), x)
	}
	return nil, PathError(ErrUnsupported, "", "type %T has no AMQP field encoding", v)
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

// ParseTable reads one field table that fills b exactly. Errors wrap ErrMalformed.
func ParseTable(b []byte) (amqp.Table, error) {
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

// Integer converts an AMQP table integer of any width (any Go integer type) to int64,
// if it fits.
func Integer(v any) (int64, bool) {
	switch n := v.(type) {
	case int8:
		return int64(n), true
	case int16:
		return int64(n), true
	case int32:
		return int64(n), true
	case int64:
		return n, true
	case int:
		return int64(n), true
	case uint8:
		return int64(n), true
	case uint16:
		return int64(n), true
	case uint32:
		return int64(n), true
	case uint:
		return int64(n), n <= math.MaxInt64
	case uint64:
		return int64(n), n <= math.MaxInt64
	}
	return 0, false
}

// Equal reports whether a and b are the same AMQP field value: reflect.DeepEqual,
// except that NaNs are equal and floats are otherwise compared bit by bit, telling 0
// from -0.
func Equal(a, b interface{}) bool {
	switch x := a.(type) {
	case float32:
		y, ok := b.(float32)
		return ok && (math.Float32bits(x) == math.Float32bits(y) || math.IsNaN(float64(x)) && math.IsNaN(float64(y)))
	case float64:
		y, ok := b.(float64)
		return ok && (math.Float64bits(x) == math.Float64bits(y) || math.IsNaN(x) && math.IsNaN(y))
	case []interface{}:
		y, ok := b.([]interface{})
		if !ok || len(x) != len(y) || (x == nil) != (y == nil) {
			return false
		}
		for i := range x {
			if !Equal(x[i], y[i]) {
				return false
			}
		}
		return true
	case amqp.Table:
		y, ok := b.(amqp.Table)
		if !ok || len(x) != len(y) || (x == nil) != (y == nil) {
			return false
		}
		for k, v := range x {
			w, ok := y[k]
			if !ok || !Equal(v, w) {
				return false
			}
		}
		return true
	}
	return reflect.DeepEqual(a, b)
}
