package middleware

import (
	"strconv"
	"strings"
	"time"

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

// ReadEnvelope reads the envelope from md. Fields whose keys are absent or unreadable
// are zero.
func ReadEnvelope(md message.Metadata) Envelope {
	e := Envelope{
		Reason: amqpretry.Reason(md[keys.PoisonReason]), Error: md[keys.Error],
		Handler: md[keys.Handler], Topic: md[keys.Topic], Queue: md[keys.Queue],
		OriginalExchange: md[keys.OriginalExchange], OriginalRoutingKey: md[keys.OriginalRoutingKey],
		DroppedHeaders: md[keys.DroppedHeaders], RedrivenFrom: md[keys.RedrivenFrom],
	}
	if n, ok := keys.ParseAttempt(md[keys.Attempt]); ok {
		e.Attempt = n
	}
	e.MaxAttempts = readInt(md, keys.MaxAttempts)
	e.Redriven = readInt(md, keys.RedriveCount)
	if s := md[keys.ErrorTypes]; s != "" {
		e.ErrorTypes = strings.Split(s, typeSeparator)
	}
	e.FirstFailure = readTime(md, keys.FirstFailure)
	e.LastFailure = readTime(md, keys.LastFailure)
	e.Due = readTime(md, keys.Due)
	e.RedrivenAt = readTime(md, keys.RedrivenAt)
	e.RequestedDelay = readDuration(md, keys.RequestedDelay)
	e.EffectiveDelay = readDuration(md, keys.EffectiveDelay)
	return e
}

// readInt and readDuration read a field, zero when absent or unreadable; an absent one
// costs nothing (most deliveries are first attempts without an envelope).
func readInt(md message.Metadata, key string) int {
	s, ok := md[key]
	if !ok {
		return 0
	}
	n, _ := strconv.Atoi(s)
	return n
}

func readDuration(md message.Metadata, key string) time.Duration {
	s, ok := md[key]
	if !ok {
		return 0
	}
	d, _ := time.ParseDuration(s)
	return d
}

func readTime(md message.Metadata, key string) time.Time {
	s, ok := md[key]
	if !ok {
		return time.Time{}
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if u := t.UTC(); err != nil || u.Year() < 0 || u.Year() > 9999 {
		// Unreadable, or a time Write could not write back in UTC RFC 3339 (an offset
		// that moves it out of years 0 to 9999).
		return time.Time{}
	}
	return t
}

// Write writes e into md, bounding every field, and removes the key of every zero
// field, so that md holds exactly e: a poisoned copy keeps nothing of its last retry
// hop, and a retried one no poison reason.
func (e Envelope) Write(md message.Metadata) {
	putInt(md, keys.Attempt, e.Attempt)
	putInt(md, keys.MaxAttempts, e.MaxAttempts)
	putInt(md, keys.RedriveCount, e.Redriven)
	put(md, keys.PoisonReason, keys.Truncate(string(e.Reason), maxNameBytes))
	put(md, keys.Error, keys.Truncate(e.Error, maxErrorBytes))
	put(md, keys.ErrorTypes, joinTypes(e.ErrorTypes))
	put(md, keys.Handler, keys.Truncate(e.Handler, maxNameBytes))
	put(md, keys.Topic, keys.Truncate(e.Topic, maxNameBytes))
	put(md, keys.Queue, keys.Truncate(e.Queue, maxNameBytes))
	put(md, keys.OriginalExchange, keys.Truncate(e.OriginalExchange, maxNameBytes))
	put(md, keys.OriginalRoutingKey, keys.Truncate(e.OriginalRoutingKey, maxNameBytes))
	put(md, keys.DroppedHeaders, keys.Truncate(e.DroppedHeaders, maxErrorBytes))
	put(md, keys.RedrivenFrom, keys.Truncate(e.RedrivenFrom, maxNameBytes))
	putTime(md, keys.FirstFailure, e.FirstFailure)
	putTime(md, keys.LastFailure, e.LastFailure)
	putTime(md, keys.Due, e.Due)
	putTime(md, keys.RedrivenAt, e.RedrivenAt)
	putDuration(md, keys.RequestedDelay, e.RequestedDelay)
	putDuration(md, keys.EffectiveDelay, e.EffectiveDelay)
}

func put(md message.Metadata, key, v string) {
	if v == "" {
		delete(md, key)
		return
	}
	md[key] = v
}

func putInt(md message.Metadata, key string, v int) {
	if v == 0 {
		delete(md, key)
		return
	}
	md[key] = strconv.Itoa(v)
}

func putTime(md message.Metadata, key string, t time.Time) {
	if t.IsZero() {
		delete(md, key)
		return
	}
	md[key] = t.UTC().Format(time.RFC3339Nano)
}

func putDuration(md message.Metadata, key string, d time.Duration) {
	if d == 0 {
		delete(md, key)
		return
	}
	md[key] = d.String()
}

// joinTypes joins at most keys.MaxErrorTypes types, each bounded.
func joinTypes(types []string) string {
	if len(types) == 1 {
		return keys.Truncate(types[0], maxErrorTypeBytes)
	}
	var b strings.Builder
	for i, t := range types[:min(len(types), keys.MaxErrorTypes)] {
		if i > 0 {
			b.WriteString(typeSeparator)
		}
		b.WriteString(keys.Truncate(t, maxErrorTypeBytes))
	}
	return b.String()
}
