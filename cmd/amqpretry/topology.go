package main

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"text/tabwriter"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/topology"
)

func (a *app) topologyCmd() *cobra.Command {
	var queues []string
	var (
		bind bool
		src  countsSource
	)
	queueFlag := func(c *cobra.Command) {
		c.Flags().StringArrayVar(&queues, "queue", nil, "a work queue retries come back to (its way back, and the queue itself); repeat for more")
	}
	plan := &cobra.Command{
		Use:   "plan",
		Short: "Print every declaration the library needs for the backend and the work queues (no broker)",
		Long: `plan prints every exchange, queue and binding amqpretry.Config.Plan returns for the
common flags and the work queues, and the command that applies them. It needs no broker.

` + exitHelp,
		Args: noArgs,
		RunE: func(*cobra.Command, []string) error {
			cfg, err := a.retryConfig()
			if err != nil {
				return err
			}
			t, err := cfg.Plan(queues...)
			if err != nil {
				return err
			}
			cmd := applyCommand(cfg, queues)
			if a.json {
				return a.emit(planJSON{Backend: cfg.WithDefaults().Backend.Name(), Prefix: cfg.WithDefaults().Prefix, Topology: t, WorkQueues: nonNil(queues), ApplyCommand: cmd})
			}
			a.printPlan(cfg, t, queues)
			a.printf("apply with: %s\n", cmd)
			return nil
		},
	}
	apply := &cobra.Command{
		Use:   "apply",
		Short: "Declare the plan, idempotently (needs configure permission)",
		Long: `apply declares what plan prints, idempotently: a second run changes nothing. A missing
work queue is created (quorum with the delayed-retry arguments when --held-retries or
the delayed-retry backend say so, else durable and classic); an existing one is left as
it is, unless the plan gives it arguments, which must then match. A declaration that
clashes with an existing object fails naming the object and the argument.

` + exitHelp,
		Args: noArgs,
		RunE: func(*cobra.Command, []string) error {
			o, cfg, err := a.open()
			if err != nil {
				return err
			}
			defer o.Close()
			created, err := o.Apply(a.ctx, queues...)
			if err != nil {
				return err
			}
			t, err := cfg.Plan(queues...)
			if err != nil {
				return err
			}
			if a.json {
				return a.emit(applyJSON{Backend: cfg.WithDefaults().Backend.Name(), Prefix: cfg.WithDefaults().Prefix, Topology: t, CreatedWorkQueues: created})
			}
			a.printf("applied: %d exchanges, %d queues, %d bindings (backend %s, prefix %s)\n",
				len(t.Exchanges), len(t.Queues), len(t.Bindings), cfg.WithDefaults().Backend, cfg.WithDefaults().Prefix)
			for _, q := range created {
				kind := "durable, classic"
				for _, pq := range t.Queues {
					if pq.Name == q && pq.Args != nil {
						kind = "durable, " + queueKind(pq.Args) + ", " + args(pq.Args)
					}
				}
				a.printf("created work queue %s (%s)\n", q, kind)
			}
			return nil
		},
	}
	verify := &cobra.Command{
		Use:   "verify",
		Short: "Check the plan on the broker without declaring anything",
		Long: `verify declares nothing: every exchange and queue is declared passively (does it
exist?), then, where it exists, again with the expected arguments on a throwaway channel:
a no-op when they are equal, refused naming the argument when not (mismatch). That needs
configure permission: without it the arguments are not compared and the object is
reported unchecked, never ok. AMQP 0-9-1 cannot read bindings: they are unchecked, or
asserted with --bind (idempotent; needs write permission on the queue and read on the
exchange, no configure; a missing binding whose ends exist is created). With the broker's
counts (--rabbitmqctl, --management-url: as for status) it reports each quorum queue's
members online, and a queue with fewer online than it has (a cluster node down).

Exit status 1 when anything is missing, mismatched, under-replicated or could not be
checked for an error;
the output names the command that creates what is missing, with every --queue.

` + exitHelp,
		Args: noArgs,
		RunE: func(*cobra.Command, []string) error {
			counts, explicit, err := src.counts(a.uri)
			if err != nil {
				return err
			}
			o, cfg, err := a.open()
			if err != nil {
				return err
			}
			defer o.Close()
			opts := ops.VerifyOptions{Bind: bind, Counts: counts}
			var countsNote string
			if counts != nil && !explicit {
				// auto: a rabbitmqctl that cannot answer leaves the members unknown.
				opts.Counts = func(ctx context.Context) (ops.BrokerCounts, error) {
					c, err := counts(ctx)
					if err != nil {
						countsNote = err.Error()
						return ops.BrokerCounts{}, nil
					}
					return c, nil
				}
			}
			findings, err := o.Verify(a.ctx, opts, queues...)
			if err != nil {
				return err
			}
			err = a.printFindings(findings, applyCommand(cfg, queues))
			if countsNote != "" && !a.json {
				// After the findings: their summary stays the first line.
				a.printf("note: broker counts unavailable, members of quorum queues unknown: %s\n", a.redact(countsNote))
			}
			return err
		},
	}
	verify.Flags().BoolVar(&bind, "bind", false, "assert the bindings (idempotent; write and read permission, no configure)")
	src.flags(verify)
	for _, c := range []*cobra.Command{plan, apply, verify} {
		queueFlag(c)
	}
	return group("topology", "The declarations the library needs: plan them, apply them, verify them", plan, apply, verify)
}

type planJSON struct {
	Backend      string            `json:"backend"`
	Prefix       string            `json:"prefix"`
	Topology     topology.Topology `json:"topology"`
	WorkQueues   []string          `json:"work_queues"`
	ApplyCommand string            `json:"apply_command"`
}

