// Package keys names every metadata key and header the library writes, once. None
// starts with "x-": RabbitMQ owns that space, and 4.0+ ignores or rewrites some of it
// on republished copies.
package keys

import (
	"strconv"
	"strings"
)

// The failure envelope's keys, written by the retry middleware on retried and
// poisoned copies and by a redrive. Which keys the envelope has, and how each field is
// written and read, is listed once, in middleware (envelopeFields, behind
// middleware.Envelope); every other place derives from that list.
const (
	Attempt            = "amqpretry-attempt"
	MaxAttempts        = "amqpretry-max-attempts"
	PoisonReason       = "amqpretry-poison-reason"
	Error              = "amqpretry-error"
	ErrorTypes         = "amqpretry-error-types"
	Stack              = "amqpretry-stack"
	FirstFailure       = "amqpretry-first-failure"
	LastFailure        = "amqpretry-last-failure"
	Handler            = "amqpretry-handler"
	Topic              = "amqpretry-topic"
	Queue              = "amqpretry-queue"
	OriginalExchange   = "amqpretry-original-exchange"
	OriginalRoutingKey = "amqpretry-original-routing-key"
	RequestedDelay     = "amqpretry-requested-delay"
	EffectiveDelay     = "amqpretry-effective-delay"
	Due                = "amqpretry-due"
	DroppedHeaders     = "amqpretry-dropped-headers"
	RedrivenAt         = "amqpretry-redriven-at"
	RedriveCount       = "amqpretry-redrive-count"
	RedrivenFrom       = "amqpretry-redriven-from"
)

// ParseAttempt reads a value of Attempt: which attempt a delivery is, from 1. A
// missing or unreadable value is the first attempt, and ok is false. It is the one
// parser of an attempt.
func ParseAttempt(s string) (n int, ok bool) {
	if s == "" {
		return 1, false // most deliveries are first attempts: no error to build
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		return 1, false
	}
	return n, true
}

// ParkUntil is written on a retry copy whose delay (a RetryAfter, or the policy's) is
// longer than the backend keeps: when it is due. The middleware re-parks it until
// then instead of running the handler early. (The header says "hold", its name from
// before the words were settled: copies already parked carry it.)
const ParkUntil = "amqpretry-hold-until"

// Order keys (amqpretry.Config.OrderKey): published on the messages that keep a key's
// order through its retries.
const (
	// OrderHead is written on the retry copy of a message of an order key, with the
	// key: the copy is the key's head, whose success releases the messages behind it.
	OrderHead = "amqpretry-order-head"
	// OrderRelease makes a message with no payload a release of the key it names: the
	// messages behind the key run, in order, and the key is unblocked. The amqpretry
	// command publishes it (`amqpretry blocked release`), and so does a release that
	// could not finish, or that the process might die before finishing.
	OrderRelease = "amqpretry-order-release"
	// OrderReleaseHead names the head (its message's UUID) a release runs for (the
	// middleware's, or the command's for a poisoned head): when it comes, it releases
	// the key only if that message is still the key's head.
	OrderReleaseHead = "amqpretry-order-release-head"
)

// Keys the marshaler writes on a received message and never publishes.
const (
	// TypedHeaders lists, as a sorted JSON array, the metadata keys with encoded
	// non-string header values.
	TypedHeaders = "amqpretry-typed-headers"
	// RawHeaders has, base64 of an AMQP wire table, the headers the typed encoding
	// cannot carry.
	RawHeaders = "amqpretry-raw-headers"
	// DeliveryExchange and DeliveryRoutingKey say where the delivery was published.
	DeliveryExchange   = "amqpretry-delivery-exchange"
	DeliveryRoutingKey = "amqpretry-delivery-routing-key"
	// Subscriber identifies the Retry whose subscriber config delivered the message:
	// its id, followed by "/<n>" for the n-th queue-name function registered with
	// hooks.DeliveredFor.
	Subscriber = "amqpretry-subscriber"
	// GivenBack is the times the Retry gave the delivery back to the broker unhandled
	// before (a failed hand-off, a Close, an outage), written on receipt only when
	// not zero: amqpretry.DedupKey reads it.
	GivenBack = "amqpretry-given-back"
)

// Tier is the header the ttl-tiers backend routes a copy on: the tier's name. It is
// routing data for the broker: the retry subscriber's marshaler does not carry it into
// metadata.
const Tier = "amqpretry-tier"

// OfDelivery are the keys the marshaler writes on receipt about the delivery itself
// (where it was published, which Retry's subscriber delivered it): a copy of the
// message never carries them.
var OfDelivery = [...]string{DeliveryExchange, DeliveryRoutingKey, Subscriber, GivenBack}

// Reserved tells whether key is one the marshaler writes on receipt and never
// publishes.
func Reserved(key string) bool { return KindOf(key) == ReservedKey }

// MaxErrorTypes bounds how many Go types of an error's chain an envelope lists.
const MaxErrorTypes = 16

// Headers RabbitMQ sets on the messages it dead-letters, delays or redelivers.
const (
	XDeath         = "x-death"
	XDelay         = "x-delay" // the delayed-message plugin's delay, in ms
	XDeliveryCount = "x-delivery-count"
	XAcquiredCount = "x-acquired-count" // RabbitMQ 4.3: times a message was handed to a consumer and returned
	// FirstDeath and LastDeath start the names of the headers that sum up a message's
	// first and last dead-lettering: x-first-death-queue, -reason, -exchange.
	FirstDeath = "x-first-death-"
	LastDeath  = "x-last-death-"
)

// BrokerOwned tells whether header is set by RabbitMQ itself and must never be copied
// into a message published again: x-death, every x-first-death-* and x-last-death-*
// header, x-delay, x-delivery-count, x-acquired-count, CC and BCC. Copied, x-death
// feeds RabbitMQ's dead-letter cycle detection, which can drop the message silently;
// the others describe the delivery that just happened, not the next one.
func BrokerOwned(header string) bool { return KindOf(header) == BrokerOwnedKey }

// Kind is what a header is to the library (KindOf).
type Kind uint8

// The kinds of header: published with the message, or never (the marshaler's own, or
// RabbitMQ's).
const (
	Published      Kind = iota
	ReservedKey         // Reserved
	BrokerOwnedKey      // BrokerOwned
)

// KindOf is what header is: ReservedKey, BrokerOwnedKey, or Published.
func KindOf(header string) Kind {
	switch header {
	case TypedHeaders, RawHeaders, DeliveryExchange, DeliveryRoutingKey, Subscriber, GivenBack:
		return ReservedKey
	case XDeath, XDelay, XDeliveryCount, XAcquiredCount, "CC", "BCC":
		return BrokerOwnedKey
	}
	if strings.HasPrefix(header, FirstDeath) || strings.HasPrefix(header, LastDeath) {
		return BrokerOwnedKey
	}
	return Published
}
