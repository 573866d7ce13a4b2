package middleware

import (
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Metadata keys of a poisoned copy, besides the failure envelope.
const (
	// PoisonReasonKey says why a message was poisoned: one of the Poison constants.
	PoisonReasonKey = "amqpretry-poison-reason"
	// MaxAttemptsKey holds the policy's MaxAttempts.
	MaxAttemptsKey = "amqpretry-max-attempts"
	// DroppedHeadersKey lists, on a copy that was too large for the broker's frame_max,
	// the headers left out to make it fit: "name (N bytes)", comma-separated.
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

// envelopeKeys are the keys a poisoned copy keeps whatever its size.
var envelopeKeys = map[string]bool{
	AttemptKey: true, MaxAttemptsKey: true, FirstFailureKey: true, LastFailureKey: true, ErrorKey: true,
	ErrorTypesKey: true, PoisonReasonKey: true, HandlerKey: true, TopicKey: true, QueueKey: true,
	OriginalExchangeKey: true, OriginalRoutingKeyKey: true, DroppedHeadersKey: true,
}

// poison hands cp, the copy of a message that failed for good, to the poison topic. A
// copy too large for the broker loses its envelope's longer fields first, then the
// largest headers that are not ours, named under DroppedHeadersKey, until it fits.
func (r *Retry) poison(err error, cp *message.Message, f failure, reason string, fields watermill.LogFields) error {
	// The keys of the retry hop that brought it here would be stale.
	for _, k := range []string{RequestedDelayKey, EffectiveDelayKey, DueKey, wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
		delete(cp.Metadata, k)
	}
	cp.Metadata.Set(PoisonReasonKey, reason)
	cp.Metadata.Set(AttemptKey, strconv.Itoa(f.attempt))
	cp.Metadata.Set(MaxAttemptsKey, strconv.Itoa(r.cfg.Policy.MaxAttempts))
	fields["poison_reason"] = reason
	start := time.Now()
	perr := r.cfg.Poison.Publish(r.cfg.PoisonTopic, cp)
	if tooLarge(perr) {
		trimEnvelope(cp.Metadata)
		perr = r.cfg.Poison.Publish(r.cfg.PoisonTopic, cp)
	}
	for tooLarge(perr) && dropLargestHeader(cp.Metadata) {
		perr = r.cfg.Poison.Publish(r.cfg.PoisonTopic, cp)
	}
	if perr != nil {
		return r.handoffFailed(err, fmt.Errorf("poison topic %q: %w", r.cfg.PoisonTopic, perr), cp, f, fields, false)
	}
	r.failures.forget(cp.UUID)
	r.stats.poisoned.Add(1)
	r.observe(Event{Kind: EventPoisoned, Queue: f.queue, Attempt: f.attempt, Reason: reason, Err: err, Handoff: time.Since(start)})
	if dropped := cp.Metadata.Get(DroppedHeadersKey); dropped != "" {
		fields["dropped_headers"] = dropped
	}
	warn(r.cfg.Logger, "Message poisoned", err, fields)
	return nil
}

// trimmedErrorBytes bounds the error text of an envelope trimmed to fit frame_max.
const trimmedErrorBytes = 256

// trimEnvelope shortens the envelope of a copy too large for the broker: the error
// text to trimmedErrorBytes, the error types left out.
func trimEnvelope(md map[string]string) {
	md[ErrorKey] = truncate(md[ErrorKey], trimmedErrorBytes)
	delete(md, ErrorTypesKey)
}

// dropLargestHeader removes the largest metadata entry that is not the envelope's and
// names it under DroppedHeadersKey. It returns false when there is nothing left to
// drop.
func dropLargestHeader(md map[string]string) bool {
	largest, size := "", -1
	for k, v := range md {
		if !envelopeKeys[k] && len(k)+len(v) > size {
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
