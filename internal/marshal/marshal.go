// Package marshal turns AMQP deliveries into Watermill messages and back without
// refusing any header: string headers stay strings, other values are carried in a
// typed encoding (typed.go) or, failing that, raw; the typed values read are kept for
// publishing the message and its copies again without decoding them (receipt.go). It
// is the implementation behind
// xdeath.Marshaler and behind the marshaler of every retry subscriber.
package marshal

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"sort"
	"strconv"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/wire"
)

// ErrZeroDelivery: Unmarshal was given the zero amqp.Delivery, which no broker sends.
var ErrZeroDelivery = errors.New("the zero amqp.Delivery, read from a consumer's closed delivery channel, is not a message: refused, so that no handler runs on it (the subscriber reconnects)")

// DefaultUUIDKey is the header watermill-amqp keeps the message UUID in.
const DefaultUUIDKey = "_watermill_message_uuid"

// Options configure a Marshaler. The first three are watermill-amqp's
// DefaultMarshaler's, with the same meaning.
type Options struct {
	PostprocessPublishing     func(amqp.Publishing) amqp.Publishing
	NotPersistentDeliveryMode bool
	MessageUUIDHeaderKey      string

	// Retry is set for the subscriber of a Retry: Unmarshal records where the delivery
	// was published (keys.DeliveryExchange, keys.DeliveryRoutingKey), calls Delivered,
	// and leaves out what the retry would only drop: the non-string headers RabbitMQ
	// owns (x-death, x-delivery-count, ...) and the ttl-tiers routing header
	// (keys.Tier).
	Retry bool
	// Delivered marks each message as the Retry's (middleware.Retry.Delivered), with
	// its attempt when the returns counted (0: the one the message carries).
	Delivered func(msg *message.Message, attempt int)
	// Guard, if set, refuses the redelivery of a message whose handler failed without
	// the Retry's middleware (Reads): the subscriber config's.
	Guard *Guard
	// ReturnedAttempts counts each return of the delivery (RabbitMQ 4.3's
	// x-acquired-count) as an attempt: keys.Attempt is then the attempt carried by the
	// message (1 when absent) plus the returns. For work queues whose failed
	// deliveries RabbitMQ holds in delayed retry.
	ReturnedAttempts bool
}

// Marshaler implements the Marshaler interface of watermill-amqp v2 and v3 alike
// (both use amqp091-go's types).
type Marshaler struct{ Options }

