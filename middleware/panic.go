package middleware

import (
	"fmt"
	"runtime/debug"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
)

// A handler's panic is the middleware's to handle: the engine runs the handler through
// run, which recovers it as an error, a failure like any other (retried, counted,
// poisoned after MaxAttempts), its stack in the envelope (Envelope.Stack) and in the
// log. The Retry nearest the handler recovers it, whatever the order of Watermill's
// Recoverer: outside the middleware, it never sees the panic.

// run runs h on msg, recovering its panic, which the engine deals with as a failure:
// a *panicked error carrying the stack, logged at ERROR. The Retry nearest the
// handler recovers it; one further out sees its error.
func (e *engine) run(h message.HandlerFunc, msg *message.Message, d delivery) (produced []*message.Message, err error) {
	defer func() {
		if v := recover(); v != nil {
			p := &panicked{value: v, stack: panicStack()}
			produced, err = nil, p
			e.cfg.Logger.Error("Handler panicked: recovered, dealt with as a failure", p, watermill.LogFields{
				"message_uuid": msg.UUID, "handler": d.handler, "topic": d.topic, "queue": d.queue, "attempt": d.attempt,
				"stack": p.stack,
			})
		}
	}()
	return h(msg)
}

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

// stackOf returns the stack of the first panic in err's chain, as errors.As finds it
// (without its allocation); "" for none.
func stackOf(err error) string {
	for err != nil {
		switch e := err.(type) {
		case *panicked:
			return e.stack
		case interface{ Unwrap() error }:
			err = e.Unwrap()
		case interface{ Unwrap() []error }:
			for _, inner := range e.Unwrap() {
				if s := stackOf(inner); s != "" {
					return s
				}
			}
			return ""
		default:
			return ""
		}
	}
	return ""
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
