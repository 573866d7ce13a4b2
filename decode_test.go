package amqpretry_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/amqpretry/amqpretry"
)

// TestDecisionOfUndecodable: an error of a payload that can never decode, anywhere in
// the chain, is permanent: encoding/json's syntax and type errors, protobuf-go's
// errors (Undecodable says so); not json's other errors, nor an error that only says
// "proto:".
func TestDecisionOfUndecodable(t *testing.T) {
	var o struct{ Amount int }
	syntax := json.Unmarshal([]byte(`{"Amount": `), &o)
	typ := json.Unmarshal([]byte(`{"Amount": "ten"}`), &o)
	invalid := error(&json.InvalidUnmarshalError{Type: reflect.TypeOf(o)}) // json.Unmarshal's of a non-pointer: a bug of the code, not of the payload
	wire := proto.Unmarshal([]byte{0xff, 0xff}, &wrapperspb.StringValue{})
	pjson := protojson.Unmarshal([]byte(`{"value": 7}`), &wrapperspb.StringValue{})
	for _, err := range []error{syntax, typ, invalid, wire, pjson} {
		if err == nil {
			t.Fatal("a payload meant not to decode decoded")
		}
	}
	if !errors.Is(wire, proto.Error) || !errors.Is(pjson, proto.Error) {
		t.Fatalf("protobuf's errors are not proto.Error: %v, %v", wire, pjson)
	}
	for _, tt := range []struct {
		name string
		err  error
		want amqpretry.Decision
	}{
		{"json syntax", syntax, amqpretry.Decision{Permanent: true, Undecodable: true}},
		{"json syntax, wrapped", fmt.Errorf("order event: %w", syntax), amqpretry.Decision{Permanent: true, Undecodable: true}},
		{"json type, joined", errors.Join(errors.New("order event"), typ), amqpretry.Decision{Permanent: true, Undecodable: true}},
		{"json type, retry after", amqpretry.RetryAfter(fmt.Errorf("x: %w", typ), 5), amqpretry.Decision{Permanent: true, Undecodable: true, Delay: 5}},
		{"json invalid unmarshal", invalid, amqpretry.Decision{}},
		{"protobuf wire", fmt.Errorf("event: %w", wire), amqpretry.Decision{Permanent: true, Undecodable: true}},
		{"protobuf json", errors.Join(errors.New("event"), pjson), amqpretry.Decision{Permanent: true, Undecodable: true}},
		{"only says proto", errors.New("proto: cannot parse invalid wire-format data"), amqpretry.Decision{}},
	} {
		if got := amqpretry.DecisionOf(tt.err); got != tt.want {
			t.Errorf("%s: DecisionOf(%v) = %+v, want %+v", tt.name, tt.err, got, tt.want)
		}
	}
}
