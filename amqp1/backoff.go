package amqp1

import (
	"math/rand/v2"
	"time"
)

// backoff is the Subscriber's pause between reconnection attempts: it starts at
// initial, doubles up to max, with up to 20% random jitter either way so that many
// subscribers do not reconnect in step.
type backoff struct {
	initial, max, next time.Duration
}

func newBackoff(initial, max time.Duration) *backoff {
	return &backoff{initial: initial, max: max, next: initial}
}

func (b *backoff) pause() time.Duration {
	d := b.next
	b.next *= 2
	if b.next > b.max {
		b.next = b.max
	}
	jitter := time.Duration(rand.Int64N(int64(d)/5+1)) * 2
	return d - d/5 + jitter
}

func (b *backoff) reset() {
	b.next = b.initial
}
