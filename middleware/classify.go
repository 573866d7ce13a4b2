package middleware

import (
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Permanent marks err as not worth retrying: the message goes to the poison queue on
// this failure. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// IsPermanent reports whether err, or any error it wraps, was marked by Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

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

// RetryAfterDelay returns the delay asked for by RetryAfter in err's chain, if any.
func RetryAfterDelay(err error) (time.Duration, bool) {
	var r *retryAfterError
	if errors.As(err, &r) {
		return max(r.after, 0), true
	}
	return 0, false
}

// Decision is what happens to a message after a failed attempt.
type Decision struct {
	// Permanent sends the message to the poison queue now.
	Permanent bool
	// Delay, when positive, replaces the policy's delay for the next attempt.
	Delay time.Duration
}

// ClassifyParams is what a Classify function is given. Fields may be added.
type ClassifyParams struct {
	// Err is the handler's error.
	Err error
	// Message is the message that failed. Do not modify it.
	Message *message.Message
	// Attempt is the attempt that failed, from 1.
	Attempt int
	// Default is the decision from the error's own marks (Permanent, RetryAfter):
	// DefaultClassify's. It is zero when DefaultClassify itself is given the params.
	Default Decision
}

// DefaultClassify is Classify's default: it decides from the marks Permanent and
// RetryAfter in the error's chain; any other error is retried on the policy's
// schedule. A Classify function may call it, or use ClassifyParams.Default, which holds
// its answer.
func DefaultClassify(p ClassifyParams) Decision {
	d := Decision{Permanent: IsPermanent(p.Err)}
	if after, ok := RetryAfterDelay(p.Err); ok {
		d.Delay = after
	}
	return d
}
