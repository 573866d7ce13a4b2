package delay

import (
	"errors"
	"fmt"
	"time"

	"github.com/amqpretry/amqpretry/internal/backend"
)

// HeldRetries has RabbitMQ 4.3+ hold the first n retries in the work queue itself
// (its delayed retry of quorum queues), delay apart, before then takes the next ones:
// no copy, no publish for those. delay is a whole number of milliseconds; 0 is the
// default, 1s. then is a backend on the broker that runs on RabbitMQ 4.3 over AMQP
// 0-9-1 (TTLTiers or BinaryLevels); nil is the default, TTLTiers(). n 0 gives then
// alone. The work queues must be quorum queues; the subscriber config gets the queue
// arguments they need. Not with Policy.Immediate.
//
// After them then's retries follow the policy's schedule started again from its first
// delay (Delays[0]), as after Policy.Immediate. A delay of the
// error's own (RetryAfter, or Classify's) skips them: that retry goes to then at once,
// which keeps its delay. A held retry carries nothing new on the wire: when it comes
// back, this process writes the envelope it kept into the message's metadata
// (middleware.ReadEnvelope gives its attempt, error and Due, so lateness is
// time.Since(env.Due) as on a copy); after a restart it has none.
func HeldRetries(n int, delay time.Duration, then Backend) Backend {
	if n == 0 && then != nil {
		return then
	}
	if then == nil {
		then = TTLTiers()
	}
	return heldRetriesValue{n: n, delay: delay, then: then}
}

// heldRetriesValue is HeldRetries as configured. It opens as then: the Config derives
// the held retries in front of it from Front.
type heldRetriesValue struct {
	lib
	n     int
	delay time.Duration // 0: the default
	then  Backend
}

// Name is then's: where the retries past the held ones go, and what is on the broker.
func (b heldRetriesValue) Name() string { return b.then.Name() }

func (b heldRetriesValue) String() string {
	return fmt.Sprintf("%s after %d retries held in the work queue %s apart", b.then, b.n, b.heldDelay())
}

func (b heldRetriesValue) heldDelay() time.Duration {
	if b.delay == 0 {
		return backend.DefaultRetryDelay
	}
	return b.delay
}

// Front is the held retries: n of them, held by delayed-retry of their delay, then
// then's.
func (b heldRetriesValue) Front() (n int, held, then backend.Opener) {
	return b.n, delayedRetryValue{delay: b.heldDelay()}, b.then.(backend.Opener)
}

// Open validates the arguments and opens then, which must be able to take the
// retries after those held in the work queue: a backend on the broker, over AMQP
// 0-9-1, that runs on RabbitMQ 4.3.
func (b heldRetriesValue) Open(s backend.Setup) (backend.Backend, error) {
	var errs []error
	if b.n < 0 {
		errs = append(errs, fmt.Errorf("delay.HeldRetries(n): %d is negative", b.n))
	}
	if err := backend.CheckRetryDelay("delay.HeldRetries(delay)", b.heldDelay()); err != nil {
		errs = append(errs, err)
	}
	if _, ok := b.then.(backend.Fronted); ok {
		errs = append(errs, errors.New("delay.HeldRetries(then): held retries again: give HeldRetries once"))
	}
	opened, err := b.then.(backend.Opener).Open(s)
	if err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	if !followsHeld(opened) {
		return nil, fmt.Errorf("delay.HeldRetries(then): retries held in the work queue (RabbitMQ 4.3) cannot stand in front of the %s backend: give a copying backend, delay.TTLTiers() or delay.BinaryLevels(0)", opened.Name())
	}
	return opened, nil
}

// followsHeld tells whether b can take the retries after those held in the work queue:
// a backend on the broker, over AMQP 0-9-1, that runs on RabbitMQ 4.3, and does not
// hold every retry in the work queue itself.
func followsHeld(b backend.Backend) bool {
	_, inProcess := b.(backend.InProcess)
	_, amqp1 := b.(backend.AMQP1)
	_, constant := b.(backend.Constant)
	g, gated := b.(backend.VersionGate)
	return !inProcess && !amqp1 && !constant && (!gated || g.CheckVersion("4.3.0") == nil)
}
