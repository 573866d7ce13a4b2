package middleware

import (
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/amqpretry/amqpretry/xdeath"
)

// Metadata keys of the retry middleware. None starts with "x-": RabbitMQ owns that
// space, and 4.0+ ignores or rewrites some of it on republished copies.
const (
	// AttemptKey holds the number of the attempt this delivery is, from 1. It is absent
	// on the first delivery. The middleware keeps it itself, never from x-death or
	// x-delivery-count, which restart whenever a copy is republished.
	AttemptKey = "amqpretry-attempt"
	// MaxAttemptsKey holds the policy's MaxAttempts, on poisoned messages.
	MaxAttemptsKey = "amqpretry-max-attempts"
	// FirstFailureKey and LastFailureKey hold the times (RFC 3339, UTC) of the first
	// and the latest failure.
	FirstFailureKey = "amqpretry-first-failure"
	LastFailureKey  = "amqpretry-last-failure"
	// ErrorKey holds the text of the latest error, truncated to MaxErrorBytes.
	ErrorKey = "amqpretry-error"
	// ErrorTypesKey holds the Go types of the latest error's chain, outermost first,
	// separated by " > " (at most MaxErrorTypes of them).
	ErrorTypesKey = "amqpretry-error-types"
	// PoisonReasonKey says why a message was poisoned: PoisonPermanent,
	// PoisonMaxAttempts or PoisonDelayTooLong.
	PoisonReasonKey = "amqpretry-poison-reason"
	// HandlerKey, TopicKey and QueueKey name the handler that failed, the topic it
	// subscribed to and the queue the message came from.
	HandlerKey = "amqpretry-handler"
	TopicKey   = "amqpretry-topic"
	QueueKey   = "amqpretry-queue"
	// OriginalExchangeKey and OriginalRoutingKeyKey hold the exchange and routing key
	// of the first delivery (later deliveries come from the delay backend).
	OriginalExchangeKey   = "amqpretry-original-exchange"
	OriginalRoutingKeyKey = "amqpretry-original-routing-key"
	// DroppedHeadersKey lists, on a poisoned copy that was too large for the broker's
	// frame_max, the headers left out to make it fit: "name (N bytes)", comma-separated.
	DroppedHeadersKey = "amqpretry-dropped-headers"
)

// Values of PoisonReasonKey.
const (
	PoisonPermanent   = "permanent"
	PoisonMaxAttempts = "max-attempts"
	// PoisonDelayTooLong: the delay backend refused the delay asked for (a RetryAfter
	// longer than the backend holds, see delay.ErrDelayTooLong).
	PoisonDelayTooLong = "delay-too-long"
	// PoisonHandoffFailed: RetryConfig.HandoffAttempts hand-offs of the message failed
	// in a row (ErrorKey holds the last hand-off error and the handler's).
	PoisonHandoffFailed = "handoff-failed"
	// PoisonTooLarge: the retry copy, even with a trimmed envelope, is larger than the
	// broker's frame_max (see DroppedHeadersKey).
	PoisonTooLarge = "too-large"
)

// Bounds of the failure envelope, which keep it far below RabbitMQ's frame_max
// (128 KiB by default; all headers must fit in one frame).
const (
	MaxErrorBytes     = 2048
	MaxErrorTypes     = 16
	maxErrorTypeBytes = 128
	maxNameBytes      = 256
)

// truncate cuts s to at most n bytes on a rune boundary, marking the cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "…"
	cut := n - len(mark)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}

// errorTypes lists the Go types in err's chain, depth first, at most MaxErrorTypes.
func errorTypes(err error) string {
	var types []string
	var walk func(error)
	walk = func(e error) {
		if e == nil || len(types) >= MaxErrorTypes {
			return
		}
		types = append(types, truncate(fmt.Sprintf("%T", e), maxErrorTypeBytes))
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
	return strings.Join(types, " > ")
}

// failure is what the middleware knows about one failed attempt.
type failure struct {
	err      error
	attempt  int
	at       time.Time
	handler  string
	topic    string
	queue    string
	exchange string // of the delivery that failed
	key      string // of the delivery that failed
}

// record writes the failure into md, the metadata of a copy (never of the incoming
// message). The first failure's time and the original exchange and routing key are kept
// from earlier attempts when md already has them.
func (f failure) record(md map[string]string) {
	at := f.at.UTC().Format(time.RFC3339Nano)
	setIfAbsent(md, FirstFailureKey, at)
	setIfAbsent(md, OriginalExchangeKey, truncate(f.exchange, maxNameBytes))
	setIfAbsent(md, OriginalRoutingKeyKey, truncate(f.key, maxNameBytes))
	md[LastFailureKey] = at
	md[ErrorKey] = truncate(f.err.Error(), MaxErrorBytes)
	md[ErrorTypesKey] = errorTypes(f.err)
	md[HandlerKey] = truncate(f.handler, maxNameBytes)
	md[TopicKey] = truncate(f.topic, maxNameBytes)
	md[QueueKey] = truncate(f.queue, maxNameBytes)
}

// trimmedErrorBytes bounds the error text of an envelope trimmed to fit frame_max.
const trimmedErrorBytes = 256

// trimEnvelope shortens the envelope of a copy too large for the broker: the error
// text to trimmedErrorBytes, the error types left out.
func trimEnvelope(md map[string]string) {
	md[ErrorKey] = truncate(md[ErrorKey], trimmedErrorBytes)
	delete(md, ErrorTypesKey)
}

// dropLargestHeader removes the largest metadata entry that is not ours (our
// "amqpretry-" keys are kept, but for the raw headers the marshaler keeps for the
// sender) and names it under DroppedHeadersKey. It returns false when there is nothing
// left to drop.
func dropLargestHeader(md map[string]string) bool {
	largest, size := "", -1
	for k, v := range md {
		ours := strings.HasPrefix(k, "amqpretry-") && k != xdeath.RawHeadersKey
		if !ours && len(k)+len(v) > size {
			largest, size = k, len(k)+len(v)
		}
	}
	if size < 0 {
		return false
	}
	delete(md, largest)
	note := fmt.Sprintf("%s (%d bytes)", truncate(largest, maxNameBytes), size)
	if prev := md[DroppedHeadersKey]; prev != "" {
		note = prev + ", " + note
	}
	md[DroppedHeadersKey] = truncate(note, MaxErrorBytes)
	return true
}

func setIfAbsent(md map[string]string, k, v string) {
	if _, ok := md[k]; !ok {
		md[k] = v
	}
}
