package ops

import (
	"context"
	"fmt"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/topology"
)

// Plan is every declaration the library needs for one backend and a set of work queues.
type Plan struct {
	// Backend and Prefix the plan is for.
	Backend string `json:"backend"`
	Prefix  string `json:"prefix"`
	// Topology: the backend's exchanges, queues and bindings, the poison queue, and the
	// delivery binding of each work queue, in declaration order.
	Topology topology.Topology `json:"topology"`
	// WorkQueues are the application's queues the bindings lead to. Apply creates a
	// missing one (durable, classic, no arguments, as watermill-amqp's durable configs
	// do) and leaves an existing one as it is; Verify checks only that it exists.
	WorkQueues []string `json:"work_queues"`
	// ApplyCommand is the command line that applies this plan.
	ApplyCommand string `json:"apply_command"`
}

// PlanTopology returns the plan for cfg and the work queues, without a broker.
func PlanTopology(cfg Config, workQueues ...string) (Plan, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return Plan{}, fmt.Errorf("invalid config: %w", err)
	}
	t, err := delay.Plan(cfg.Delay, workQueues...)
	if err != nil {
		return Plan{}, err
	}
	poison := topology.Topology{Queues: []topology.Queue{{Name: cfg.PoisonQueue}}}
	t = topology.Topology{Exchanges: t.Exchanges, Queues: append(t.Queues, poison.Queues...), Bindings: t.Bindings}
	cmd := delay.ApplyCommand(cfg.Delay, workQueues...)
	if cfg.PoisonQueue != cfg.Delay.Prefix+PoisonSuffix {
		cmd += " --poison-queue " + cfg.PoisonQueue
	}
	return Plan{
		Backend: cfg.Delay.Backend, Prefix: cfg.Delay.Prefix, Topology: t,
		WorkQueues: append([]string{}, workQueues...), ApplyCommand: cmd,
	}, nil
}

// Plan returns the plan of this Ops' configuration for the work queues.
func (o *Ops) Plan(workQueues ...string) (Plan, error) { return PlanTopology(o.cfg, workQueues...) }

// ApplyResult says what Apply did.
type ApplyResult struct {
	// Plan that was applied.
	Plan Plan `json:"plan"`
	// CreatedWorkQueues lists the work queues that did not exist and were created.
	CreatedWorkQueues []string `json:"created_work_queues"`
}

// Apply declares the plan for the work queues, idempotently: a second run changes
// nothing. It needs configure permission. A missing work queue is created (durable,
// classic); an existing one is left alone. A declaration that clashes with an existing
// object fails with an error wrapping topology.ErrMismatch that names the argument.
func (o *Ops) Apply(ctx context.Context, workQueues ...string) (ApplyResult, error) {
	p, err := o.Plan(workQueues...)
	if err != nil {
		return ApplyResult{}, err
	}
	r := ApplyResult{Plan: p, CreatedWorkQueues: []string{}}
	for _, q := range workQueues {
		if err := ctx.Err(); err != nil {
			return r, err
		}
		_, exists, err := o.queueDepth(q)
		if err != nil {
			return r, err
		}
		if exists {
			continue
		}
		if err := o.declare(topology.Topology{Queues: []topology.Queue{{Name: q}}}); err != nil {
			return r, err
		}
		r.CreatedWorkQueues = append(r.CreatedWorkQueues, q)
	}
	return r, o.declare(p.Topology)
}

func (o *Ops) declare(t topology.Topology) error {
	ch, err := o.channel()
	if err != nil {
		return err
	}
	defer ch.Close() //nolint:errcheck // a failed declaration has closed it already
	return topology.Declare(ch, t)
}

// VerifyOptions configures Verify.
type VerifyOptions struct {
	// Bind asserts each binding (idempotent; needs write permission on the destination
	// and read on the source, no configure). Without it bindings are reported
	// unchecked: AMQP 0-9-1 has no way to read them.
	Bind bool
	// NoCompare skips the comparison of arguments (see topology.CheckOptions).
	NoCompare bool
}

// VerifyResult is the outcome of Verify.
type VerifyResult struct {
	// Plan that was checked, and the Report: one finding per declaration.
	Plan   Plan            `json:"plan"`
	Report topology.Report `json:"report"`
}

// Err returns nil when everything checked is in place, else an error naming each
// missing or mismatched object (and the argument that differs) and the command that
// creates them.
func (r VerifyResult) Err() error {
	if err := r.Report.Err(); err != nil {
		return fmt.Errorf("%w\ncreate what is missing with `%s`", err, r.Plan.ApplyCommand)
	}
	return nil
}

// Verify checks the plan without declaring anything: every exchange and queue exists
// (passive declare) and, where the user may configure it, has the same arguments (an
// active declaration on a throwaway channel, which is a no-op when they are equal and
// a 406 naming the argument when not; see topology.Check). Work queues are checked for
// existence only. It returns an error only when it cannot check; see VerifyResult.Err.
func (o *Ops) Verify(ctx context.Context, opts VerifyOptions, workQueues ...string) (VerifyResult, error) {
	p, err := o.Plan(workQueues...)
	if err != nil {
		return VerifyResult{}, err
	}
	res := VerifyResult{Plan: p}
	// Work queues first: a binding to a missing one is missing too.
	var wq topology.Topology
	for _, q := range workQueues {
		wq.Queues = append(wq.Queues, topology.Queue{Name: q})
	}
	wr, err := topology.Check(o.conn, wq, topology.CheckOptions{})
	if err != nil {
		return res, err
	}
	for i := range wr.Findings {
		wr.Findings[i].Kind = "work queue"
	}
	if err := ctx.Err(); err != nil {
		return res, err
	}
	r, err := topology.Check(o.conn, p.Topology, topology.CheckOptions{CompareArgs: !opts.NoCompare, Bind: opts.Bind})
	if err != nil {
		return res, err
	}
	res.Report.Findings = append(r.Findings, wr.Findings...)
	return res, nil
}
