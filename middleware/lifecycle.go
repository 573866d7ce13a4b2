package middleware

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/redact"
)

// Lifecycle: open, closing (nothing handed off, paced nacks), closed; Close and the
// finalizer of a Retry dropped without it. The state itself (lifecycle: begin and end
// of each hand-off) is the engine's, in engine.go.

// refuseClosed answers a message that failed after Close: nothing is handed off (the
// hand-off connection is closed and is not opened again); the message is nacked for
// redelivery, after the pause a failed hand-off would take, so that nothing is lost
// and nothing loops. The first one is logged at WARN, naming the order to close in.
func (e *engine) refuseClosed(msg *message.Message, d delivery, err error) error {
	n := e.failures.add(msg.UUID)
	e.givenBack.add(msg.UUID)
	e.life.refused.Add(1)
	cerr := fmt.Errorf("%w: queue %q: the Retry was closed before the router stopped, so nothing is handed off; the message is nacked for redelivery: close the router first, then the Retry (defer retry.Close() before creating the router, so that it runs after the router's Close)", amqpretry.ErrHandoff, d.queue)
	if e.life.warned.CompareAndSwap(false, true) {
		warn(e.cfg.Logger, "Message failed after Close: nacked for redelivery, nothing handed off", cerr, watermill.LogFields{
			"message_uuid": msg.UUID, "handler": d.handler, "queue": d.queue, "attempt": d.attempt,
		})
	}
	pause(msg.Context(), backend.HandoffPause(n))
	if err == nil {
		return cerr
	}
	return errors.Join(err, cerr)
}

// close stops the retry: from then on the middleware hands nothing off and opens
// nothing (a message that fails is nacked for redelivery, paced, and the first one is
// logged at WARN); it waits for the hand-offs in flight, closes the backend and the
// hand-off connection, and logs what the Retry did since it started. Close the router
// first. A second Close does nothing.
func (r *retry) close() error {
	waited, first := r.engine.life.close()
	if !first {
		return nil
	}
	r.engine.sweep(true)
	var errs []error
	if r.engine.backend != nil {
		errs = append(errs, r.engine.backend.Close())
	}
	if r.handoff != nil {
		errs = append(errs, r.handoff.Close())
	}
	err := errors.Join(errs...)
	st := r.Stats()
	fields := watermill.LogFields{
		"retries": st.Retries, "poisoned": st.Poisoned, "handoff_failures": st.HandoffFailures,
		"handoffs_waited_for": waited, "poison_pending": st.PoisonPending,
	}
	if st.Outages > 0 {
		fields["outages"], fields["probes"] = st.Outages, st.Probes
	}
	if err != nil {
		fields["close_err"] = err.Error()
	}
	r.cfg.Logger.Info("Broker-side retry closed", fields)
	return err
}

// forgotten is the finalizer of a Retry: one dropped without Close logs it at WARN
// and closes its hand-off connection, which would leak otherwise.
func (r *retry) forgotten() {
	if r.engine.life.isClosed() {
		return
	}
	warn(r.cfg.Logger, "Retry garbage-collected without Close: closing its hand-off connection now",
		errors.New("Retry.Close was never called: call it once the router has stopped (defer retry.Close() before creating the router)"),
		watermill.LogFields{"delay_backend": r.cfg.Backend, "amqp_uri": redact.URI(r.t.URI)})
	go func() { _ = r.close() }()
}
