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

// envelopeField is one key of the envelope with the field of an Envelope it stands for:
// one of the pointers is set. Write formats it (format), ReadEnvelope parses it back
// (parse).
type envelopeField struct {
	key    string
	limit  int // bytes, for text
	text   *string
	reason *amqpretry.Reason
	types  *[]string
	n      *int
	at     *time.Time
	delay  *time.Duration
}

// envelopeKeys is how many keys the envelope has.
const envelopeKeys = 20

// fields is the failure envelope's one list of keys (their names are in
// internal/keys), each with e's field: Write, ReadEnvelope and inEnvelope go by it,
// and the command's shown keys are what Write writes.
func (e *Envelope) fields() [envelopeKeys]envelopeField {
	return [...]envelopeField{
		{key: keys.Attempt, n: &e.Attempt},
		{key: keys.MaxAttempts, n: &e.MaxAttempts},
		{key: keys.RedriveCount, n: &e.Redriven},
		{key: keys.PoisonReason, reason: &e.Reason, limit: maxNameBytes},
		{key: keys.Error, text: &e.Error, limit: maxErrorBytes},
		{key: keys.ErrorTypes, types: &e.ErrorTypes},
		{key: keys.Stack, text: &e.Stack, limit: maxStackBytes},
		{key: keys.Handler, text: &e.Handler, limit: maxNameBytes},
		{key: keys.Topic, text: &e.Topic, limit: maxNameBytes},
		{key: keys.Queue, text: &e.Queue, limit: maxNameBytes},
		{key: keys.OriginalExchange, text: &e.OriginalExchange, limit: maxNameBytes},
		{key: keys.OriginalRoutingKey, text: &e.OriginalRoutingKey, limit: maxNameBytes},
		{key: keys.DroppedHeaders, text: &e.DroppedHeaders, limit: maxErrorBytes},
		{key: keys.RedrivenFrom, text: &e.RedrivenFrom, limit: maxNameBytes},
		{key: keys.FirstFailure, at: &e.FirstFailure},
		{key: keys.LastFailure, at: &e.LastFailure},
		{key: keys.Due, at: &e.Due},
		{key: keys.RedrivenAt, at: &e.RedrivenAt},
		{key: keys.RequestedDelay, delay: &e.RequestedDelay},
		{key: keys.EffectiveDelay, delay: &e.EffectiveDelay},
	}
}

// format is f's field as Write writes it: bounded, "" for a zero field (left out).
// Times are UTC RFC 3339 (timeLayout).
func (f envelopeField) format() string {
	var v string
	switch {
	case f.text != nil:
		v = *f.text
	case f.reason != nil:
		v = string(*f.reason)
	case f.types != nil && len(*f.types) == 1 && len((*f.types)[0]) <= maxErrorTypeBytes:
		v = (*f.types)[0] // most errors have no chain: nothing to join
	case f.types != nil:
		return joinTypes(*f.types)
	case f.n != nil && *f.n != 0:
		v = strconv.Itoa(*f.n)
	case f.at != nil && !f.at.IsZero():
		v = f.at.UTC().Format(timeLayout)
	case f.delay != nil && *f.delay != 0:
		v = f.delay.String()
	}
	if f.limit > 0 && len(v) > f.limit {
		v = truncate(v, f.limit)
	}
	return v
}

// parse reads v, Write's value of f, into f's field; an unreadable value leaves it
// zero.
func (f envelopeField) parse(v string) {
	switch {
	case f.text != nil:
		*f.text = v
	case f.reason != nil:
		*f.reason = amqpretry.Reason(v)
	case f.types != nil:
		if v != "" {
			*f.types = strings.Split(v, typeSeparator)
		}
	case f.n != nil && f.key == keys.Attempt:
		if n, ok := keys.ParseAttempt(v); ok {
			*f.n = n
		}
	case f.n != nil:
		*f.n, _ = strconv.Atoi(v)
	case f.at != nil:
		*f.at = readTime(v)
	case f.delay != nil:
		*f.delay, _ = time.ParseDuration(v)
	}
}

// timeLayout is how the envelope and keys.ParkUntil write a time, in UTC.
const timeLayout = time.RFC3339Nano

// envelopeKeyList is the envelope's keys in the order of its list (fields), read from
// it: Write stores a key from here, so that the Envelope it writes stays on the stack.
// envelopeIndex finds a key's place in it.
var envelopeKeyList, envelopeIndex = func() (ks [envelopeKeys]string, index map[string]int) {
	var e Envelope
	index = make(map[string]int, envelopeKeys)
	for i, f := range e.fields() {
		ks[i], index[f.key] = f.key, i
	}
	return ks, index
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
	for i, f := range e.fields() {
		if v := f.format(); v == "" {
			delete(md, envelopeKeyList[i])
		} else {
			md[envelopeKeyList[i]] = v
		}
	}
}

// ReadEnvelope reads the envelope from md: Write's reverse, key for key. Fields whose
// keys are absent or unreadable are zero.
func ReadEnvelope(md message.Metadata) Envelope {
	var e Envelope
	var fs [envelopeKeys]envelopeField // e's, once a key of the envelope is found
	for k, v := range md {
		i, ok := envelopeIndex[k]
		if !ok {
			continue
		}
		if fs[i].key == "" {
			fs = e.fields()
		}
		fs[i].parse(v)
	}
	return e
}

// readTime reads a time of the envelope, zero when unreadable or when Write could not
// write it back in UTC RFC 3339 (an offset that moves it out of years 0 to 9999).
func readTime(s string) time.Time {
	t, err := time.Parse(timeLayout, s)
	if u := t.UTC(); err != nil || u.Year() < 0 || u.Year() > 9999 {
		return time.Time{}
	}
	return t
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
	var b strings.Builder
	for i, t := range types[:min(len(types), keys.MaxErrorTypes)] {
		if i > 0 {
			b.WriteString(typeSeparator)
		}
		if len(t) > maxErrorTypeBytes {
			t = truncate(t, maxErrorTypeBytes)
		}
		b.WriteString(t)
	}
	return b.String()
}
