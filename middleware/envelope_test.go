package middleware_test

import (
	"maps"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/middleware"
)

// envelopeKeys are every key Envelope.Write may write: its one list.
var envelopeKeys = middleware.EnvelopeKeys()

// full is an envelope with every field set, within bounds.
func full() middleware.Envelope {
	at := time.Date(2026, 1, 2, 3, 4, 5, 123456789, time.UTC)
	return middleware.Envelope{
		Attempt: 3, MaxAttempts: 5, Reason: amqpretry.ReasonMaxAttempts,
		Error: "warehouse offline: é", ErrorTypes: []string{"*fmt.wrapError", "*errors.errorString"},
		Stack:        "main.handle(...)\n\t/src/main.go:12 +0x1d\n",
		FirstFailure: at, LastFailure: at.Add(time.Minute),
		Handler: "orders", Topic: "orders.created", Queue: "orders",
		OriginalExchange: "shop", OriginalRoutingKey: "order.created",
		RequestedDelay: 1500 * time.Millisecond, EffectiveDelay: 2 * time.Second, Due: at.Add(2 * time.Minute),
		DroppedHeaders: "huge (5004 bytes)",
		RedrivenAt:     at.Add(time.Hour), Redriven: 2, RedrivenFrom: "amqpretry.poison",
	}
}

func TestEnvelopeRoundTrip(t *testing.T) {
	md := message.Metadata{"user": "kept"}
	e := full()
	e.Write(md)
	if got := middleware.ReadEnvelope(md); !reflect.DeepEqual(got, e) {
		t.Errorf("ReadEnvelope(Write(e)) =\n%+v\nwant\n%+v", got, e)
	}
	want := message.Metadata{
		"user":                  "kept",
		keys.Attempt:            "3",
		keys.MaxAttempts:        "5",
		keys.PoisonReason:       "max-attempts",
		keys.Error:              "warehouse offline: é",
		keys.ErrorTypes:         "*fmt.wrapError > *errors.errorString",
		keys.Stack:              "main.handle(...)\n\t/src/main.go:12 +0x1d\n",
		keys.FirstFailure:       "2026-01-02T03:04:05.123456789Z",
		keys.LastFailure:        "2026-01-02T03:05:05.123456789Z",
		keys.Handler:            "orders",
		keys.Topic:              "orders.created",
		keys.Queue:              "orders",
		keys.OriginalExchange:   "shop",
		keys.OriginalRoutingKey: "order.created",
		keys.RequestedDelay:     "1.5s",
		keys.EffectiveDelay:     "2s",
		keys.Due:                "2026-01-02T03:06:05.123456789Z",
		keys.DroppedHeaders:     "huge (5004 bytes)",
		keys.RedrivenAt:         "2026-01-02T04:04:05.123456789Z",
		keys.RedriveCount:       "2",
		keys.RedrivenFrom:       "amqpretry.poison",
	}
	if !maps.Equal(md, want) {
		t.Errorf("Write wrote\n%v\nwant\n%v", md, want)
	}
	if n := len(envelopeKeys); len(want) != n+1 {
		t.Fatalf("the test covers %d keys of %d", len(want)-1, n)
	}

	// Times are written in UTC, whatever their zone.
	local := full()
	local.Due = local.Due.In(time.FixedZone("X", 3600))
	md = message.Metadata{}
	local.Write(md)
	if md[keys.Due] != "2026-01-02T03:06:05.123456789Z" {
		t.Errorf("Due written as %q", md[keys.Due])
	}
}

func TestEnvelopeWriteRemovesZeroFields(t *testing.T) {
	md := message.Metadata{"user": "kept"}
	full().Write(md)
	middleware.Envelope{}.Write(md)
	if want := (message.Metadata{"user": "kept"}); !maps.Equal(md, want) {
		t.Errorf("Write of a zero envelope left %v", md)
	}

	// A retry's envelope written over a poisoned one keeps no poison reason; a
	// poisoned one over a retry's keeps no retry hop.
	md = message.Metadata{}
	full().Write(md)
	retry := full()
	retry.Reason, retry.MaxAttempts = "", 0
	retry.Write(md)
	for _, k := range []string{keys.PoisonReason, keys.MaxAttempts} {
		if v, ok := md[k]; ok {
			t.Errorf("retry envelope kept %s = %q", k, v)
		}
	}
	poisoned := full()
	poisoned.RequestedDelay, poisoned.EffectiveDelay, poisoned.Due = 0, 0, time.Time{}
	poisoned.Write(md)
	for _, k := range []string{keys.RequestedDelay, keys.EffectiveDelay, keys.Due} {
		if v, ok := md[k]; ok {
			t.Errorf("poisoned envelope kept %s = %q", k, v)
		}
	}
	if got := middleware.ReadEnvelope(md); !reflect.DeepEqual(got, poisoned) {
		t.Errorf("ReadEnvelope =\n%+v\nwant\n%+v", got, poisoned)
	}
}

