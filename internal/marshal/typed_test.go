package marshal

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/wire"
)

var t1 = time.Unix(1700000000, 0) // as amqp091-go decodes timestamps: local time

// rejectedOnce is an x-death entry as RabbitMQ writes it when a consumer
// rejects a message from queue "orders".
func rejectedOnce() amqp.Table {
	return amqp.Table{
		"count":        int64(1),
		"exchange":     "shop",
		"queue":        "orders",
		"reason":       "rejected",
		"routing-keys": []interface{}{"order.created"},
		"time":         t1,
	}
}

func TestEncodeValueRoundTrip(t *testing.T) {
	tests := []struct {
		name    string
		value   interface{}
		encoded string
	}{
		{"nil", nil, `{"void":null}`},
		{"bool", true, `{"bool":true}`},
		{"int8", int8(math.MinInt8), `{"int8":-128}`},
		{"int16", int16(math.MaxInt16), `{"int16":32767}`},
		{"int32", int32(-7), `{"int32":-7}`},
		{"int64 beyond float64 precision", int64(math.MaxInt64), `{"int64":9223372036854775807}`},
		{"int", -42, `{"int":-42}`},
		{"uint8", byte(255), `{"uint8":255}`},
		{"uint16", uint16(math.MaxUint16), `{"uint16":65535}`},
		{"uint32", uint32(math.MaxUint32), `{"uint32":4294967295}`},
		{"float32", float32(0.1), `{"float32":"0.1"}`},
		{"float64", 1.5e300, `{"float64":"1.5e+300"}`},
		{"negative zero", math.Copysign(0, -1), `{"float64":"-0"}`},
		{"NaN", math.NaN(), `{"float64":"NaN"}`},
		{"infinity", float32(math.Inf(-1)), `{"float32":"-Inf"}`},
		{"decimal", amqp.Decimal{Scale: 2, Value: -12345}, `{"decimal":{"scale":2,"value":-12345}}`},
		{"string", `<a href="x">&</a>`, `{"string":"<a href=\"x\">&</a>"}`},
		{"empty string", "", `{"string":""}`},
		{"string not UTF-8", "\xff\x00a", `{"string-base64":"/wBh"}`},
		{"bytes", []byte{0, 1, 0xff}, `{"bytes":"AAH/"}`},
		{"empty bytes", []byte{}, `{"bytes":""}`},
		{"timestamp", t1, `{"timestamp":1700000000}`},
		{"timestamp before 1970", time.Unix(-1, 0), `{"timestamp":-1}`},
		{"empty array as amqp091-go reads it", []interface{}(nil), `{"array":[]}`},
		{"array", []interface{}{"a", int64(1), nil}, `{"array":[{"string":"a"},{"int64":1},{"void":null}]}`},
		{"empty table", amqp.Table{}, `{"table":{}}`},
		{
			"x-death",
			[]interface{}{rejectedOnce()},
			`{"array":[{"table":{"count":{"int64":1},"exchange":{"string":"shop"},"queue":{"string":"orders"},` +
				`"reason":{"string":"rejected"},"routing-keys":{"array":[{"string":"order.created"}]},"time":{"timestamp":1700000000}}}]}`,
		},
		{
			"nested",
			amqp.Table{"t": amqp.Table{"a": []interface{}{amqp.Table{"deep": []interface{}{float32(2)}}}}, "": "empty key"},
			`{"table":{"":{"string":"empty key"},"t":{"table":{"a":{"array":[{"table":{"deep":{"array":[{"float32":"2"}]}}}]}}}}}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := EncodeValue(tt.value)
			if err != nil {
				t.Fatalf("EncodeValue: %v", err)
			}
			if s != tt.encoded {
				t.Errorf("EncodeValue = %s, want %s", s, tt.encoded)
			}
			got, err := DecodeValue(s)
			if err != nil {
				t.Fatalf("DecodeValue: %v", err)
			}
			if !wire.Equal(got, tt.value) {
				t.Errorf("DecodeValue = %#v, want %#v", got, tt.value)
			}
		})
	}
}

func TestEncodeValueNormalizes(t *testing.T) {
	tests := []struct {
		name  string
		value interface{}
		want  interface{}
	}{
		// The wire drops sub-second precision and the time zone, and
		// amqp091-go decodes timestamps as time.Unix(sec, 0).
		{name: "timestamp", value: time.Date(2023, 11, 14, 22, 13, 20, 999, time.UTC), want: t1},
		// The wire cannot tell a nil []byte from an empty one; amqp091-go
		// reads an empty non-nil slice.
		{name: "nil bytes", value: []byte(nil), want: []byte{}},
		{name: "empty array", value: []interface{}{}, want: []interface{}(nil)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := EncodeValue(tt.value)
			if err != nil {
				t.Fatal(err)
			}
			got, err := DecodeValue(s)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("round trip of %#v = %#v, want %#v", tt.value, got, tt.want)
			}
		})
	}
}

func TestEncodeValueUnsupported(t *testing.T) {
	cyclic := amqp.Table{}
	cyclic["self"] = cyclic
	tests := []struct {
		name  string
		value interface{}
		want  string
	}{
		{"uint64", uint64(1), "type uint64"},
		{"plain map", map[string]interface{}{}, "type map[string]interface {}"},
		{"nested", amqp.Table{"a": []interface{}{int64(1), struct{}{}}}, "a[1]: type struct {}"},
		{"key not UTF-8", amqp.Table{"ok": amqp.Table{"\xff": 1}}, `ok: table key "\xff" is not valid utf-8`},
		{"too deep", nestArrays(MaxDepth + 1), strings.Repeat("[0]", MaxDepth) + ": nesting deeper than 64"},
		{"cycle", cyclic, strings.Repeat(".self", MaxDepth)[1:] + ": nesting deeper than 64"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := EncodeValue(tt.value)
			if !errors.Is(err, wire.ErrUnsupported) {
				t.Fatalf("EncodeValue error = %v, want ErrUnsupported", err)
			}
			if want := "unsupported value: " + tt.want; err.Error() != want {
				t.Errorf("EncodeValue error = %q, want %q", err, want)
			}
		})
	}
}

// nestArrays returns n arrays nested in each other.
func nestArrays(n int) interface{} {
	v := []interface{}(nil)
	for i := 1; i < n; i++ {
		v = []interface{}{v}
	}
	return v
}

func TestMaxDepth(t *testing.T) {
	s, err := EncodeValue(nestArrays(MaxDepth))
	if err != nil {
		t.Fatalf("EncodeValue at MaxDepth: %v", err)
	}
	if _, err := DecodeValue(s); err != nil {
		t.Fatalf("DecodeValue at MaxDepth: %v", err)
	}
	deeper := `{"array":[` + s + `]}`
	if _, err := DecodeValue(deeper); !errors.Is(err, wire.ErrMalformed) || !strings.HasSuffix(err.Error(), "nesting deeper than 64") {
		t.Errorf("DecodeValue beyond MaxDepth error = %v", err)
	}
	hostile := strings.Repeat(`{"table":{"a":`, 100000) + `{"void":null}` + strings.Repeat("}}", 100000)
	if _, err := DecodeValue(hostile); !errors.Is(err, wire.ErrMalformed) {
		t.Errorf("DecodeValue of 100000 nested tables error = %v", err)
	}
}

func TestDecodeValueMalformed(t *testing.T) {
	tests := []struct {
		in   string
		want string
	}{
		{``, "unexpected end of JSON input"},
		{`null`, "want an object with exactly one type tag, got 0 keys"},
		{`[]`, "json: cannot unmarshal array into Go value of type map[string]json.RawMessage"},
		{`{}`, "want an object with exactly one type tag, got 0 keys"},
		{`{"int8":1,"int16":1}`, "want an object with exactly one type tag, got 2 keys"},
		{`{"int64":1} x`, "invalid character 'x' after top-level value"},
		{`{"uint64":1}`, `unknown type tag "uint64"`},
		{`{"void":0}`, "void: want null"},
		{`{"bool":null}`, "bool: want a value, got null"},
		{`{"int8":128}`, "int8: json: cannot unmarshal number 128 into Go value of type int8"},
		{`{"int32":1.5}`, "int32: json: cannot unmarshal number 1.5 into Go value of type int32"},
		{`{"uint8":-1}`, "uint8: json: cannot unmarshal number -1 into Go value of type uint8"},
		{`{"float64":1.5}`, "float64: json: cannot unmarshal number into Go value of type string"},
		{`{"float64":"x"}`, `float64: strconv.ParseFloat: parsing "x": invalid syntax`},
		{`{"float32":"1e39"}`, `float32: strconv.ParseFloat: parsing "1e39": value out of range`},
		{`{"decimal":[2,1]}`, "decimal: json: cannot unmarshal array into Go value of type marshal.decimal"},
		{`{"decimal":{"scale":256}}`, "decimal: json: cannot unmarshal number 256 into Go struct field decimal.scale of type uint8"},
		{`{"string":1}`, "string: json: cannot unmarshal number into Go value of type string"},
		{`{"bytes":"!"}`, "bytes: illegal base64 data at input byte 0"},
		{`{"string-base64":null}`, "string-base64: want a value, got null"},
		{`{"timestamp":"2023-11-14T22:13:20Z"}`, "timestamp: json: cannot unmarshal string into Go value of type int64"},
		{`{"array":{}}`, "array: json: cannot unmarshal object into Go value of type []json.RawMessage"},
		{`{"array":[{"int8":1},{"int8":"1"}]}`, "[1]: int8: json: cannot unmarshal string into Go value of type int8"},
		{`{"table":[]}`, "table: json: cannot unmarshal array into Go value of type map[string]json.RawMessage"},
		{`{"table":{"a":{"table":{"b":{}}}}}`, "a.b: want an object with exactly one type tag, got 0 keys"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			v, err := DecodeValue(tt.in)
			if v != nil || !errors.Is(err, wire.ErrMalformed) {
				t.Fatalf("DecodeValue = %#v, %v; want nil, ErrMalformed", v, err)
			}
			if want := "malformed value: " + tt.want; err.Error() != want {
				t.Errorf("DecodeValue error = %q, want %q", err, want)
			}
		})
	}
}

func TestTypeName(t *testing.T) {
	for v, want := range map[interface{}]string{
		nil: "void", true: "bool", int8(1): "int8", int16(1): "int16", int32(1): "int32", int64(1): "int64", 1: "int",
		uint8(1): "uint8", uint16(1): "uint16", uint32(1): "uint32", float32(1): "float32", 1.0: "float64",
		amqp.Decimal{}: "decimal", "s": "string", t1: "timestamp", uint64(1): "uint64", struct{}{}: "struct {}",
	} {
		if got := TypeName(v); got != want {
			t.Errorf("TypeName(%#v) = %q, want %q", v, got, want)
		}
	}
	for v, want := range map[string]interface{}{"bytes": []byte{}, "array": []interface{}{}, "table": amqp.Table{}} {
		if got := TypeName(want); got != v {
			t.Errorf("TypeName(%#v) = %q, want %q", want, got, v)
		}
	}
}
