package middleware

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/cenkalti/backoff/v4"
)

// The copy: what a copying backend parks for a retry, built once from the delivery
// (copyOf, the envelope), and the delay it asks for.

// handoffContext is the context of a hand-off of cp: the delivery's, but not canceled
// with it. The router cancels it when it closes, while the handlers still run and the
// subscriber may still deliver; a hand-off canceled then would count as failed, again
// at each redelivery to the closing process, and poison the message after
// HandoffAttempts of them (seen stopping a consumer in the no-loss test that changes
// backends). Bounded by ConfirmTimeout, the hand-off is confirmed, and the original
// acked, or fails, and the original is nacked.
func handoffContext(cp *message.Message) context.Context {
	return context.WithoutCancel(cp.Context())
}

// envelope is the envelope of the copy of a message that failed, built once: what the
// message carries from its earlier failures and redrives (first failure, original
// route, redrives, dropped headers) and this failure. What the way out decides (the
// attempt, the delays and due time, or the poison reason) is set there, once.
func (e *engine) envelope(d delivery, err error) Envelope {
	was := d.envelope
	env := Envelope{
		FirstFailure: was.FirstFailure, OriginalExchange: was.OriginalExchange, OriginalRoutingKey: was.OriginalRoutingKey,
		DroppedHeaders: was.DroppedHeaders, RedrivenAt: was.RedrivenAt, Redriven: was.Redriven, RedrivenFrom: was.RedrivenFrom,
		LastFailure: d.at, Error: err.Error(), ErrorTypes: errorTypes(err),
		Handler: d.handler, Topic: d.topic, Queue: d.queue,
	}
	if env.FirstFailure.IsZero() {
		env.FirstFailure = d.at
		env.OriginalExchange, env.OriginalRoutingKey = d.exchange, d.key
	}
	return env
}

// failure is one failed attempt being dealt with.
type failure struct {
	delivery
	err         error
	maxAttempts int
	envelope    Envelope
	fields      watermill.LogFields // log: built when first logged
}

// log returns the fields of f's log lines, built the first time a line is logged.
func (f *failure) log() watermill.LogFields {
	if f.fields == nil {
		f.fields = watermill.LogFields{
			"message_uuid": f.msg.UUID, "handler": f.handler, "topic": f.topic, "queue": f.queue,
			"attempt": f.attempt, "max_attempts": f.maxAttempts, "err": f.err.Error(),
		}
	}
	return f.fields
}

// envelopeRoom is how many keys the envelope of a retry adds to a copy.
const envelopeRoom = 13

// copyOf copies msg, with its context, into metadata sized for the envelope, without
// the keys its marshaler wrote on receipt about the delivery itself
// (keys.OfDelivery): a copy is another message.
func copyOf(msg *message.Message) *message.Message {
	cp := message.NewMessageWithContext(marshal.CopyContext(msg), msg.UUID, msg.Payload) // typed headers as read
	n := envelopeRoom
	for k := range msg.Metadata {
		if !keys.OfDelivery(k) {
			n++
		}
	}
	cp.Metadata = make(message.Metadata, n)
	for k, v := range msg.Metadata {
		if !keys.OfDelivery(k) {
			cp.Metadata[k] = v
		}
	}
	return cp
}

// errorTypes lists the Go types in err's chain, depth first, outermost first.
func errorTypes(err error) []string {
	var types []string
	var walk func(error)
	walk = func(e error) {
		if e == nil || len(types) >= keys.MaxErrorTypes {
			return
		}
		types = append(types, fmt.Sprintf("%T", e))
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		case interface{ Unwrap() []error }:
			for _, inner := range u.Unwrap() {
				walk(inner)
			}
		}
	}
	walk(err)
	return types
}

// trimmedErrorBytes bounds the error text of an envelope trimmed to fit frame_max.
const trimmedErrorBytes = 256

// trim shortens the envelope of a copy too large for the broker: the error text to
// trimmedErrorBytes, the error types left out.
func trim(env *Envelope) {
	env.Error = keys.Truncate(env.Error, trimmedErrorBytes)
	env.ErrorTypes = nil
}

// delayOf returns the delay of the n-th delayed retry of p (from 1: the first is
// InitialInterval for the exponential schedule), jitter included. p has its defaults.
func delayOf(p amqpretry.Policy, n int) time.Duration {
	n = max(n, 1)
	if len(p.Delays) > 0 {
		return p.Delays[min(n, len(p.Delays))-1]
	}
	b := &backoff.ExponentialBackOff{
		InitialInterval:     p.InitialInterval,
		RandomizationFactor: p.Jitter,
		Multiplier:          p.Multiplier,
		MaxInterval:         p.MaxInterval,
		Stop:                backoff.Stop,
		Clock:               backoff.SystemClock,
	}
	b.Reset()
	var d time.Duration
	for range n {
		d = b.NextBackOff()
	}
	return min(d, p.MaxInterval)
}