// Unmarshal converts a delivery to a message. String headers become metadata as
// they are; every other header is stored encoded (EncodeValue) and listed under
// keys.TypedHeaders, or, where the encoding cannot carry it, kept under
// keys.RawHeaders. Headers named like the keys the marshaler reserves are ignored.
// It never fails for a header, so a delivery is never nacked forever for one. The
// typed values read are kept with the message (receipt.go) for Marshal, which then
// need not decode them again.
//
// It refuses the zero Delivery (ErrZeroDelivery): what a receive from a consumer's
// closed delivery channel gives. watermill-amqp (v2.1.3, v3.0.1) can read one as its
// channel or connection closes and would hand it to the handler as a message with no
// UUID, no headers and no body. Refused, it reaches no handler and is handed off
// nowhere: watermill-amqp then fails to nack it (nothing to nack) and reconnects.
// With a Guard it refuses a message whose handler failed without the Retry's
// middleware when it comes back (Reads): watermill-amqp nacks it, with requeue.
func (m Marshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	if isZero(&d) {
		return nil, ErrZeroDelivery
	}
	uuidKey := cmp.Or(m.MessageUUIDHeaderKey, DefaultUUIDKey) // the header the UUID is kept in
	uuid := ""
	md := make(message.Metadata, len(d.Headers)+4)
	var typed []kept
	var raw amqp.Table
	returns := int64(0)
	for k, v := range d.Headers {
		if keys.Reserved(k) {
			continue
		}
		if m.Retry && k == keys.Tier {
			continue
		}
		if s, ok := v.(string); ok {
			if k == uuidKey {
				uuid = s
				continue
			}
			md[k] = s
			continue
		}
		if m.ReturnedAttempts && k == keys.XAcquiredCount {
			returns, _ = wire.Integer(v)
		}
		if m.Retry && keys.BrokerOwned(k) {
			continue
		}
		if k != uuidKey && utf8.ValidString(k) {
			if enc, err := encodeValue(v, k); err == nil {
				md[k] = enc
				typed = append(typed, kept{key: k, enc: enc, val: fresh(v)})
				continue
			}
		}
		if raw == nil {
			raw = amqp.Table{}
		}
		raw[k] = v
	}
	var r *receipt
	if len(typed) > 0 {
		sort.Slice(typed, func(i, j int) bool { return typed[i].key < typed[j].key })
		names := make([]string, len(typed))
		for i, e := range typed {
			names[i] = e.key
		}
		list, err := marshalJSON(names)
		if err != nil {
			return nil, err
		}
		md[keys.TypedHeaders] = list
		r = &receipt{list: list, entries: typed}
	}
	if len(raw) > 0 {
		b, err := wire.AppendTable(nil, raw)
		if err != nil {
			return nil, err
		}
		md[keys.RawHeaders] = base64.StdEncoding.EncodeToString(b)
	}
	if m.Retry {
		md[keys.DeliveryExchange] = d.Exchange
		md[keys.DeliveryRoutingKey] = d.RoutingKey
	}
	attempt := 0
	// A copy that carries its due time (keys.ParkUntil) is held until then: its returns
	// are waits, not attempts.
	if _, due := md[keys.ParkUntil]; returns > 0 && !due {
		base, _ := keys.ParseAttempt(md[keys.Attempt])
		attempt = base + int(returns)
	}
	msg := message.NewMessage(uuid, d.Body)
	msg.Metadata = md
	if r != nil {
		keep(msg, r)
	}
	switch {
	case m.Retry && m.Delivered != nil:
		if g := m.Guard; g != nil && g.reads.Load() == nil {
			// The guard, carried to the Retry's Delivered, which attaches its Reads.
			ctx := msg.Context()
			msg.SetContext(g.ask)
			m.Delivered(msg, attempt)
			msg.SetContext(ctx)
		} else {
			m.Delivered(msg, attempt)
		}
		if m.Guard != nil {
			if err := m.Guard.admit(msg, d.Redelivered); err != nil {
				return nil, err
			}
		}
	case attempt > 0:
		md[keys.Attempt] = strconv.Itoa(attempt)
	}
	return msg, nil
}

// isZero tells whether d is the zero Delivery: every field of it.
func isZero(d *amqp.Delivery) bool {
	return d.Acknowledger == nil && d.DeliveryTag == 0 && d.Headers == nil && d.Body == nil &&
		d.Exchange == "" && d.RoutingKey == "" && d.ConsumerTag == "" && d.MessageId == "" &&
		d.ContentType == "" && d.ContentEncoding == "" && d.DeliveryMode == 0 && d.Priority == 0 &&
		d.CorrelationId == "" && d.ReplyTo == "" && d.Expiration == "" && d.Timestamp.IsZero() &&
		d.Type == "" && d.UserId == "" && d.AppId == "" && d.MessageCount == 0 && !d.Redelivered
}

// CopyContext returns the context for a copy of msg: msg's, carrying the typed header
// values Unmarshal read with msg, so that Marshal publishes the copy's typed headers
// without decoding them again. A message without typed headers gets its context as
// it is.
func CopyContext(msg *message.Message) context.Context {
	ctx := msg.Context()
	if _, ok := msg.Metadata[keys.TypedHeaders]; !ok {
		return ctx
	}
	r := receiptOf(msg)
	if r == nil || ctx.Value(receiptKey{}) == r {
		return ctx
	}
	return context.WithValue(ctx, receiptKey{}, r)
}

