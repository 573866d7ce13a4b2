package middleware

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
)

// TestCopyOfKeepsTypedHeaders: the copy of a delivery with typed headers, enveloped,
// is marshaled without decoding them again (read once, write once), into the headers
// that decoding its metadata gives; a typed header a handler changed is decoded.
func TestCopyOfKeepsTypedHeaders(t *testing.T) {
	m := marshal.Marshaler{Options: marshal.Options{Retry: true, Delivered: func(msg *message.Message, _ int) {
		msg.Metadata[keys.Subscriber] = "s"
	}}}
	msg, err := m.Unmarshal(amqp.Delivery{
		RoutingKey: "orders", Body: []byte("body"),
		Headers: amqp.Table{
			marshal.DefaultUUIDKey: "u-1", "tenant": int32(7), "flag": true,
			"trace": amqp.Table{"span": int64(1234567890123), "tags": []interface{}{"a", int32(2)}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	msg.SetContext(context.Background()) // as watermill-amqp does after Unmarshal

	decodedOf := func(cp *message.Message) amqp.Table { // as Marshal did: every typed value decoded
		t.Helper()
		ref := message.NewMessage(cp.UUID, cp.Payload)
		ref.Metadata = maps.Clone(cp.Metadata)
		p, err := m.Marshal(ref)
		if err != nil {
			t.Fatal(err)
		}
		return p.Headers
	}
	for _, change := range []bool{false, true} {
		if change {
			msg.Metadata["tenant"] = `{"int64":99}` // the handler's
		}
		cp := copyOf(msg)
		Envelope{Attempt: 2, Error: "boom", LastFailure: time.Unix(1700000000, 0)}.Write(cp.Metadata)
		want := decodedOf(cp)
		_, before := marshal.WorkDone()
		p, err := m.Marshal(cp)
		if err != nil {
			t.Fatal(err)
		}
		_, after := marshal.WorkDone()
		if wantDecoded := map[bool]int64{false: 0, true: 1}[change]; after-before != wantDecoded {
			t.Errorf("changed %v: Marshal of the copy decoded %d values, want %d", change, after-before, wantDecoded)
		}
		if !reflect.DeepEqual(p.Headers, want) {
			t.Errorf("changed %v: copy published\n%#v\nwant\n%#v", change, p.Headers, want)
		}
		if change && p.Headers["tenant"] != int64(99) {
			t.Errorf("tenant = %#v, want int64(99)", p.Headers["tenant"])
		}
	}
}

// genericErr is an error of a generic type, named with its type argument by %T.
type genericErr[T any] struct{ v T }

func (genericErr[T]) Error() string { return "generic" }

// TestEnvelopeErrorTypes: the envelope names the Go types of the error's chain as
// %T does, depth first, outermost first, with the stack of the first panic in it.
func TestEnvelopeErrorTypes(t *testing.T) {
	p := &panicked{value: "boom", stack: "goroutine 1"}
	err := fmt.Errorf("wrapped: %w", errors.Join(genericErr[int]{1}, p, struct{ error }{errors.New("anon")}))
	e, _ := newEngine(t, amqpretry.Config{}, &fakeBackend{})
	env := e.envelope(delivery{msg: message.NewMessage("u", nil)}, err)
	var want []string
	for _, x := range []any{err, errors.Unwrap(err), genericErr[int]{}, p, amqpretry.ErrPanicked, struct{ error }{}} {
		want = append(want, fmt.Sprintf("%T", x))
	}
	if !slices.Equal(env.ErrorTypes, want) || env.Stack != p.stack {
		t.Errorf("envelope: types %q, stack %q; want %q, %q", env.ErrorTypes, env.Stack, want, p.stack)
	}
}
