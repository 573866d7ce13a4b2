// Package fates is what the no-loss tests (internal/testsupport/noloss, and amqp1's)
// and their consumer programs share about each message: what its handler does with it,
// carried in its own payload (never in the consumer's memory, which a SIGKILL wipes).
package fates

import (
	"fmt"
	"strconv"
	"strings"
)

// Fate is what the consumer's handler does with a message.
type Fate string

const (
	// OK: handled on the first attempt.
	OK Fate = "ok"
	// Transient: the handler fails on the run's first Failures attempts, then succeeds.
	Transient Fate = "transient"
	// Permanent: the handler returns amqpretry.Permanent; the message is poisoned.
	Permanent Fate = "permanent"
	// Once: the handler fails on the first attempt, then succeeds (the order
	// partitions' projection, TestOrderPartitions).
	Once Fate = "once"
)

// For spreads the fates over message indexes: 1% permanent, 20% transient, the rest ok.
func For(i int) Fate {
	switch r := i % 100; {
	case r == 0:
		return Permanent
	case r <= 20:
		return Transient
	default:
		return OK
	}
}

// Payload is the body of message i: its fate (For), then its index.
func Payload(i int) []byte { return PayloadOf(For(i), i) }

// PayloadOf is the body of message i with fate f: f, then i.
func PayloadOf(f Fate, i int) []byte { return []byte(string(f) + " " + strconv.Itoa(i)) }

// Of reads the fate from a payload made by Payload.
func Of(payload []byte) (Fate, error) {
	word, _, _ := strings.Cut(string(payload), " ")
	switch f := Fate(word); f {
	case OK, Transient, Permanent, Once:
		return f, nil
	}
	return "", fmt.Errorf("payload %q carries no fate", payload)
}
