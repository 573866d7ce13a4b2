package amqpretry

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/sony/gobreaker"

	"github.com/amqpretry/amqpretry/internal/ctxkey"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// Permanent marks err as not worth retrying: the message is poisoned on this failure.
// Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// RetryAfter asks for the next attempt after d instead of the policy's delay, as an
// HTTP 429 or 503 Retry-After does. The attempt still counts towards MaxAttempts.
// RetryAfter(nil, d) is nil.
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &retryAfterError{err: err, after: d}
}

type retryAfterError struct {
	err   error
	after time.Duration
}

func (e *retryAfterError) Error() string { return e.err.Error() }
func (e *retryAfterError) Unwrap() error { return e.err }

// Decision is what happens to a message after a failed attempt. It is decided by the
// middleware; it is declared here because Config.Classify returns it.
type Decision struct {
	// Permanent poisons the message now.
	Permanent bool
	// Delay, when positive, replaces the policy's delay before the next attempt.
	Delay time.Duration
	// Unavailable says the failure is a dependency's, not the message's: the work
	// queue's outage begins at once (Config.Outage), and the message waits, spending
	// no attempt. Permanent and Delay take precedence over it.
	Unavailable bool
	// Undecodable says the chain has an error of a payload that can never decode
	// (DecisionOf's list): Permanent is set with it, and the poisoned copy's envelope
	// says why.
	Undecodable bool
}

// ClassifyParams is what Config.Classify is given. Fields may be added.
type ClassifyParams struct {
	// Err is the handler's error.
	Err error
	// Message is the message that failed. Do not modify it.
	Message *message.Message
	// Attempt is the attempt that failed, from 1.
	Attempt int
	// Default is DecisionOf(Err): the decision of the error's own marks and of a
	// decode error in its chain. Permanent (a Permanent mark, or an error of a payload
	// that can never decode) poisons; RetryAfter sets the delay; Unavailable (or an
	// open CircuitBreaker) begins an outage; any other error is retried on the
	// policy's schedule.
	Default Decision
}

// protobufPrefix starts the package path of every error type of protobuf-go
// (google.golang.org/protobuf/internal/errors): what errors.Is(err, proto.Error)
// matches, read without importing protobuf-go, which a program that does not use it
// would then link.
const protobufPrefix = "google.golang.org/protobuf/"

// DecisionOf returns the decision of err's chain, as errors.As walks it:
//   - Permanent anywhere poisons the message now;
//   - so does an error of a payload that can never decode, which no retry fixes:
//     encoding/json's *json.SyntaxError and *json.UnmarshalTypeError, and every
//     error of google.golang.org/protobuf (what errors.Is(err, proto.Error) matches,
//     told by its type's package; the errors of github.com/gogo/protobuf are not);
//   - the first RetryAfter sets the delay;
//   - Unavailable anywhere, or gobreaker's ErrOpenState or ErrTooManyRequests (from
//     Watermill's CircuitBreaker), says a dependency is down: the work queue's outage
//     begins at once (Config.Outage);
//   - any other error is retried on the policy's schedule.
//
// It is what ClassifyParams.Default has: a Config.Classify may decide otherwise, as
// Config.Classify's example of retrying decode errors does.
func DecisionOf(err error) Decision {
	var d Decision
	found := false // the first RetryAfter's delay is taken
	// err's chain, as errors.As walks it: depth first, outermost first.
	var buf [8]error
	todo := append(buf[:0], err)
	for len(todo) > 0 {
		err := todo[len(todo)-1]
		todo = todo[:len(todo)-1]
		if err == nil {
			continue
		}
		switch e := err.(type) {
		case *permanentError:
			d.Permanent = true
		case *retryAfterError:
			if !found {
				d.Delay, found = max(e.after, 0), true
			}
		case *unavailableError:
			d.Unavailable = true
		case *json.SyntaxError, *json.UnmarshalTypeError:
			d.Permanent, d.Undecodable = true, true
		default:
			// An open circuit breaker's refusal (Watermill's CircuitBreaker
			// middleware, sony/gobreaker).
			if err == gobreaker.ErrOpenState || err == gobreaker.ErrTooManyRequests {
				d.Unavailable = true
			}
			// An error of protobuf-go, told by its type's package.
			t := reflect.TypeOf(err)
			if t.Kind() == reflect.Pointer {
				t = t.Elem()
			}
			if strings.HasPrefix(t.PkgPath(), protobufPrefix) {
				d.Permanent, d.Undecodable = true, true
			}
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			todo = append(todo, u.Unwrap())
		case interface{ Unwrap() []error }:
			inner := u.Unwrap()
			for i := len(inner) - 1; i >= 0; i-- {
				todo = append(todo, inner[i])
			}
		}
	}
	return d
}

// Attempt returns which attempt this delivery of msg is, from 1 (a missing or
// unreadable count is the first).
func Attempt(msg *message.Message) int {
	n, _ := keys.ParseAttempt(msg.Metadata.Get(keys.Attempt))
	return n
}

// AttemptFromContext returns which attempt the handler runs, from 1, read from the
// context of the message the retry middleware runs it with: for a handler that is
// given the context and not the message, as Watermill's CQRS handlers are
// (msg.Context()). It is Attempt of the message the handler runs, an immediate
// retry's (Policy.Immediate) included. 0 when ctx is not the context of a message
// under the retry middleware.
func AttemptFromContext(ctx context.Context) int {
	if a, ok := ctx.Value(ctxkey.Chain{}).(interface{ Attempt() int }); ok {
		return a.Attempt()
	}
	return 0
}

var (
	// ErrHandoff is wrapped by the error the middleware returns when a retry could not
	// be handed off: the router then nacks the original, with requeue, and the broker
	// redelivers it. Keep watermill-amqp's Consume.NoRequeueOnNack false. The
	// middleware produces it; it is declared here, beside Config, so that a Classify
	// or an application matches it without importing the middleware.
	ErrHandoff = errors.New("retry hand-off failed, message nacked for redelivery")
	// ErrNotWired is wrapped by the error of a message the middleware cannot route
	// back: its subscriber was not built from the Retry's SubscriberConfig, or its
	// queue was never bound for retries. The error names the fix. Such a message is
	// poisoned at its first failure (ReasonHandoffFailed), the error in its envelope
	// and in its one log line. A subscriber built from a Retry's config whose queue
	// the Retry would not send retries to (its Queue.GenerateName replaced, or the
	// poison queue) is refused at subscribe with it, and AddHandler refuses the
	// poison queue with it. A message of a subscriber built from a Retry's config
	// whose handler has no middleware of that Retry is refused with it when it comes
	// back after a failure, paced, until the handler has one.
	ErrNotWired = errors.New("retry middleware not wired to this message's subscriber")
	// ErrPanicked is wrapped by the error the middleware makes of a handler's panic,
	// which it recovers: a failure like any other, retried on the policy's schedule and
	// poisoned after MaxAttempts, with the panic's stack in the envelope
	// (middleware.Envelope.Stack). When the panic's value is an error, the error wraps
	// it too, so that its marks count (panic(Permanent(err)) poisons at once). It is
	// declared here so that a Classify matches it without importing the middleware.
	ErrPanicked = errors.New("handler panicked")
)
