package xdeath

import (
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/wire"
)

// Headers RabbitMQ sets on the messages it dead-letters (their names: internal/keys,
// which also tells them apart from the headers a copy may carry).
const (
	headerDeath              = keys.XDeath
	headerFirstDeathQueue    = keys.FirstDeath + fieldQueue
	headerFirstDeathReason   = keys.FirstDeath + fieldReason
	headerFirstDeathExchange = keys.FirstDeath + fieldExchange
	headerLastDeathQueue     = keys.LastDeath + fieldQueue
	headerLastDeathReason    = keys.LastDeath + fieldReason
	headerLastDeathExchange  = keys.LastDeath + fieldExchange
)

// Fields of an x-death table.
const (
	fieldQueue              = "queue"
	fieldReason             = "reason"
	fieldCount              = "count"
	fieldTime               = "time"
	fieldExchange           = "exchange"
	fieldRoutingKeys        = "routing-keys"
	fieldOriginalExpiration = "original-expiration"
)

// Death is one entry of the x-death header: how often the message was
// dead-lettered from Queue for Reason.
type Death struct {
	Queue string
	// Reason is why: "rejected" (rejected or nacked without requeue), "expired" (a
	// message or queue TTL), "maxlen" (a length limit) or "delivery_limit" (a quorum
	// queue's delivery limit).
	Reason   string
	Exchange string // exchange the message was published to before this death
	Count    int64  // times dead-lettered from Queue for Reason
	// Time is when the message was first dead-lettered from Queue for
	// Reason, in UTC.
	Time time.Time
	// RoutingKeys are the message's routing keys before this death, including
	// the CC ones.
	RoutingKeys []string
	// OriginalExpiration is the per-message TTL the message had, if any. The
	// broker removes the expiration property when dead-lettering.
	OriginalExpiration string
	// Extra has the fields this package does not know, nil if none.
	Extra amqp.Table
}

// Info is the parsed dead-letter history of a message.
//
// It is for diagnostics only. The counts restart whenever a copy of the
// message is published instead of being dead-lettered, and RabbitMQ 4.0 and
// later ignore an x-death header set by a client, so they cannot tell how
// often a message has been retried. Keep retry attempts in a header of your
// own.
type Info struct {
	// Deaths lists one entry per {queue, reason} pair, most recent first, as
	// the broker orders them.
	Deaths []Death

	// First* come from the x-first-death-* headers, the first time the
	// message was dead-lettered; Last* from the x-last-death-* headers.
	FirstQueue, FirstReason, FirstExchange string
	LastQueue, LastReason, LastExchange    string
}

// Parse reads the dead-letter headers from an AMQP header table, such as
// amqp091.Delivery.Headers. Absent headers leave the corresponding fields
// zero; an absent x-death gives nil Deaths. Times are returned in UTC.
// Values of the wrong type give an error wrapping ErrMalformed that names
// the header and field, such as "x-death[1].count: want integer, got string".
// Parse does not modify headers.
func Parse(headers amqp.Table) (Info, error) {
	var info Info
	p := parser{}
	info.FirstQueue = p.optString(headers, headerFirstDeathQueue, headerFirstDeathQueue)
	info.FirstReason = p.optString(headers, headerFirstDeathReason, headerFirstDeathReason)
	info.FirstExchange = p.optString(headers, headerFirstDeathExchange, headerFirstDeathExchange)
	info.LastQueue = p.optString(headers, headerLastDeathQueue, headerLastDeathQueue)
	info.LastReason = p.optString(headers, headerLastDeathReason, headerLastDeathReason)
	info.LastExchange = p.optString(headers, headerLastDeathExchange, headerLastDeathExchange)
	if raw, ok := headers[headerDeath]; ok && p.err == nil {
		info.Deaths = p.deaths(raw)
	}
	if p.err != nil {
		return Info{}, p.err
	}
	return info, nil
}

