package marshal

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/wire"
)

// Type tags of the metadata encoding, one per Go type produced or accepted
// by the amqp091-go table codec.
const (
	tagVoid         = "void"
	tagBool         = "bool"
	tagInt8         = "int8"
	tagInt16        = "int16"
	tagInt32        = "int32"
	tagInt64        = "int64"
	tagInt          = "int"
	tagUint8        = "uint8"
	tagUint16       = "uint16"
	tagUint32       = "uint32"
	tagFloat32      = "float32"
	tagFloat64      = "float64"
	tagDecimal      = "decimal"
	tagString       = "string"
	tagStringBase64 = "string-base64"
	tagBytes        = "bytes"
	tagTimestamp    = "timestamp"
	tagArray        = "array"
	tagTable        = "table"
)

// decimal is the JSON payload of an amqp.Decimal.
type decimal struct {
	Scale uint8 `json:"scale"`
	Value int32 `json:"value"`
}

// EncodeValue encodes an AMQP field value as JSON with type tags, so that
// DecodeValue returns a value of the same Go type and value.
//
// Every value is a JSON object with exactly one key, its type tag:
//
//	nil                 {"void":null}
//	bool                {"bool":true}
//	int8 … int64, int   {"int32":-7}
//	uint8/16/32         {"uint8":255}
//	float32, float64    {"float64":"1.5"} (a string: NaN and ±Inf have no JSON number)
//	amqp.Decimal        {"decimal":{"scale":2,"value":12345}}
//	string              {"string":"text"}, or {"string-base64":"/w=="} if not valid UTF-8
//	[]byte              {"bytes":"AAE="} (standard base64)
//	time.Time           {"timestamp":1700000000} (Unix seconds, as on the wire)
//	[]interface{}       {"array":[{"int64":1},{"string":"a"}]}
//	amqp.Table          {"table":{"count":{"int64":1}}}
//
// All NaNs decode as the same NaN; other floats, including -0, decode
// exactly. uint16 and uint32 round-trip too, although amqp091-go v1.10 neither
// reads nor publishes them. Sub-second precision of a time.Time is dropped,
// as AMQP timestamps carry whole seconds. Other types, table keys that are not valid UTF-8 and nesting
// deeper than MaxDepth give an error wrapping ErrUnsupported.
func EncodeValue(v interface{}) (string, error) {
	return encodeValue(v, "")
}

// MaxDepth is the deepest nesting of arrays and tables EncodeValue and DecodeValue
// accept. It bounds recursion on hostile input.
const MaxDepth = 64

func encodeValue(v interface{}, path string) (string, error) {
	work.encoded.Add(1)
	tree, err := encode(v, path, 0)
	if err != nil {
		return "", err
	}
	return marshalJSON(tree)
}

// DecodeValue decodes a value produced by EncodeValue. Timestamps, empty
// arrays and empty byte slices decode exactly as amqp091-go reads them off
// the wire: time.Unix(sec, 0), a nil []interface{} and a non-nil []byte{}.
// Errors wrap ErrMalformed.
func DecodeValue(s string) (interface{}, error) {
	return decodeValue(s, "")
}

// decodeValue decodes one header value, counted in the work done.
func decodeValue(s, path string) (interface{}, error) {
	work.decoded.Add(1)
	return decode([]byte(s), path, 0)
}

// work counts the header values encoded and decoded by this process.
var work struct{ encoded, decoded atomic.Int64 }

// WorkDone returns how many header values this process encoded into metadata
// (Unmarshal, EncodeValue) and decoded back (Marshal, Header, DecodeValue): what a
// test of the failure path's work per copy reads.
func WorkDone() (encoded, decoded int64) {
	return work.encoded.Load(), work.decoded.Load()
}