func TestEnvelopeBounds(t *testing.T) {
	types := make([]string, 40)
	for i := range types {
		types[i] = "*pkg.Type" + strings.Repeat("x", i*10)
	}
	e := middleware.Envelope{
		Error:          strings.Repeat("é", 10_000), // 2 bytes a rune: a cut at 2045 would split one
		ErrorTypes:     types,
		Handler:        strings.Repeat("h", 5000),
		Topic:          strings.Repeat("日", 1000),
		Queue:          strings.Repeat("q", 257),
		DroppedHeaders: strings.Repeat("d", 3000),
		RedrivenFrom:   strings.Repeat("r", 300),
		Reason:         amqpretry.Reason(strings.Repeat("R", 300)),
	}
	md := message.Metadata{}
	e.Write(md)
	for k, v := range md {
		if !utf8.ValidString(v) {
			t.Errorf("%s is not valid UTF-8 after truncation", k)
		}
	}
	for k, limit := range map[string]int{
		keys.Error: 2048, keys.DroppedHeaders: 2048, keys.Handler: 256, keys.Topic: 256, keys.Queue: 256,
		keys.RedrivenFrom: 256, keys.PoisonReason: 256,
	} {
		if v := md[k]; len(v) > limit || !strings.HasSuffix(v, "…") {
			t.Errorf("%s is %d bytes (%.10q…), want at most %d and marked as cut", k, len(v), v, limit)
		}
	}
	if got := md[keys.Error]; got != strings.Repeat("é", 1022)+"…" {
		t.Errorf("error cut to %d bytes, want 1022 runes and the mark (2047 bytes, on a rune boundary)", len(got))
	}
	got := middleware.ReadEnvelope(md).ErrorTypes
	if len(got) != 16 {
		t.Errorf("%d error types, want the cap 16", len(got))
	}
	for i, typ := range got {
		if len(typ) > 128 || !strings.HasPrefix(types[i], strings.TrimSuffix(typ, "…")) {
			t.Errorf("error type %d: %q (%d bytes), want a prefix of %q of at most 128 bytes", i, typ, len(typ), types[i])
		}
	}
	total := 0
	for k, v := range md {
		total += len(k) + len(v)
	}
	if total > 8*1024 {
		t.Errorf("envelope is %d bytes, want it far below frame_max", total)
	}

	// Within bounds nothing is cut.
	exact := middleware.Envelope{Error: strings.Repeat("e", 2048), Queue: strings.Repeat("q", 256), ErrorTypes: slices.Repeat([]string{"t"}, 16)}
	md = message.Metadata{}
	exact.Write(md)
	if got := middleware.ReadEnvelope(md); !reflect.DeepEqual(got, exact) {
		t.Errorf("an envelope at its bounds was changed: %+v", got)
	}
}

func TestReadEnvelopeUnreadable(t *testing.T) {
	md := message.Metadata{
		keys.Attempt: "three", keys.MaxAttempts: "", keys.RedriveCount: "1.5",
		keys.FirstFailure: "yesterday", keys.LastFailure: "2026-01-02", keys.Due: "", keys.RedrivenAt: "0",
		keys.RequestedDelay: "5", keys.EffectiveDelay: "soon",
		"user": "x",
	}
	if got := middleware.ReadEnvelope(md); !reflect.DeepEqual(got, middleware.Envelope{}) {
		t.Errorf("ReadEnvelope of unreadable values = %+v, want the zero Envelope", got)
	}
	if got := middleware.ReadEnvelope(nil); !reflect.DeepEqual(got, middleware.Envelope{}) {
		t.Errorf("ReadEnvelope(nil) = %+v", got)
	}
}
