// Package ctxkey names the context key of the retry middleware's record of a delivery,
// shared by the middleware, which writes it, amqpretry.AttemptFromContext, which reads
// it, and the transports' AddHandler, which marks it.
package ctxkey

// Chain is the key of the record the retry middleware keeps in a message's context
// (middleware/engine.go, chain): the Retry middlewares it passes through and the
// attempt the handler runs. Its value has the methods Attempt() int, ExpectHandler(),
// HandlerRan() and HandlerFailed(error) (the handler added through a transport's
// AddHandler is below, ran, and failed).
type Chain struct{}

// Guard is the key under which a subscriber's marshaler hands its guard
// (*marshal.Guard) to the Retry's Delivered, in the context of the message it passes,
// until the Retry has attached its record of reads to it (marshal.NewGuard).
type Guard struct{}
