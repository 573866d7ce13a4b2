package ops

import (
	"context"
	"fmt"
	"slices"

	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/topology"
)

// Apply declares what Config.Retry.Plan(workQueues...) returns, idempotently: a second
// run changes nothing. It needs configure permission. A missing work queue is created
// first, with the plan's arguments for it (with delayed retries, a quorum queue with
// the x-delayed-retry-* arguments), else durable and classic, as watermill-amqp's
// durable configs declare it; created lists those it created. An existing work queue
// the plan has arguments for is declared with them, so a queue declared otherwise (a
// classic one where delayed retries need a quorum queue) fails: a declaration that
// clashes with an existing object fails with an error wrapping topology.ErrMismatch
// that names the object and the argument.
func (o *Ops) Apply(ctx context.Context, workQueues ...string) (created []string, err error) {
	plan, err := o.retry.Plan(workQueues...)
	if err != nil {
		return nil, err
	}
	created = []string{}
	for _, q := range workQueues {
		if err := ctx.Err(); err != nil {
			return created, err
		}
		_, exists, err := o.inspect(q)
		if err != nil {
			return created, err
		}
		if exists || slices.Contains(created, q) {
			continue
		}
		if !slices.ContainsFunc(plan.Queues, func(pq topology.Queue) bool { return pq.Name == q }) {
			plan.Queues = append(plan.Queues, topology.Queue{Name: q, Role: "work"})
		}
		created = append(created, q)
	}
	ch, err := o.channel()
	if err != nil {
		return created, err
	}
	defer ch.Close() //nolint:errcheck // a failed declaration has closed it already
	if err := plan.Apply(ch, topology.ModeDeclare); err != nil {
		return created, o.redact(err)
	}
	return created, nil
}

// VerifyOptions configures Verify.
type VerifyOptions struct {
	// Bind asserts each binding: queue.bind and exchange.bind are idempotent and need
	// write permission on the destination and read on the source, no configure; a
	// binding whose ends both exist is created if it was missing. Without it bindings
	// are VerdictUnchecked: AMQP 0-9-1 has no way to read them.
	Bind bool
	// Counts, if set, reads the broker's counts (as StatusOptions.Counts) once the
	// declarations are checked, to report each existing quorum queue's members and
	// those online (Finding.Members, Finding.Online).
	Counts func(ctx context.Context) (BrokerCounts, error)
}

// Verify checks what Config.Retry.Plan(workQueues...) returns without declaring any
// exchange or queue, and reports on each declaration, in plan order, then on each work
// queue (Finding.Kind "work queue"). Every exchange and queue is declared passively
// (does it exist?) and, where it exists, again with the expected arguments on a
// throwaway channel: a no-op when they are equal, a 406 naming the argument when not
// (VerdictMismatch). That comparison needs configure permission: where it is
// refused the finding is VerdictUnchecked, never VerdictOK. A work queue is
// compared only when the plan gives it arguments (delayed retries); otherwise only its
// existence is checked. It returns an error only when it cannot check; the problems
// are in the findings.
func (o *Ops) Verify(ctx context.Context, opts VerifyOptions, workQueues ...string) ([]Finding, error) {
	plan, err := o.retry.Plan(workQueues...)
	if err != nil {
		return nil, err
	}
	// The backend's own declarations, then the work queues: those the plan gives
	// arguments (delayed retries) first, then the others, which are checked to exist.
	own, work := plan, topology.Topology{}
	own.Queues = nil
	for _, q := range plan.Queues {
		if slices.Contains(workQueues, q.Name) {
			q.Role = "work"
			work.Queues = append(work.Queues, q)
		} else {
			own.Queues = append(own.Queues, q)
		}
	}
	for _, q := range workQueues {
		if !slices.ContainsFunc(work.Queues, func(c topology.Queue) bool { return c.Name == q }) {
			work.Queues = append(work.Queues, topology.Queue{Name: q, Role: "work"})
		}
	}
	var out []Finding
	for _, step := range []struct {
		t    topology.Topology
		bind bool
	}{{own, opts.Bind}, {work, false}} {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		f, err := check(o.conn, step.t, step.bind)
		out = append(out, f...)
		if err != nil {
			return out, fmt.Errorf("verify: %w", o.redact(err))
		}
	}
	for i, f := range out {
		// A work queue of another type than delayed retries need: apply cannot fix it.
		if t := declare.CurrentQueueType(f.Detail); f.Kind == "work queue" && f.Arg == declare.QueueTypeArg && t != "" && t != declare.QueueTypeQuorum {
			out[i].Fix = declare.WrongQueueTypeFix(f.Name, t)
		}
	}
	if opts.Counts == nil {
		return out, nil
	}
	c, err := opts.Counts(ctx)
	if err != nil {
		return out, fmt.Errorf("verify: broker counts: %w", o.redact(err))
	}
	for i, f := range out {
		if (f.Kind == "queue" || f.Kind == "work queue") && f.Status != VerdictMissing {
			out[i].Members, out[i].Online = c.Members[f.Name], c.Online[f.Name]
		}
	}
	return out, nil
}
