package middleware

import (
	"fmt"
	"runtime/debug"
	"strings"

	"github.com/amqpretry/amqpretry"
)

// A handler's panic is the middleware's to handle: the engine runs the handler through
// run (outage.go), which recovers it as an error, a failure like any other (retried, counted,
// poisoned after MaxAttempts), its stack in the envelope (Envelope.Stack) and in the
// log. The Retry nearest the handler recovers it, whatever the order of Watermill's
// Recoverer: outside the middleware, it never sees the panic.

// panicked is the error of a handler's panic.
type panicked struct {
	value any
	stack string
}

func (p *panicked) Error() string { return fmt.Sprintf("%s: %v", amqpretry.ErrPanicked, p.value) }

// Unwrap gives amqpretry.ErrPanicked and, when the panic's value is an error, that
// error, whose marks then count.
func (p *panicked) Unwrap() []error {
	if err, ok := p.value.(error); ok {
		return []error{amqpretry.ErrPanicked, err}
	}
	return []error{amqpretry.ErrPanicked}
}

// panicStack is the stack of the panicking goroutine from the function that panicked:
// the frames of the recovery and of the runtime's panic left out.
func panicStack() string {
	s := string(debug.Stack())
	if i := strings.Index(s, "\npanic("); i >= 0 {
		rest := s[i+1:]
		// Skip the panic( frame: its function line and its file line.
		for range 2 {
			if j := strings.IndexByte(rest, '\n'); j >= 0 {
				rest = rest[j+1:]
			}
		}
		return rest
	}
	return s
}
