package middleware

import (
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Metadata keys of the retry middleware. None starts with "x-": RabbitMQ owns that
// space, and 4.0+ ignores or rewrites some of it on republished copies.
const (
	// AttemptKey holds the number of the attempt this delivery is, from 1. It is absent
	// on the first delivery. The middleware keeps it itself, never from x-death or
	// x-delivery-count, which restart whenever a copy is republished.
	AttemptKey = "amqpretry-attempt"
	// FirstFailureKey and LastFailureKey hold the times (RFC 3339, UTC) of the first
	// and the latest failure.
	FirstFailureKey = "amqpretry-first-failure"
	LastFailureKey  = "amqpretry-last-failure"
	// ErrorKey holds the text of the latest error, truncated to MaxErrorBytes.
	ErrorKey = "amqpretry-error"
	// ErrorTypesKey holds the Go types of the latest error's chain, outermost first,
	// separated by " > " (at most MaxErrorTypes of them).
	ErrorTypesKey = "amqpretry-error-types"
	// HandlerKey, TopicKey and QueueKey name the handler that failed, the topic it
	// subscribed to and the queue the message came from.
	HandlerKey = "amqpretry-handler"
	TopicKey   = "amqpretry-topic"
	QueueKey   = "amqpretry-queue"
	// OriginalExchangeKey and OriginalRoutingKeyKey hold the exchange and routing key
	// of the first delivery (later deliveries come from the delay backend).
	OriginalExchangeKey   = "amqpretry-original-exchange"
	OriginalRoutingKeyKey = "amqpretry-original-routing-key"
	// RequestedDelayKey and EffectiveDelayKey hold the delay asked for before this
	// attempt and the delay the backend applied (snapped to a tier, rounded, ...), as
	// Go durations; DueKey holds the time the retry was due back (RFC 3339 with
	// nanoseconds, UTC): hand-off time plus the effective delay. Set on retries.
	RequestedDelayKey = "amqpretry-requested-delay"
	EffectiveDelayKey = "amqpretry-effective-delay"
	DueKey            = "amqpretry-due"
)

// stampRetry records, on the copy of a retry, its attempt number and its delays.
func stampRetry(md map[string]string, attempt int, requested, effective time.Duration, now time.Time) {
	md[AttemptKey] = strconv.Itoa(attempt)
	md[RequestedDelayKey] = requested.String()
	md[EffectiveDelayKey] = effective.String()
	md[DueKey] = now.Add(effective).UTC().Format(time.RFC3339Nano)
}

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

func setIfAbsent(md map[string]string, k, v string) {
	if _, ok := md[k]; !ok {
		md[k] = v
	}
}
