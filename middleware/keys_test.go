package middleware_test

import (
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/middleware"
)

// TestEnvelopeKeys: a full envelope writes one key per field, and every one is a key
// of the envelope's one list (InEnvelope), which the engine asks (rather than writing
// an envelope into a scratch map) to tell the envelope's headers from the message's
// own; the list has one key per field, each once, and none of the library's other keys.
func TestEnvelopeKeys(t *testing.T) {
	at := time.Unix(1_700_000_000, 0)
	env := middleware.Envelope{
		Attempt: 2, MaxAttempts: 5, Reason: amqpretry.ReasonPermanent, Error: "e", ErrorTypes: []string{"*errors.errorString"}, Stack: "s",
		FirstFailure: at, LastFailure: at, Handler: "h", Topic: "t", Queue: "q",
		OriginalExchange: "x", OriginalRoutingKey: "k", RequestedDelay: time.Second, EffectiveDelay: time.Second, Due: at,
		DroppedHeaders: "big (9 bytes)", RedrivenAt: at, Redriven: 1, RedrivenFrom: "p",
	}
	if v := reflect.ValueOf(env); !v.IsZero() {
		for i := range v.NumField() {
			if v.Field(i).IsZero() {
				t.Fatalf("test envelope leaves %s zero: set every field", v.Type().Field(i).Name)
			}
		}
	}
	md := message.Metadata{}
	env.Write(md)
	if want := reflect.TypeOf(env).NumField(); len(md) != want {
		t.Errorf("a full envelope wrote %d keys, want one per field (%d): %v", len(md), want, md)
	}
	for k := range md {
		if !middleware.InEnvelope(k) {
			t.Errorf("the envelope writes %q, which its list does not have", k)
		}
	}
	for _, k := range []string{keys.ParkUntil, keys.TypedHeaders, keys.Subscriber, "amqpretry-other", "traceparent"} {
		if middleware.InEnvelope(k) {
			t.Errorf("InEnvelope(%q) = true, want false", k)
		}
	}
	list := middleware.EnvelopeKeys()
	if len(list) != len(md) || len(slices.Compact(slices.Sorted(slices.Values(list)))) != len(list) {
		t.Errorf("the envelope's list has %d keys %v, want each of the %d written once", len(list), list, len(md))
	}
}