// TypeName names the AMQP-relevant type of v, using the encoding's tags.
func TypeName(v interface{}) string {
	switch v.(type) {
	case nil:
		return tagVoid
	case bool:
		return tagBool
	case int8:
		return tagInt8
	case int16:
		return tagInt16
	case int32:
		return tagInt32
	case int64:
		return tagInt64
	case int:
		return tagInt
	case uint8:
		return tagUint8
	case uint16:
		return tagUint16
	case uint32:
		return tagUint32
	case float32:
		return tagFloat32
	case float64:
		return tagFloat64
	case amqp.Decimal:
		return tagDecimal
	case string:
		return tagString
	case []byte:
		return tagBytes
	case time.Time:
		return tagTimestamp
	case []interface{}:
		return tagArray
	case amqp.Table:
		return tagTable
	}
	return fmt.Sprintf("%T", v)
}

// encode turns v into a tree that encoding/json marshals to its tagged form.
// depth is the number of arrays and tables v is nested in.
func encode(v interface{}, path string, depth int) (interface{}, error) {
	var payload interface{}
	switch x := v.(type) {
	case nil, bool, int8, int16, int32, int64, int, uint8, uint16, uint32:
		payload = x
	case float32:
		payload = strconv.FormatFloat(float64(x), 'g', -1, 32)
	case float64:
		payload = strconv.FormatFloat(x, 'g', -1, 64)
	case amqp.Decimal:
		payload = decimal{Scale: x.Scale, Value: x.Value}
	case string:
		if !utf8.ValidString(x) {
			return map[string]interface{}{tagStringBase64: base64.StdEncoding.EncodeToString([]byte(x))}, nil
		}
		payload = x
	case []byte:
		payload = base64.StdEncoding.EncodeToString(x)
	case time.Time:
		payload = x.Unix()
	case []interface{}:
		if depth == MaxDepth {
			return nil, wire.PathError(wire.ErrUnsupported, path, "nesting deeper than %d", MaxDepth)
		}
		elems := make([]interface{}, len(x))
		for i, e := range x {
			var err error
			if elems[i], err = encode(e, IndexPath(path, i), depth+1); err != nil {
				return nil, err
			}
		}
		payload = elems
	case amqp.Table:
		if depth == MaxDepth {
			return nil, wire.PathError(wire.ErrUnsupported, path, "nesting deeper than %d", MaxDepth)
		}
		fields := make(map[string]interface{}, len(x))
		for k, e := range x {
			if !utf8.ValidString(k) {
				return nil, wire.PathError(wire.ErrUnsupported, path, "table key %q is not valid utf-8", k)
			}
			var err error
			if fields[k], err = encode(e, FieldPath(path, k), depth+1); err != nil {
				return nil, err
			}
		}
		payload = fields
	default:
		return nil, wire.PathError(wire.ErrUnsupported, path, "type %T", v)
	}
	return map[string]interface{}{TypeName(v): payload}, nil
}

// decode is the inverse of encode.
func decode(data []byte, path string, depth int) (interface{}, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(data, &obj); err != nil {
		return nil, wire.PathError(wire.ErrMalformed, path, "%v", err)
	}
	if len(obj) != 1 {
		return nil, wire.PathError(wire.ErrMalformed, path, "want an object with exactly one type tag, got %d keys", len(obj))
	}
	var tag string
	var payload json.RawMessage
	for tag, payload = range obj { // the only entry
	}
	v, err := decodeTagged(tag, payload, path, depth)
	if err != nil {
		return nil, err
	}
	return v, nil
}

