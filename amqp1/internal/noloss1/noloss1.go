// Package noloss1 is what the no-loss test of the delivery-time backend (amqp1's
// TestNoLoss) and its consumer program (../nolosscons) share, beside each message's
// fate (internal/testsupport/noloss/fates): the names of a run's queues and of the
// record the consumer writes per handled message.
package noloss1

import "time"

// Failures is how many attempts of a fates.Transient message fail.
const Failures = 2

// RetryDelay is the policy's delay before every retry: long enough for the test to see
// retries held in the work queue through rabbitmqctl, whose every run takes seconds,
// before and while a fault is injected.
const RetryDelay = 10 * time.Second

// MaxAttempts is the policy's limit: above Failures + 1 with room for the delivery
// count a lost connection adds to the deliveries it had (a quorum queue counts those
// as failed deliveries).
const MaxAttempts = 10

// Queues of a run: the work queue the consumer's handlers consume, the results queue
// its records go to, the poison queue of the Retry (Config.Prefix is the prefix).
func WorkQueue(prefix string) string    { return prefix + ".work" }
func ResultsQueue(prefix string) string { return prefix + ".results" }
func PoisonQueue(prefix string) string  { return prefix + ".poison" }

// ContainerID is the AMQP container-id of the consumer's connections, and the start of
// its poison connection's connection_name: what the test closes them by.
func ContainerID(prefix string) string { return prefix + "-consumer" }

// Metadata of a record (the record's UUID is the handled message's).
const (
	// AttemptKey: the attempt that succeeded (amqpretry.Attempt).
	AttemptKey = "noloss-attempt"
	// ArrivedKey: when that delivery reached the handler, Unix milliseconds.
	ArrivedKey = "noloss-arrived-ms"
	// LateKey: for a retry, how late it arrived against its envelope's due time, in
	// microseconds.
	LateKey = "noloss-late-us"
	// ConsumerKey: the consumer process's id.
	ConsumerKey = "noloss-consumer-pid"
)

// Ready is the line the consumer prints on stdout once its handlers run.
const Ready = "NOLOSS-CONSUMER-READY"