type applyJSON struct {
	Backend           string            `json:"backend"`
	Prefix            string            `json:"prefix"`
	Topology          topology.Topology `json:"topology"`
	CreatedWorkQueues []string          `json:"created_work_queues"`
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func (a *app) printPlan(cfg amqpretry.Config, t topology.Topology, queues []string) {
	c := cfg.WithDefaults()
	a.printf("backend %s, prefix %s\n", c.Backend, c.Prefix)
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	isWork := func(name string) bool {
		for _, q := range queues {
			if q == name {
				return true
			}
		}
		return false
	}
	for _, e := range t.Exchanges {
		fmt.Fprintf(tw, "exchange\t%s\t%s\t%s\n", e.Name, e.Kind, args(e.Args))
	}
	listed := map[string]bool{}
	for _, q := range t.Queues {
		kind := "queue"
		if isWork(q.Name) {
			kind, listed[q.Name] = "work queue", true
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", kind, q.Name, queueKind(q.Args), args(q.Args))
	}
	for _, b := range t.Bindings {
		dest := "queue " + b.Destination
		if b.ToExchange {
			dest = "exchange " + b.Destination
		}
		fmt.Fprintf(tw, "binding\t%s -> %s\tkey %q\t%s\n", b.Exchange, dest, b.Key, args(b.Args))
	}
	for _, q := range queues {
		if !listed[q] {
			fmt.Fprintf(tw, "work queue\t%s\t\tmust exist; apply creates it durable and classic if missing\n", q)
		}
	}
	_ = tw.Flush()
}

func queueKind(a amqp.Table) string {
	if t, ok := a[amqp.QueueTypeArg].(string); ok {
		return t
	}
	return "classic"
}

// args formats arguments as sorted key=value pairs.
func args(a amqp.Table) string {
	keys := make([]string, 0, len(a))
	for k := range a {
		if k != amqp.QueueTypeArg {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%v", k, a[k])
	}
	return strings.Join(parts, " ")
}

// describeFinding renders a finding as one line.
func describeFinding(f ops.Finding) string {
	what := fmt.Sprintf("%s %q", f.Kind, f.Name)
	if f.Kind == "binding" {
		what = fmt.Sprintf("binding of %q to exchange %q with key %q", f.Name, f.Source, f.Key)
	}
	var s string
	switch f.Status {
	case ops.VerdictMismatch:
		arg := "arguments differ"
		if f.Arg != "" {
			arg = "argument " + f.Arg + " differs"
		}
		s = fmt.Sprintf("%s: mismatch, %s", what, arg)
	case ops.VerdictUnchecked:
		if f.Kind == "binding" {
			s = what + ": unchecked, not asserted (--bind asserts it)"
		} else {
			s = what + ": unchecked, exists but its arguments were not compared"
		}
	default:
		s = fmt.Sprintf("%s: %s", what, f.Status)
	}
	if f.Detail != "" {
		s += " (" + f.Detail + ")"
	}
	if f.Fix != "" {
		s += "; " + f.Fix
	}
	return s
}

// printFindings prints the findings of verify and returns errFlagged when something is
// missing, mismatched or in error.
func (a *app) printFindings(findings []ops.Finding, applyCmd string) error {
	counts := map[ops.Verdict]int{}
	bad := 0
	under := 0
	applyFixes := 0 // the bad findings apply can fix (not those that carry a fix of their own)
	for _, f := range findings {
		counts[f.Status]++
		switch {
		case f.Status == ops.VerdictMissing, f.Status == ops.VerdictMismatch, f.Status == ops.VerdictError:
			bad++
			if f.Fix == "" {
				applyFixes++
			}
		case f.Online < f.Members:
			under++
		}
	}
	if a.json {
		if findings == nil {
			findings = []ops.Finding{}
		}
		if err := a.emit(verifyJSON{OK: bad == 0 && under == 0, ApplyCommand: applyCmd, Findings: findings, Counts: counts}); err != nil {
			return err
		}
	} else {
		uncheckedBindings := 0
		for _, f := range findings {
			switch {
			case f.Status == ops.VerdictOK:
			case f.Status == ops.VerdictUnchecked && f.Kind == "binding":
				uncheckedBindings++
			default:
				a.printf("%s\n", describeFinding(f))
			}
			if f.Online < f.Members {
				a.printf("%s %q: under-replicated, %d of its %d members online (a node is down or its member has not started)\n", f.Kind, f.Name, f.Online, f.Members)
			}
		}
		a.printf("%d ok, %d missing, %d mismatched, %d errors, %d unchecked\n",
			counts[ops.VerdictOK], counts[ops.VerdictMissing], counts[ops.VerdictMismatch], counts[ops.VerdictError], counts[ops.VerdictUnchecked])
		if uncheckedBindings > 0 {
			a.printf("%d bindings unchecked: AMQP 0-9-1 cannot read them (--bind asserts them, idempotently)\n", uncheckedBindings)
		}
		if n := counts[ops.VerdictUnchecked] - uncheckedBindings; n > 0 {
			a.printf("%d exchanges or queues exist but their arguments were not compared: the user may not configure them (run verify as one who may)\n", n)
		}
		if applyFixes > 0 {
			a.printf("create what is missing with: %s\n", applyCmd)
		}
	}
	if bad > 0 || under > 0 {
		return errFlagged
	}
	return nil
}

type verifyJSON struct {
	OK           bool                `json:"ok"`
	ApplyCommand string              `json:"apply_command"`
	Counts       map[ops.Verdict]int `json:"counts"`
	Findings     []ops.Finding       `json:"findings"`
}
