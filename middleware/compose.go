package middleware

import "errors"

// Retryable tells whether running the handler again, in this process, could help
// after err: not for a Permanent error, which this middleware then poisons at once, nor
// for a failed hand-off (ErrHandoff), whose original the router must nack instead. It
// is the test to give Watermill's middleware.Retry, for applications that keep it for
// in-process retries (Policy.Immediate does the same inside this middleware):
//
//	wmiddleware.Retry{MaxRetries: 2, InitialInterval: 10 * time.Millisecond,
//		ShouldRetry: func(p wmiddleware.RetryParams) bool { return middleware.Retryable(p.Err) }}
//
// Order the middlewares, outermost first: this Retry, then Watermill's Retry, then
// Recoverer, nearest the handler. Recoverer inside turns a panic into an error that is
// retried and in the end poisoned; outside, a panic would skip this Retry and the
// message would be redelivered at once, forever. Watermill's Retry outside this one
// would run the handler again for every failed hand-off, and Watermill's PoisonQueue
// outside it would ack a message whose hand-off failed: leave both out, or keep them
// inside.
func Retryable(err error) bool {
	return err != nil && !IsPermanent(err) && !errors.Is(err, ErrHandoff)
}
