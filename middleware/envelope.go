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

// envelopeField is one key of the envelope: how Write formats its field (bounded; ""
// for a zero field) and how ReadEnvelope reads it back.
type envelopeField struct {
	key   string
	write func(e *Envelope) string
	read  func(e *Envelope, v string)
}

// envelopeFields is the failure envelope's one list of keys (their names are in
// internal/keys): Write, ReadEnvelope and inEnvelope go by it, and the command's
// shown keys are what Write writes. Each field is formatted where it is listed.
var envelopeFields = [...]envelopeField{
	{keys.Attempt, func(e *Envelope) string { return formatInt(e.Attempt) }, func(e *Envelope, v string) {
		if n, ok := keys.ParseAttempt(v); ok {
			e.Attempt = n
		}
	}},
	{keys.MaxAttempts, func(e *Envelope) string { return formatInt(e.MaxAttempts) }, func(e *Envelope, v string) { e.MaxAttempts, _ = strconv.Atoi(v) }},
	{keys.RedriveCount, func(e *Envelope) string { return formatInt(e.Redriven) }, func(e *Envelope, v string) { e.Redriven, _ = strconv.Atoi(v) }},
	{keys.PoisonReason, func(e *Envelope) string { return truncate(string(e.Reason), maxNameBytes) }, func(e *Envelope, v string) { e.Reason = amqpretry.Reason(v) }},
	{keys.Error, func(e *Envelope) string { return truncate(e.Error, maxErrorBytes) }, func(e *Envelope, v string) { e.Error = v }},
	{keys.ErrorTypes, func(e *Envelope) string { return joinTypes(e.ErrorTypes) }, func(e *Envelope, v string) {
		if v != "" {
			e.ErrorTypes = strings.Split(v, typeSeparator)
		}
	}},
	{keys.Stack, func(e *Envelope) string { return truncate(e.Stack, maxStackBytes) }, func(e *Envelope, v string) { e.Stack = v }},
	{keys.Handler, func(e *Envelope) string { return truncate(e.Handler, maxNameBytes) }, func(e *Envelope, v string) { e.Handler = v }},
	{keys.Topic, func(e *Envelope) string { return truncate(e.Topic, maxNameBytes) }, func(e *Envelope, v string) { e.Topic = v }},
	{keys.Queue, func(e *Envelope) string { return truncate(e.Queue, maxNameBytes) }, func(e *Envelope, v string) { e.Queue = v }},
	{keys.OriginalExchange, func(e *Envelope) string { return truncate(e.OriginalExchange, maxNameBytes) }, func(e *Envelope, v string) { e.OriginalExchange = v }},
	{keys.OriginalRoutingKey, func(e *Envelope) string { return truncate(e.OriginalRoutingKey, maxNameBytes) }, func(e *Envelope, v string) { e.OriginalRoutingKey = v }},
	{keys.DroppedHeaders, func(e *Envelope) string { return truncate(e.DroppedHeaders, maxErrorBytes) }, func(e *Envelope, v string) { e.DroppedHeaders = v }},
	{keys.RedrivenFrom, func(e *Envelope) string { return truncate(e.RedrivenFrom, maxNameBytes) }, func(e *Envelope, v string) { e.RedrivenFrom = v }},
	{keys.FirstFailure, func(e *Envelope) string { return formatTime(e.FirstFailure) }, func(e *Envelope, v string) { e.FirstFailure = readTime(v) }},
	{keys.LastFailure, func(e *Envelope) string { return formatTime(e.LastFailure) }, func(e *Envelope, v string) { e.LastFailure = readTime(v) }},
	{keys.Due, func(e *Envelope) string { return formatTime(e.Due) }, func(e *Envelope, v string) { e.Due = readTime(v) }},
	{keys.RedrivenAt, func(e *Envelope) string { return formatTime(e.RedrivenAt) }, func(e *Envelope, v string) { e.RedrivenAt = readTime(v) }},
	{keys.RequestedDelay, func(e *Envelope) string { return formatDuration(e.RequestedDelay) }, func(e *Envelope, v string) { e.RequestedDelay, _ = time.ParseDuration(v) }},
	{keys.EffectiveDelay, func(e *Envelope) string { return formatDuration(e.EffectiveDelay) }, func(e *Envelope, v string) { e.EffectiveDelay, _ = time.ParseDuration(v) }},
}

// envelopeIndex finds a key's place in envelopeFields.
var envelopeIndex = func() map[string]int {
	m := make(map[string]int, len(envelopeFields))
	for i, f := range envelopeFields {
		m[f.key] = i
	}
	return m
}()

// inEnvelope tells whether key is one of the failure envelope's.
func inEnvelope(key string) bool {
	_, ok := envelopeIndex[key]
	return ok
}

// Write writes e into md, bounding every field, and removes the key of every zero
// field, so that md has exactly e: a poisoned copy keeps nothing of its last retry
// hop, and a retried one no poison reason.
func (e Envelope) Write(md message.Metadata) {
	for _, f := range envelopeFields {
		if v := f.write(&e); v == "" {
			delete(md, f.key)
		} else {
			md[f.key] = v
		}
	}
}

// ReadEnvelope reads the envelope from md: Write's reverse, key for key. Fields whose
// keys are absent or unreadable are zero.
func ReadEnvelope(md message.Metadata) Envelope {
	var e Envelope
	for k, v := range md {
		if i, ok := envelopeIndex[k]; ok {
			envelopeFields[i].read(&e, v)
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
