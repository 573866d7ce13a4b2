package xdeath

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/wire"
)

// header returns the AMQP header key from metadata Marshaler.Unmarshal produced,
// decoded to its original type (marshal.Header).
func header(md message.Metadata, key string) (any, bool, error) {
	typed, err := marshal.TypedKeys(md)
	if err != nil {
		return nil, false, err
	}
	return marshal.Header(md, typed, key)
}

func TestHeader(t *testing.T) {
	md := message.Metadata{
		keys.XDeliveryCount: `{"int64":2}`,
		"plain":             `{"int64":2}`,
		"broken":            `{"int64":"2"}`,
		keys.Subscriber:     `{"int64":3}`,
		keys.TypedHeaders:   `["broken","x-delivery-count","amqpretry-subscriber","listed-but-gone"]`,
	}
	tests := []struct {
		key    string
		want   interface{}
		wantOK bool
	}{
		{keys.XDeliveryCount, int64(2), true},
		{"plain", `{"int64":2}`, true},
		{"absent", nil, false},
		{"listed-but-gone", nil, false},
		// A reserved key is never decoded, even if the list names it.
		{keys.Subscriber, `{"int64":3}`, true},
	}
	for _, tt := range tests {
		got, ok, err := header(md, tt.key)
		if err != nil || ok != tt.wantOK || !reflect.DeepEqual(got, tt.want) {
			t.Errorf("Header(%q) = %#v, %v, %v; want %#v, %v, nil", tt.key, got, ok, err, tt.want, tt.wantOK)
		}
	}
	if v, ok, err := header(md, "broken"); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "broken: int64") || v != nil || ok {
		t.Errorf("Header(broken) = %#v, %v, %v; want nil, false, ErrMalformed naming the key", v, ok, err)
	}
	if _, _, err := header(message.Metadata{keys.TypedHeaders: "["}, "x"); !errors.Is(err, ErrMalformed) {
		t.Errorf("Header with a malformed typed list: %v, want ErrMalformed", err)
	}
}

// TestHeaderAfterUnmarshal reads every header type back with its original type.
func TestHeaderAfterUnmarshal(t *testing.T) {
	msg, err := Marshaler{}.Unmarshal(delivery())
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range deliveryHeaders() {
		if keys.Reserved(k) || k == "_watermill_message_uuid" {
			continue
		}
		got, ok, err := header(msg.Metadata, k)
		if err != nil || !ok {
			t.Errorf("Header(%q) = %v, %v", k, ok, err)
			continue
		}
		if !wire.Equal(got, want) {
			t.Errorf("Header(%q) = %#v, want %#v", k, got, want)
		}
	}
	if v, ok, err := header(msg.Metadata, keys.Subscriber); ok || err != nil {
		t.Errorf("Header of a reserved key that arrived as a header: %#v, %v, %v", v, ok, err)
	}
}
