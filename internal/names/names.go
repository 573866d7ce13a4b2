// Package names builds every exchange and queue name the library declares, under one
// prefix, and the tier names of ttl-tiers. Nothing else spells a name.
package names

import (
	"crypto/sha256"
	"encoding/hex"
	"hash/fnv"
	"strconv"
	"strings"
	"time"
)

// DefaultPrefix starts every name unless amqpretry.Config.Prefix says otherwise.
const DefaultPrefix = "amqpretry"

// MaxBytes is the longest queue or exchange name (and routing key) AMQP carries.
// amqp091-go does not refuse a longer one: it wraps the length byte.
const MaxBytes = 255

// Names are the names under one prefix.
type Names struct{ Prefix string }

// Poison is the default poison queue.
func (n Names) Poison() string { return n.Prefix + ".poison" }

// Parking is the parking exchange and queue of the backends with a delivery exchange.
func (n Names) Parking() string { return n.Prefix + ".parking" }

// DelayExchange is the headers exchange ttl-tiers publishes to.
func (n Names) DelayExchange() string { return n.Prefix + ".delay" }

// TierQueue is the ttl-tiers queue of tier t.
func (n Names) TierQueue(t time.Duration) string { return n.Prefix + ".delay." + Tier(t) }

// TierQueues is every ttl-tiers queue, of any tier, as a pattern (for messages).
func (n Names) TierQueues() string { return n.Prefix + ".delay.*" }

// Deliver is the delivery exchange of ttl-tiers.
func (n Names) Deliver() string { return n.Prefix + ".deliver" }

// Level is the binary-levels exchange and queue of level l.
func (n Names) Level(l int) string { return n.Prefix + ".level." + strconv.Itoa(l) }

// LevelsDeliver is the delivery exchange of binary-levels.
func (n Names) LevelsDeliver() string { return n.Prefix + ".levels.deliver" }

// Delayed is the delayed-exchange backend's x-delayed-message exchange.
func (n Names) Delayed() string { return n.Prefix + ".delayed" }

// Tier spells a tier the short way: 1s, 5s, 2m, 1h30m, 250ms.
func Tier(t time.Duration) string {
	s := t.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// Behind is the queue where the messages of key wait behind its head, for work queue
// queue (amqpretry.Config.OrderKey): "<prefix>.behind.<hash of queue>.<key>", or, for a
// key too long for AMQP's names, "<prefix>.behind.<hash of queue>.#<hash of key>".
// Its arguments name queue and key in full (declare.BehindQueue).
func (n Names) Behind(queue, key string) string {
	h := fnv.New64a()
	h.Write([]byte(queue))
	base := n.Prefix + ".behind." + strconv.FormatUint(h.Sum64(), 16) + "."
	if len(base)+len(key) <= MaxBytes {
		return base + key
	}
	sum := sha256.Sum256([]byte(key))
	return base + "#" + hex.EncodeToString(sum[:20])
}

// BehindQueues is every queue of Behind, as a pattern.
func (n Names) BehindQueues() string { return n.Prefix + ".behind.*" }

// BehindHead is the exchange that marks head, a message's UUID, as the head of key in
// work queue queue: "<prefix>.behind-head.<hash of queue, key and head>". It is bound to
// the key's behind queue, and deleted with it (auto-delete).
func (n Names) BehindHead(queue, key, head string) string {
	sum := sha256.Sum256([]byte(queue + "\x00" + key + "\x00" + head))
	return n.Prefix + ".behind-head." + hex.EncodeToString(sum[:20])
}
