package middleware

import (
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// Envelope is the failure record the retry middleware writes into the metadata of
// every copy it publishes, retried or poisoned, and that a redrive updates. Its keys
// start with "amqpretry-" (never "x-", which RabbitMQ owns). Read it from a poisoned
// message with ReadEnvelope; every field is bounded, so that the envelope stays a few
// KiB, far below RabbitMQ's frame_max.
type Envelope struct {
	// Attempt is, on a retry, the attempt its next delivery is (from 2); on a poisoned
	// copy, the attempt that failed last.
	Attempt int `json:"attempt,omitempty"`
	// MaxAttempts is the policy's limit, on a poisoned copy.
	MaxAttempts int `json:"max_attempts,omitempty"`
	// Reason is why the message was poisoned; "" on a retry.
	Reason amqpretry.Reason `json:"reason,omitempty"`
	// Error is the latest error's text, at most 2 KiB; ErrorTypes the Go types of its
	// chain, outermost first, at most 16.
	Error      string   `json:"error,omitempty"`
	ErrorTypes []string `json:"error_types,omitempty"`
	// FirstFailure and LastFailure are the times of the first and the latest failure.
	FirstFailure time.Time `json:"first_failure,omitzero"`
	LastFailure  time.Time `json:"last_failure,omitzero"`
	// Handler, Topic and Queue are where it failed: the handler, the topic it
	// subscribed to and the queue the message came from (where a retry or a redrive
	// goes back to).
	Handler string `json:"handler,omitempty"`
	Topic   string `json:"topic,omitempty"`
	Queue   string `json:"queue,omitempty"`
	// OriginalExchange and OriginalRoutingKey are those of the first delivery.
	OriginalExchange   string `json:"original_exchange,omitempty"`
	OriginalRoutingKey string `json:"original_routing_key,omitempty"`
	// RequestedDelay, EffectiveDelay and Due describe the retry under way: the delay
	// asked for, the delay the backend applied, and when it was due back. Empty on a
	// poisoned copy.
	RequestedDelay time.Duration `json:"requested_delay_ns,omitempty"`
	EffectiveDelay time.Duration `json:"effective_delay_ns,omitempty"`
	Due            time.Time     `json:"due,omitzero"`
	// DroppedHeaders names, on a copy too large for the broker's frame_max, the
	// headers left out to make it fit: "name (N bytes)", comma-separated.
	DroppedHeaders string `json:"dropped_headers,omitempty"`
	// RedrivenAt, Redriven and RedrivenFrom are set by a redrive: its time, how many
	// redrives so far, and the queue it came from (poison or parking).
	RedrivenAt   time.Time `json:"redriven_at,omitzero"`
	Redriven     int       `json:"redriven,omitempty"`
	RedrivenFrom string    `json:"redriven_from,omitempty"`
}

// Bounds of the envelope.
const (
	maxErrorBytes     = 2048
	maxErrorTypeBytes = 128
	maxNameBytes      = 256
	typeSeparator     = " > "
)

// Write writes e into md, bounding every field, and removes the key of every zero
// field, so that md holds exactly e: a poisoned copy keeps nothing of its last retry
// hop, and a retried one no poison reason. Each field is formatted where it is listed.
func (e Envelope) Write(md message.Metadata) {
	for _, f := range [...]struct{ key, value string }{
		{keys.Attempt, formatInt(e.Attempt)},
		{keys.MaxAttempts, formatInt(e.MaxAttempts)},
		{keys.RedriveCount, formatInt(e.Redriven)},
		{keys.PoisonReason, truncate(string(e.Reason), maxNameBytes)},
		{keys.Error, truncate(e.Error, maxErrorBytes)},
		{keys.ErrorTypes, joinTypes(e.ErrorTypes)},
		{keys.Handler, truncate(e.Handler, maxNameBytes)},
		{keys.Topic, truncate(e.Topic, maxNameBytes)},
		{keys.Queue, truncate(e.Queue, maxNameBytes)},
		{keys.OriginalExchange, truncate(e.OriginalExchange, maxNameBytes)},
		{keys.OriginalRoutingKey, truncate(e.OriginalRoutingKey, maxNameBytes)},
		{keys.DroppedHeaders, truncate(e.DroppedHeaders, maxErrorBytes)},
		{keys.RedrivenFrom, truncate(e.RedrivenFrom, maxNameBytes)},
		{keys.FirstFailure, formatTime(e.FirstFailure)},
		{keys.LastFailure, formatTime(e.LastFailure)},
		{keys.Due, formatTime(e.Due)},
		{keys.RedrivenAt, formatTime(e.RedrivenAt)},
		{keys.RequestedDelay, formatDuration(e.RequestedDelay)},
		{keys.EffectiveDelay, formatDuration(e.EffectiveDelay)},
	} {
		if f.value == "" {
			delete(md, f.key)
		} else {
			md[f.key] = f.value
		}
	}
}

// formatInt, formatTime and formatDuration format a field of the envelope as its
// metadata value: "" for zero, which Write leaves out.
func formatInt(n int) string {
	if n == 0 {
		return ""
	}
	return strconv.Itoa(n)
}

func formatTime(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339Nano)
}

func formatDuration(d time.Duration) string {
	if d == 0 {
		return ""
	}
	return d.String()
}

// truncate cuts s to at most n bytes on a rune boundary, marking the cut with "…".
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

// joinTypes joins at most keys.MaxErrorTypes types, each bounded.
func joinTypes(types []string) string {
	if len(types) == 1 {
		return truncate(types[0], maxErrorTypeBytes)
	}
	var b strings.Builder
	for i, t := range types[:min(len(types), keys.MaxErrorTypes)] {
		if i > 0 {
			b.WriteString(typeSeparator)
		}
		b.WriteString(truncate(t, maxErrorTypeBytes))
	}
	return b.String()
}
