// Package noloss is the no-loss test of amqpretry (issue 8): N messages through a
// consumer process that is killed and restarted, a broker whose connections are closed
// and whose application is stopped and started, and at the end every message accounted
// for. The test is TestNoLoss; the consumer is the main package in ./consumer. This file
// holds what both share: the configuration, the fate of a message and the record the
// consumer writes for each message it handled.
//
// Run it against a broker you may disturb (it closes every connection of that broker
// and stops its application):
//
//	AMQPRETRY_NOLOSS=1 AMQPRETRY_BROKER_RESTART=1 go test -count=1 -timeout 30m -run TestNoLoss -v ./internal/noloss
package noloss

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
)

// Fate is what the consumer's handler does with a message, read from the message's own
// payload (never from the consumer's memory, which a SIGKILL wipes).
type Fate string

const (
	// FateOK: handled on the first attempt.
	FateOK Fate = "ok"
	// FateTransient: the handler fails on attempts 1 and 2, then succeeds on attempt 3.
	FateTransient Fate = "transient"
	// FatePermanent: the handler returns middleware.Permanent; the message is poisoned.
	FatePermanent Fate = "permanent"
)

// TransientFailures is how many attempts of a FateTransient message fail.
const TransientFailures = 2

// FateFor spreads the fates over message indexes: 1% permanent, 20% transient, the rest
// ok.
func FateFor(i int) Fate {
	switch r := i % 100; {
	case r == 0:
		return FatePermanent
	case r <= 20:
		return FateTransient
	default:
		return FateOK
	}
}

// Payload is the body of message i: its fate, then its index.
func Payload(i int) []byte { return []byte(string(FateFor(i)) + " " + strconv.Itoa(i)) }

// FateOf reads the fate from a payload made by Payload.
func FateOf(payload []byte) (Fate, error) {
	word, _, _ := strings.Cut(string(payload), " ")
	switch f := Fate(word); f {
	case FateOK, FateTransient, FatePermanent:
		return f, nil
	}
	return "", fmt.Errorf("payload %q carries no fate", payload)
}

// Policy is the retry policy of the run: short, so that a run takes a minute or two.
// MaxAttempts leaves one attempt spare after the transient failures: a message poisoned
// with max-attempts is a failure of the run, not an expected outcome.
func Policy() middleware.Policy {
	return middleware.Policy{MaxAttempts: TransientFailures + 2, Delays: []time.Duration{time.Second, 2 * time.Second}}
}

// Levels is the binary-levels backend's level count in this test: delays up to 7 s.
const Levels = 3

// Config is the amqpretry configuration of the run, the same in the test (which builds
// it once to declare the topology and to find out whether the backend can run) and in
// the consumer.
func Config(uri, backend, prefix string) amqpretry.Config {
	return amqpretry.Config{
		Subscriber: wamqp.NewDurableQueueConfig(uri),
		Delay: delay.Config{
			Backend: backend,
			Prefix:  prefix,
			Tiers:   Policy().Delays, // ttl-tiers: one tier per delay of the policy
			Levels:  Levels,
		},
		Policy: Policy(),
	}
}

// Names of the queues of a run with the given prefix.
func WorkQueue(prefix string) string    { return prefix + ".work" }
func ResultsQueue(prefix string) string { return prefix + ".results" }

// AttemptHeader is the header of a result record holding the attempt that succeeded.
const AttemptHeader = "noloss-attempt"

// Ready is the line the consumer prints on stdout once its handlers are subscribed.
const Ready = "noloss-consumer ready"