// FromMetadata is Parse for the metadata of a message unmarshaled by Marshaler. (The
// subscriber of a Retry does not carry x-death into metadata: only the string
// x-first-death-* and x-last-death-* headers are there.)
func FromMetadata(md message.Metadata) (Info, error) {
	typed, err := marshal.TypedKeys(md)
	if err != nil {
		return Info{}, err
	}
	headers := amqp.Table{}
	for _, key := range []string{
		headerDeath,
		headerFirstDeathQueue, headerFirstDeathReason, headerFirstDeathExchange,
		headerLastDeathQueue, headerLastDeathReason, headerLastDeathExchange,
	} {
		v, ok, err := marshal.Header(md, typed, key)
		if err != nil {
			return Info{}, err
		}
		if ok {
			headers[key] = v
		}
	}
	return Parse(headers)
}

// parser keeps the first error met, so that fields can be read one after
// the other and the error checked once.
type parser struct {
	err error
}

func (p *parser) fail(path, want, got string) {
	if p.err == nil {
		p.err = wire.PathError(ErrMalformed, path, "want %s, got %s", want, got)
	}
}

func (p *parser) deaths(raw interface{}) []Death {
	entries, ok := raw.([]interface{})
	if !ok {
		p.fail(headerDeath, "array", marshal.TypeName(raw))
		return nil
	}
	deaths := make([]Death, 0, len(entries))
	for i, e := range entries {
		path := marshal.IndexPath(headerDeath, i)
		t, ok := e.(amqp.Table)
		if !ok {
			p.fail(path, "table", marshal.TypeName(e))
			return nil
		}
		deaths = append(deaths, p.death(t, path))
		if p.err != nil {
			return nil
		}
	}
	return deaths
}

func (p *parser) death(t amqp.Table, path string) Death {
	d := Death{
		Queue:              p.optString(t, fieldQueue, marshal.FieldPath(path, fieldQueue)),
		Reason:             p.optString(t, fieldReason, marshal.FieldPath(path, fieldReason)),
		Exchange:           p.optString(t, fieldExchange, marshal.FieldPath(path, fieldExchange)),
		Count:              p.count(t, marshal.FieldPath(path, fieldCount)),
		Time:               p.time(t, marshal.FieldPath(path, fieldTime)),
		RoutingKeys:        p.routingKeys(t, marshal.FieldPath(path, fieldRoutingKeys)),
		OriginalExpiration: p.optString(t, fieldOriginalExpiration, marshal.FieldPath(path, fieldOriginalExpiration)),
	}
	for k, v := range t {
		switch k {
		case fieldQueue, fieldReason, fieldExchange, fieldCount, fieldTime, fieldRoutingKeys, fieldOriginalExpiration:
			continue
		}
		if d.Extra == nil {
			d.Extra = amqp.Table{}
		}
		d.Extra[k] = v
	}
	return d
}

func (p *parser) optString(t amqp.Table, key, path string) string {
	v, ok := t[key]
	if !ok {
		return ""
	}
	s, ok := v.(string)
	if !ok {
		p.fail(path, "string", marshal.TypeName(v))
	}
	return s
}

func (p *parser) count(t amqp.Table, path string) int64 {
	v, ok := t[fieldCount]
	if !ok {
		return 0
	}
	n, ok := wire.Integer(v)
	switch {
	case !ok:
		p.fail(path, "integer", marshal.TypeName(v))
	case n < 0:
		p.fail(path, "non-negative integer", strconv.FormatInt(n, 10))
	default:
		return n
	}
	return 0
}

func (p *parser) time(t amqp.Table, path string) time.Time {
	v, ok := t[fieldTime]
	if !ok {
		return time.Time{}
	}
	tm, ok := v.(time.Time)
	if !ok {
		p.fail(path, "timestamp", marshal.TypeName(v))
	}
	return tm.UTC()
}

func (p *parser) routingKeys(t amqp.Table, path string) []string {
	v, ok := t[fieldRoutingKeys]
	if !ok {
		return nil
	}
	keys, ok := v.([]interface{})
	if !ok {
		p.fail(path, "array", marshal.TypeName(v))
		return nil
	}
	out := make([]string, len(keys))
	for i, k := range keys {
		s, ok := k.(string)
		if !ok {
			p.fail(marshal.IndexPath(path, i), "string", marshal.TypeName(k))
			return nil
		}
		out[i] = s
	}
	return out
}
