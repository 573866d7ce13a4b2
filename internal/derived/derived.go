// Package derived is what an amqpretry.Config derives beyond its exported fields
// (backend.Derived), for the packages built on the root one: the middleware, its
// transports (internal/wamqp) and ops. The root package derives its own for Validate,
// Plan and ApplyCommand, from the same fields; backend.Derive computes both.
package derived

import (
	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
)

// Of returns what cfg derives, its defaults applied first, afresh on each call. Its
// invalid fields are cfg.Validate's: Of reports only the backend's own error
// (backend.Derived.Err).
func Of(cfg amqpretry.Config) backend.Derived {
	c := cfg.WithDefaults()
	p := c.Policy
	return backend.Derive(backend.Input{Backend: c.Backend, Prefix: c.Prefix, PoisonQueue: c.PoisonQueue, Topology: c.Topology,
		Ordered: c.OrderKey != nil, Policy: backend.Policy{MaxAttempts: p.MaxAttempts, Delays: p.Delays, Jitter: p.Jitter, Immediate: p.Immediate},
		Apply: c.ApplyCommand})
}
