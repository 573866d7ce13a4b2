package xdeath

import (
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Headers that RabbitMQ sets on the messages it dead-letters or delivers.
const (
	// HeaderDeath holds the dead-letter history: an array of tables, one per
	// {queue, reason} pair, most recent first. See Death for the fields.
	HeaderDeath = "x-death"

	HeaderFirstDeathQueue    = "x-first-death-queue"
	HeaderFirstDeathReason   = "x-first-death-reason"
	HeaderFirstDeathExchange = "x-first-death-exchange"
	HeaderLastDeathQueue     = "x-last-death-queue"
	HeaderLastDeathReason    = "x-last-death-reason"
	HeaderLastDeathExchange  = "x-last-death-exchange"

	// HeaderDelay is read by the delayed-message exchange plugin, which
	// delivers it back as an integer.
	HeaderDelay = "x-delay"

	// HeaderDeliveryCount is set by quorum queues on redeliveries.
	HeaderDeliveryCount = "x-delivery-count"

	// HeaderCC and HeaderBCC carry sender-selected extra routing keys.
	HeaderCC  = "CC"
	HeaderBCC = "BCC"
)

const (
	firstDeathPrefix = "x-first-death-"
	lastDeathPrefix  = "x-last-death-"
)

// Fields of an x-death table.
const (
	FieldQueue              = "queue"
	FieldReason             = "reason"
	FieldCount              = "count"
	FieldTime               = "time"
	FieldExchange           = "exchange"
	FieldRoutingKeys        = "routing-keys"
	FieldOriginalExpiration = "original-expiration"
)

// Dead-letter reasons, as found in FieldReason and the *DeathReason headers.
const (
	ReasonRejected      = "rejected"       // rejected or nacked with requeue=false
	ReasonExpired       = "expired"        // message or queue TTL elapsed
	ReasonMaxLen        = "maxlen"         // queue length limit exceeded
	ReasonDeliveryLimit = "delivery_limit" // quorum queue delivery-limit exceeded
)

// IsBrokerOwned reports whether header is set by RabbitMQ itself and must
// therefore not be copied into a message published again: x-death, every
// x-first-death-* and x-last-death-* header, x-delay, x-delivery-count, CC
// and BCC. Names are case-sensitive, as they are on the wire.
func IsBrokerOwned(header string) bool {
	switch header {
	case HeaderDeath, HeaderDelay, HeaderDeliveryCount, HeaderCC, HeaderBCC:
		return true
	}
	return strings.HasPrefix(header, firstDeathPrefix) || strings.HasPrefix(header, lastDeathPrefix)
}

// Death is one entry of the x-death header: how often the message was
// dead-lettered from Queue for Reason.
type Death struct {
	Queue    string
	Reason   string // one of the Reason constants
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
	// Extra holds the fields this package does not know, nil if none.
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

// Total returns the sum of the counts of all deaths, saturating at
// math.MaxInt64.
func (i Info) Total() int64 {
	var total int64
	for _, d := range i.Deaths {
		if total > math.MaxInt64-d.Count {
			return math.MaxInt64
		}
		total += d.Count
	}
	return total
}

// Count returns how often the message was dead-lettered from queue for
// reason, 0 if never.
func (i Info) Count(queue, reason string) int64 {
	for _, d := range i.Deaths {
		if d.Queue == queue && d.Reason == reason {
			return d.Count
		}
	}
	return 0
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
	info.FirstQueue = p.optString(headers, HeaderFirstDeathQueue, HeaderFirstDeathQueue)
	info.FirstReason = p.optString(headers, HeaderFirstDeathReason, HeaderFirstDeathReason)
	info.FirstExchange = p.optString(headers, HeaderFirstDeathExchange, HeaderFirstDeathExchange)
	info.LastQueue = p.optString(headers, HeaderLastDeathQueue, HeaderLastDeathQueue)
	info.LastReason = p.optString(headers, HeaderLastDeathReason, HeaderLastDeathReason)
	info.LastExchange = p.optString(headers, HeaderLastDeathExchange, HeaderLastDeathExchange)
	if raw, ok := headers[HeaderDeath]; ok && p.err == nil {
		info.Deaths = p.deaths(raw)
	}
	if p.err != nil {
		return Info{}, p.err
	}
	return info, nil
}

// FromMetadata is Parse for the metadata of a message unmarshaled by
// Marshaler.
func FromMetadata(md message.Metadata) (Info, error) {
	typed, err := typedKeys(md)
	if err != nil {
		return Info{}, err
	}
	headers := amqp.Table{}
	for _, key := range []string{
		HeaderDeath,
		HeaderFirstDeathQueue, HeaderFirstDeathReason, HeaderFirstDeathExchange,
		HeaderLastDeathQueue, HeaderLastDeathReason, HeaderLastDeathExchange,
	} {
		v, ok, err := lookup(md, typed, key)
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
		p.err = pathError(ErrMalformed, path, "want %s, got %s", want, got)
	}
}

func (p *parser) deaths(raw interface{}) []Death {
	entries, ok := raw.([]interface{})
	if !ok {
		p.fail(HeaderDeath, "array", typeName(raw))
		return nil
	}
	deaths := make([]Death, 0, len(entries))
	for i, e := range entries {
		path := indexPath(HeaderDeath, i)
		t, ok := e.(amqp.Table)
		if !ok {
			p.fail(path, "table", typeName(e))
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
		Queue:              p.optString(t, FieldQueue, fieldPath(path, FieldQueue)),
		Reason:             p.optString(t, FieldReason, fieldPath(path, FieldReason)),
		Exchange:           p.optString(t, FieldExchange, fieldPath(path, FieldExchange)),
		Count:              p.count(t, fieldPath(path, FieldCount)),
		Time:               p.time(t, fieldPath(path, FieldTime)),
		RoutingKeys:        p.routingKeys(t, fieldPath(path, FieldRoutingKeys)),
		OriginalExpiration: p.optString(t, FieldOriginalExpiration, fieldPath(path, FieldOriginalExpiration)),
	}
	for k, v := range t {
		switch k {
		case FieldQueue, FieldReason, FieldExchange, FieldCount, FieldTime, FieldRoutingKeys, FieldOriginalExpiration:
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
		p.fail(path, "string", typeName(v))
	}
	return s
}

func (p *parser) count(t amqp.Table, path string) int64 {
	v, ok := t[FieldCount]
	if !ok {
		return 0
	}
	n, ok := Integer(v)
	switch {
	case !ok:
		p.fail(path, "integer", typeName(v))
	case n < 0:
		p.fail(path, "non-negative integer", strconv.FormatInt(n, 10))
	default:
		return n
	}
	return 0
}

func (p *parser) time(t amqp.Table, path string) time.Time {
	v, ok := t[FieldTime]
	if !ok {
		return time.Time{}
	}
	tm, ok := v.(time.Time)
	if !ok {
		p.fail(path, "timestamp", typeName(v))
	}
	return tm.UTC()
}

func (p *parser) routingKeys(t amqp.Table, path string) []string {
	v, ok := t[FieldRoutingKeys]
	if !ok {
		return nil
	}
	keys, ok := v.([]interface{})
	if !ok {
		p.fail(path, "array", typeName(v))
		return nil
	}
	out := make([]string, len(keys))
	for i, k := range keys {
		s, ok := k.(string)
		if !ok {
			p.fail(indexPath(path, i), "string", typeName(k))
			return nil
		}
		out[i] = s
	}
	return out
}

// Integer converts an AMQP table integer of any width (any Go integer type) to int64,
// if it fits.
func Integer(v any) (int64, bool) {
	switch n := v.(type) {
	case int8:
		return int64(n), true
	case int16:
		return int64(n), true
	case int32:
		return int64(n), true
	case int64:
		return n, true
	case int:
		return int64(n), true
	case uint8:
		return int64(n), true
	case uint16:
		return int64(n), true
	case uint32:
		return int64(n), true
	case uint:
		return int64(n), n <= math.MaxInt64
	case uint64:
		return int64(n), n <= math.MaxInt64
	}
	return 0, false
}
