package middleware

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// The receipt: what the engine reads of a message once, when it arrives (read), the
// failure envelope it carries included (ReadEnvelope), and the Retry middlewares it
// passes through (joinChain). A first delivery carries no envelope: reading it costs
// one pass over its metadata.

// delivery is what the engine reads of a message once, when it arrives.
type delivery struct {
	msg      *message.Message
	owned    bool
	owner    string
	attempt  int
	envelope Envelope
	handler  string
	topic    string
	queue    string
	exchange string // the delivery's own
	key      string
	at       time.Time
	// held tells that this process held the retry this delivery is, in the work
	// queue, due at heldDue.
	held    bool
	heldDue time.Time
	// heldUntil is when a retry held again and again (a delay longer than the
	// queue's) is due; zero for one hold.
	heldUntil time.Time
	rehelds   int // times it was held again
	// backEarly tells that this held retry came back long before it was due (more
	// than half the queue's delay), early how many times in a row it did before.
	backEarly bool
	early     int
	// parkedUntil is when a copy parked for longer than the backend keeps is due
	// (keys.ParkUntil), to be re-parked until then; zero for any other.
	parkedUntil time.Time
}

// read reads msg on receipt, and records this Retry among the middlewares msg passes
// through (joinChain). A retry this process held comes back without its envelope: the
// one remembered when it was held is written back into its metadata, so that the
// handler reads it as on a copy.
func (e *engine) read(msg *message.Message) delivery {
	if e.wiring.ID != "" {
		joinChain(msg, e.wiring.ID)
	}
	ctx := msg.Context()
	d := delivery{
		msg:      msg,
		owner:    msg.Metadata[keys.Subscriber],
		envelope: ReadEnvelope(msg.Metadata),
		handler:  message.HandlerNameFromCtx(ctx),
		topic:    message.SubscribeTopicFromCtx(ctx),
		exchange: msg.Metadata[keys.DeliveryExchange],
		key:      msg.Metadata[keys.DeliveryRoutingKey],
		at:       time.Now(),
	}
	d.owned = e.wiring.ID == "" || d.owner == e.wiring.ID
	d.queue = e.wiring.Queue(d.topic)
	if v, ok := msg.Metadata[keys.ParkUntil]; ok {
		d.parkedUntil, _ = time.Parse(time.RFC3339Nano, v) // zero when unreadable
	}
	remembered := false // the envelope is the one kept when it was held
	var h heldRetry
	ok := false
	if e.holder != nil && e.held.size.Load() > 0 { // only a backend that holds retries leaves any
		h, ok = e.held.take(msg.UUID)
	}
	if ok && d.owned {
		d.held, d.heldDue, d.heldUntil, d.rehelds, d.early = true, h.due, h.until, h.rehelds, h.early
		d.backEarly = e.holder.caps.Delays == backend.ConstantDelay && d.at.Sub(h.due) < -e.holder.caps.Longest/2
		if !h.env.FirstFailure.IsZero() {
			d.envelope, remembered = h.env, true
			h.env.Write(msg.Metadata)
		}
		if d.envelope.FirstFailure.IsZero() {
			d.envelope.FirstFailure = h.first
		}
	}
	d.attempt = max(d.envelope.Attempt, 1)
	if d.rehelds > 0 && !remembered {
		// The broker counted each time it was held again as a return: not attempts.
		d.attempt = max(d.attempt-d.rehelds, 1)
		msg.Metadata[keys.Attempt] = strconv.Itoa(d.attempt)
	}
	if d.held && d.attempt < h.env.Attempt {
		// Never fewer than this process counted when it held it (a queue that does not
		// hold retries has no x-acquired-count to count it from).
		d.attempt = h.env.Attempt
		msg.Metadata[keys.Attempt] = strconv.Itoa(d.attempt)
	}
	return d
}

// ReadEnvelope reads the envelope from md. Fields whose keys are absent or unreadable
// are zero.
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

// chain lists the Retry middlewares (by wiring.ID) a message passes through.
type chain struct {
	mu  sync.Mutex
	ids []string
}

type chainKey struct{}

// joinChain records id in msg's context. The chain is shared by every middleware of
// the handler, so an outer one sees the inner ones after the handler returns.
func joinChain(msg *message.Message, id string) {
	c, _ := msg.Context().Value(chainKey{}).(*chain)
	if c == nil {
		c = &chain{}
		msg.SetContext(context.WithValue(msg.Context(), chainKey{}, c))
	}
	c.mu.Lock()
	c.ids = append(c.ids, id)
	c.mu.Unlock()
}

// inChain tells whether the Retry id is among the middlewares msg passes through.
func inChain(msg *message.Message, id string) bool {
	c, _ := msg.Context().Value(chainKey{}).(*chain)
	if c == nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Contains(c.ids, id)
}