// Marshal converts a message to a publishing without modifying the message. Typed
// metadata is turned back into the original AMQP types and the headers under
// keys.RawHeaders are restored. A typed value whose metadata is still the string
// Unmarshal wrote is the value Unmarshal kept, for the message it returned and for a
// copy made with CopyContext, and is not decoded again; any other is decoded. Left out
// are the reserved keys and every header RabbitMQ owns (keys.BrokerOwned).
// PostprocessPublishing runs last and sees every header.
//
// Marshal does not fail on metadata: a value listed under keys.TypedHeaders that no
// longer decodes (a handler set a plain string there) is sent as the string it now is,
// and a keys.RawHeaders value that is not one Unmarshal wrote is left out.
func (m Marshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	uuidKey := cmp.Or(m.MessageUUIDHeaderKey, DefaultUUIDKey) // the header the UUID is kept in
	md := msg.Metadata
	headers := make(amqp.Table, len(md)+1)
	for k, s := range md {
		if k == uuidKey || keys.KindOf(k) != keys.Published {
			continue
		}
		headers[k] = s
	}
	if list, ok := md[keys.TypedHeaders]; ok {
		r := receiptOf(msg)
		if r != nil && list == r.list {
			// The typed keys are the receipt's: each value kept where its string is
			// still the one written (read once, write once), else decoded.
			for _, e := range r.entries {
				switch s, ok := headers[e.key].(string); {
				case ok && s == e.enc:
					headers[e.key] = fresh(e.val)
				case ok:
					headers[e.key] = decoded(e.key, s)
				}
			}
		} else {
			typed, err := TypedKeys(md)
			if err != nil {
				typed = nil // an unreadable list: every value is the string it is
			}
			for k, ok := range typed {
				if s, in := headers[k].(string); ok && in {
					headers[k] = typedValue(r, k, s)
				}
			}
		}
	}
	headers[uuidKey] = msg.UUID
	// Restored last: a header Unmarshal could only keep raw (a non-string UUID header
	// among them) goes back as it came.
	if s, ok := msg.Metadata[keys.RawHeaders]; ok {
		if b, err := base64.StdEncoding.DecodeString(s); err == nil {
			if raw, err := wire.ParseTable(b); err == nil {
				for k, v := range raw {
					if keys.KindOf(k) == keys.Published {
						headers[k] = v
					}
				}
			}
		}
	}
	p := amqp.Publishing{Body: msg.Payload, Headers: headers}
	if !m.NotPersistentDeliveryMode {
		p.DeliveryMode = amqp.Persistent
	}
	if m.PostprocessPublishing != nil {
		p = m.PostprocessPublishing(p)
	}
	return p, nil
}

// typedValue is what the metadata string s of the typed header key publishes as: the
// value r kept for it if s is still the string Unmarshal wrote, else decoded.
func typedValue(r *receipt, key, s string) interface{} {
	if v, ok := r.value(key, s); ok {
		return v
	}
	return decoded(key, s)
}

// decoded is the typed header key's metadata string s decoded, or s if it does not
// decode (a handler set a plain string).
func decoded(key, s string) interface{} {
	if v, err := decodeValue(s, key); err == nil {
		return v
	}
	return s
}

// TypedKeys parses the keys.TypedHeaders list of md: the keys whose values are
// encoded.
func TypedKeys(md message.Metadata) (map[string]bool, error) {
	s, ok := md[keys.TypedHeaders]
	if !ok {
		return nil, nil
	}
	var list []string
	if err := json.Unmarshal([]byte(s), &list); err != nil {
		return nil, wire.PathError(wire.ErrMalformed, keys.TypedHeaders, "want JSON array of strings: %v", err)
	}
	typed := make(map[string]bool, len(list))
	for _, k := range list {
		typed[k] = !keys.Reserved(k)
	}
	return typed, nil
}

// Header returns the AMQP header key from metadata written by Unmarshal, decoded to
// its original type; ok is false if it is absent.
func Header(md message.Metadata, typed map[string]bool, key string) (value interface{}, ok bool, err error) {
	s, ok := md[key]
	if !ok {
		return nil, false, nil
	}
	if !typed[key] {
		return s, true, nil
	}
	v, err := decodeValue(s, key)
	if err != nil {
		return nil, false, err
	}
	return v, true, nil
}
