package amqpretry

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/keys"
)

// DedupStore is where Config.Dedup remembers the messages already handled: by default
// this process's memory; a store of your own (a table in the database your handlers
// write to, say: the module github.com/amqpretry/amqpretry/pgdedup has one for
// PostgreSQL) makes the memory survive a restart and shared by every instance. Its
// methods are called on the handler's goroutine and must be safe for concurrent use.
type DedupStore interface {
	// Seen tells whether key was recorded and is not past its time.
	Seen(ctx context.Context, key string) (bool, error)
	// Record records key until the time given; recording it again moves its time.
	Record(ctx context.Context, key string, until time.Time) error
}

// DedupKey is a KeyFactory for Watermill's middleware.Deduplicator that tells a retry
// from a duplicate, for applications that keep Watermill's deduplicator beside the
// Retry:
//
//	wmiddleware.Deduplicator{KeyFactory: amqpretry.DedupKey}
//
// Watermill's deduplicator records a message's key before the handler runs and keeps
// it when the handler fails, so a retry carrying the key of the attempt that failed is
// dropped as a duplicate: acked, its work never done. DedupKey's key is the handler,
// the message UUID and the attempt (Attempt), with the message's redrives, the due
// time of a retry parked again until it is due, and the times this process gave the
// message back to the broker unhandled (a failed hand-off, a Close): a retry has the
// next attempt, a redelivered duplicate the same. A message given back by another
// process keeps its key: with a repository shared between processes, such a message
// is dropped. It works with the
// deduplicator outside the Retry (router.AddMiddleware before it) or inside (the
// handler's, after Retry.AddHandler). Config.Dedup does the same without Watermill's
// deduplicator, and keeps nothing for a message that failed: docs/dedup.md compares
// them. It never fails.
func DedupKey(msg *message.Message) (string, error) {
	ctx := msg.Context()
	name := message.HandlerNameFromCtx(ctx)
	if name == "" {
		name = message.SubscribeTopicFromCtx(ctx)
	}
	var b strings.Builder
	b.Grow(len(name) + len(msg.UUID) + 8)
	b.WriteString(name)
	b.WriteByte('/')
	b.WriteString(msg.UUID)
	b.WriteByte('/')
	b.WriteString(strconv.Itoa(Attempt(msg)))
	if n, ok := keys.ParseAttempt(msg.Metadata.Get(keys.RedriveCount)); ok {
		b.WriteString("/r")
		b.WriteString(strconv.Itoa(n))
	}
	if _, parked := msg.Metadata[keys.ParkUntil]; parked {
		// Parked for longer than the backend keeps: each time it comes back before it
		// is due it is parked again, with the same attempt and a new due time.
		b.WriteString("/p")
		b.WriteString(msg.Metadata.Get(keys.Due))
	}
	if n := msg.Metadata.Get(keys.GivenBack); n != "" {
		b.WriteString("/g")
		b.WriteString(n)
	}
	return b.String(), nil
}
