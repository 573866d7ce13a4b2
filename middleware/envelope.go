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
	// Stack is, when the latest failure was a panic of the handler (which the
	// middleware recovers: amqpretry.ErrPanicked), the stack of the goroutine from the
	// function that panicked, at most 4 KiB.
	Stack string `json:"stack,omitempty"`
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
	maxStackBytes     = 4096
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
		{keys.Stack, truncate(e.Stack, maxStackBytes)},
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

// ReadEnvelope reads the envelope from md: Write's reverse, key for key. Fields whose
// keys are absent or unreadable are zero.
func ReadEnvelope(md message.Metadata) Envelope {
	var e Envelope
	for k, v := range md {
		switch k {
		case keys.Attempt:
			if n, ok := keys.ParseAttempt(v); ok {
				e.Attempt = n
			}
		case keys.MaxAttempts:
			e.MaxAttempts, _ = strconv.Atoi(v)
		case keys.RedriveCount:
			e.Redriven, _ = strconv.Atoi(v)
		case keys.PoisonReason:
			e.Reason = amqpretry.Reason(v)
		case keys.Error:
			e.Error = v
		case keys.ErrorTypes:
			if v != "" {
				e.ErrorTypes = strings.Split(v, typeSeparator)
			}
		case keys.Stack:
			e.Stack = v
		case keys.Handler:
			e.Handler = v
		case keys.Topic:
			e.Topic = v
		case keys.Queue:
			e.Queue = v
		case keys.OriginalExchange:
			e.OriginalExchange = v
		case keys.OriginalRoutingKey:
			e.OriginalRoutingKey = v
		case keys.DroppedHeaders:
			e.DroppedHeaders = v
		case keys.RedrivenFrom:
			e.RedrivenFrom = v
		case keys.FirstFailure:
			e.FirstFailure = readTime(v)
		case keys.LastFailure:
			e.LastFailure = readTime(v)
		case keys.Due:
			e.Due = readTime(v)
		case keys.RedrivenAt:
			e.RedrivenAt = readTime(v)
		case keys.RequestedDelay:
			e.RequestedDelay, _ = time.ParseDuration(v)
		case keys.EffectiveDelay:
			e.EffectiveDelay, _ = time.ParseDuration(v)
		}
	}
	return e
}

// readTime reads a time of the envelope, zero when unreadable or when Write could not
// write it back in UTC RFC 3339 (an offset that moves it out of years 0 to 9999).
func readTime(s string) time.Time {
	t, err := time.Parse(time.RFC3339Nano, s)
	if u := t.UTC(); err != nil || u.Year() < 0 || u.Year() > 9999 {
		return time.Time{}
	}
	return t
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