func decodeTagged(tag string, payload json.RawMessage, path string, depth int) (interface{}, error) {
	switch tag {
	case tagVoid:
		if !isNull(payload) {
			return nil, wire.PathError(wire.ErrMalformed, path, "%s: want null", tag)
		}
		return nil, nil
	case tagBool:
		return scalar[bool](tag, payload, path)
	case tagInt8:
		return scalar[int8](tag, payload, path)
	case tagInt16:
		return scalar[int16](tag, payload, path)
	case tagInt32:
		return scalar[int32](tag, payload, path)
	case tagInt64:
		return scalar[int64](tag, payload, path)
	case tagInt:
		return scalar[int](tag, payload, path)
	case tagUint8:
		return scalar[uint8](tag, payload, path)
	case tagUint16:
		return scalar[uint16](tag, payload, path)
	case tagUint32:
		return scalar[uint32](tag, payload, path)
	case tagFloat32:
		f, err := float(tag, payload, path, 32)
		return float32(f), err
	case tagFloat64:
		return float(tag, payload, path, 64)
	case tagDecimal:
		d, err := scalar[decimal](tag, payload, path)
		return amqp.Decimal{Scale: d.Scale, Value: d.Value}, err
	case tagString:
		return scalar[string](tag, payload, path)
	case tagStringBase64:
		b, err := base64Bytes(tag, payload, path)
		return string(b), err
	case tagBytes:
		return base64Bytes(tag, payload, path)
	case tagTimestamp:
		sec, err := scalar[int64](tag, payload, path)
		return time.Unix(sec, 0), err
	case tagArray:
		if depth == MaxDepth {
			return nil, wire.PathError(wire.ErrMalformed, path, "nesting deeper than %d", MaxDepth)
		}
		elems, err := scalar[[]json.RawMessage](tag, payload, path)
		if err != nil || len(elems) == 0 {
			return []interface{}(nil), err
		}
		arr := make([]interface{}, len(elems))
		for i, e := range elems {
			if arr[i], err = decode(e, IndexPath(path, i), depth+1); err != nil {
				return nil, err
			}
		}
		return arr, nil
	case tagTable:
		if depth == MaxDepth {
			return nil, wire.PathError(wire.ErrMalformed, path, "nesting deeper than %d", MaxDepth)
		}
		fields, err := scalar[map[string]json.RawMessage](tag, payload, path)
		if err != nil {
			return nil, err
		}
		table := make(amqp.Table, len(fields))
		for k, e := range fields {
			if table[k], err = decode(e, FieldPath(path, k), depth+1); err != nil {
				return nil, err
			}
		}
		return table, nil
	}
	return nil, wire.PathError(wire.ErrMalformed, path, "unknown type tag %q", tag)
}

// scalar unmarshals the non-null payload into a T. encoding/json rejects
// numbers out of T's range and fractions for integer types.
func scalar[T any](tag string, payload json.RawMessage, path string) (T, error) {
	var v T
	if isNull(payload) {
		return v, wire.PathError(wire.ErrMalformed, path, "%s: want a value, got null", tag)
	}
	if err := json.Unmarshal(payload, &v); err != nil {
		return v, wire.PathError(wire.ErrMalformed, path, "%s: %v", tag, err)
	}
	return v, nil
}

func float(tag string, payload json.RawMessage, path string, bitSize int) (float64, error) {
	s, err := scalar[string](tag, payload, path)
	if err != nil {
		return 0, err
	}
	f, err := strconv.ParseFloat(s, bitSize)
	if err != nil {
		return 0, wire.PathError(wire.ErrMalformed, path, "%s: %v", tag, err)
	}
	return f, nil
}

func base64Bytes(tag string, payload json.RawMessage, path string) ([]byte, error) {
	s, err := scalar[string](tag, payload, path)
	if err != nil {
		return nil, err
	}
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return nil, wire.PathError(wire.ErrMalformed, path, "%s: %v", tag, err)
	}
	return b, nil
}

func isNull(payload json.RawMessage) bool {
	return bytes.Equal(bytes.TrimSpace(payload), []byte("null"))
}

// IndexPath is path[i].
func IndexPath(path string, i int) string {
	return path + "[" + strconv.Itoa(i) + "]"
}

// FieldPath is path.key (key alone at the top).
func FieldPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// marshalJSON marshals v without escaping <, > and &, which would only hurt
// readability: the result is never embedded in HTML.
func marshalJSON(v interface{}) (string, error) {
	var b strings.Builder
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return "", fmt.Errorf("%w: %v", wire.ErrUnsupported, err)
	}
	return strings.TrimSuffix(b.String(), "\n"), nil
}
