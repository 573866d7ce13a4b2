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

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/middleware"
)

// bounds are the documented limits of the envelope's text fields, in bytes.
var bounds = map[string]int{
	keys.Error: 2048, keys.DroppedHeaders: 2048, keys.Stack: 4096, keys.PoisonReason: 256, keys.Handler: 256, keys.Topic: 256,
	keys.Queue: 256, keys.OriginalExchange: 256, keys.OriginalRoutingKey: 256, keys.RedrivenFrom: 256,
}

// FuzzReadEnvelope feeds arbitrary metadata, as it comes off the wire, to ReadEnvelope:
// it must not panic; what it reads, written back, reads the same (where the value was
// within the envelope's bounds; cut to them otherwise), and a second write changes
// nothing. Write writes only envelope keys, each within bounds, and leaves the others.
func FuzzReadEnvelope(f *testing.F) {
	md := message.Metadata{}
	full().Write(md)
	f.Add(md[keys.Attempt], md[keys.Error], md[keys.ErrorTypes], md[keys.FirstFailure], md[keys.RequestedDelay], md[keys.PoisonReason])
	f.Add("", "", "", "", "", "")
	f.Add("-1", strings.Repeat("é", 1100), " > a >  > ", "2026-01-02T03:04:05+01:00", "-1h2m", "permanent")
	f.Add("+07", "\xff\xfe", strings.Repeat("t > ", 20), "0000-01-01T00:30:00+01:00", "9223372036854775807ns", strings.Repeat("R", 300))
	f.Add("99999999999999999999", "x", ">", "9999-12-31T23:59:59.999999999-01:00", "1.5", "")
	f.Fuzz(func(t *testing.T, attempt, errText, types, at, delay, reason string) {
		in := message.Metadata{
			keys.Attempt: attempt, keys.MaxAttempts: attempt, keys.RedriveCount: attempt,
			keys.Error: errText, keys.DroppedHeaders: errText, keys.Stack: errText + errText + errText, keys.ErrorTypes: types,
			keys.FirstFailure: at, keys.LastFailure: at, keys.Due: at, keys.RedrivenAt: at,
			keys.RequestedDelay: delay, keys.EffectiveDelay: delay,
			keys.PoisonReason: reason, keys.Handler: reason, keys.Topic: reason, keys.Queue: reason,
			keys.OriginalExchange: reason, keys.OriginalRoutingKey: reason, keys.RedrivenFrom: reason,
		}
		e1 := middleware.ReadEnvelope(in)

		w1 := message.Metadata{"user": "kept"}
		e1.Write(w1)
		if w1["user"] != "kept" {
			t.Fatal("Write changed a key not its own")
		}
		delete(w1, "user")
		for k, v := range w1 {
			if !slices.Contains(envelopeKeys, k) {
				t.Fatalf("Write wrote %q, not an envelope key", k)
			}
			if limit, ok := bounds[k]; ok && len(v) > limit {
				t.Fatalf("Write wrote %s of %d bytes, over %d", k, len(v), limit)
			}
			if utf8.ValidString(in[k]) && !utf8.ValidString(v) {
				t.Fatalf("Write made %s invalid UTF-8: %q", k, v)
			}
		}
		if types := strings.Count(w1[keys.ErrorTypes], " > "); types >= 16 {
			t.Fatalf("Write wrote %d error types", types+1)
		}

		e2 := middleware.ReadEnvelope(w1)
		if !sameEnvelope(e1, e2) {
			t.Fatalf("read back\n%+v\nread first\n%+v\n(written %v)", e2, e1, w1)
		}
		w2 := message.Metadata{}
		e2.Write(w2)
		if !maps.Equal(w1, w2) {
			t.Fatalf("a second write changed the metadata:\n%v\n%v", w1, w2)
		}
	})
}

// sameEnvelope tells whether b, read back from a written, is a: equal, except for the
// text fields a had past their bounds, which b has cut (a prefix and the mark), and
// for the times, compared as instants.
func sameEnvelope(a, b middleware.Envelope) bool {
	texts := []struct {
		a, b  *string
		limit int
	}{
		{&a.Error, &b.Error, 2048}, {&a.DroppedHeaders, &b.DroppedHeaders, 2048}, {&a.Stack, &b.Stack, 4096},
		{(*string)(&a.Reason), (*string)(&b.Reason), 256}, {&a.Handler, &b.Handler, 256},
		{&a.Topic, &b.Topic, 256}, {&a.Queue, &b.Queue, 256}, {&a.OriginalExchange, &b.OriginalExchange, 256},
		{&a.OriginalRoutingKey, &b.OriginalRoutingKey, 256}, {&a.RedrivenFrom, &b.RedrivenFrom, 256},
	}
	for _, f := range texts {
		if len(*f.a) > f.limit {
			if len(*f.b) > f.limit || !strings.HasSuffix(*f.b, "…") || !strings.HasPrefix(*f.a, strings.TrimSuffix(*f.b, "…")) {
				return false
			}
			*f.a = *f.b
		}
	}
	if len(a.ErrorTypes) > 16 {
		a.ErrorTypes = a.ErrorTypes[:16]
	}
	for i, typ := range a.ErrorTypes {
		if len(typ) > 128 {
			if i >= len(b.ErrorTypes) || !strings.HasPrefix(typ, strings.TrimSuffix(b.ErrorTypes[i], "…")) {
				return false
			}
			a.ErrorTypes[i] = b.ErrorTypes[i]
		}
	}
	times := []struct{ a, b *time.Time }{
		{&a.FirstFailure, &b.FirstFailure}, {&a.LastFailure, &b.LastFailure}, {&a.Due, &b.Due}, {&a.RedrivenAt, &b.RedrivenAt},
	}
	for _, f := range times {
		if !f.a.Equal(*f.b) {
			return false
		}
		*f.a = *f.b
	}
	return reflect.DeepEqual(a, b)
}
