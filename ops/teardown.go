package ops

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/amqpretry/amqpretry/topology"
)

// TeardownOptions configures Teardown.
type TeardownOptions struct {
	// Keep is what must stay: the topology of the configuration in use now (its
	// Config.Plan), when the one torn down shares a prefix with it. A queue or exchange
	// named in Keep is never removed.
	Keep topology.Topology
	// Shared also removes what every backend under the prefix shares: the parking
	// exchange and queue, and the poison queue (Config.Retry.PoisonQueue).
	Shared bool
	// DryRun reports what would be removed and what waits there, and removes nothing.
	DryRun bool
	// Force removes even while messages wait there: they are lost.
	Force bool
}

// ErrNothingToTearDown is wrapped by Teardown's error when nothing the backend
// declares exists under the prefix (a prefix or backend that names no storage, or
// storage already removed).
var ErrNothingToTearDown = errors.New("teardown: nothing to remove")

// TeardownResult is what Teardown removed (in a dry run: would remove): only what it
// found on the broker.
type TeardownResult struct {
	// Queues and Exchanges removed (each found on the broker), and the Bindings that
	// went with them: those of the backend's plan between two objects found, one of
	// them removed (AMQP 0-9-1 cannot list bindings).
	Queues    []string `json:"queues"`
	Exchanges []string `json:"exchanges"`
	Bindings  int      `json:"bindings"`
	// Waiting counts the messages each queue (or the delayed-message plugin, by its
	// exchange) holds, all of them: ready, unacked, and those held for dead lettering.
	Waiting map[string]int `json:"waiting"`
	// DryRun: nothing was removed.
	DryRun bool `json:"dry_run"`
}

// Teardown removes the broker side of the backend Config.Retry describes, under its
// prefix: its delay queues and exchanges, its delivery exchange and the bindings that
// go with them (the old storage after a change of Backend, Tiers, Levels or Prefix),
// and, with Config.Rabbitmqctl, every other delay queue found under the prefix. What
// opts.Keep names stays; the parking and poison queues stay unless opts.Shared. Work
// queues are never removed.
//
// It counts and removes only what it finds on the broker; when it finds nothing under
// the prefix (a typo in it, another backend, storage already removed) it fails,
// saying so ("teardown: nothing to remove").
//
// It refuses ("teardown refused"), removing nothing, while anything waits there,
// unless opts.Force: the broker's own counts are read with Config.Rabbitmqctl
// (rabbitmqctl list_queues: what a passive declare cannot see, the expired messages a
// quorum queue holds for dead lettering), and, for delayed-exchange, the plugin's own
// count (rabbitmqctl eval); without them it cannot know and refuses. Queues go first, then exchanges. Quorum
// queues cannot be deleted "if empty": a retry parked into the old storage between the
// count and the delete would be lost, so stop every application instance still running
// the old configuration first.
func (o *Ops) Teardown(ctx context.Context, opts TeardownOptions) (TeardownResult, error) {
	res := TeardownResult{Queues: []string{}, Exchanges: []string{}, Waiting: map[string]int{}, DryRun: opts.DryRun}
	t := o.backend.Topology()
	keep := func(name string, kept []string) bool {
		return slices.Contains(kept, name) ||
			!opts.Shared && (name == o.names.Parking() || name == o.retry.PoisonQueue)
	}
	var keptQ, keptX []string
	for _, q := range opts.Keep.Queues {
		keptQ = append(keptQ, q.Name)
	}
	for _, x := range opts.Keep.Exchanges {
		keptX = append(keptX, x.Name)
	}
	for _, q := range t.Queues {
		if !keep(q.Name, keptQ) {
			res.Queues = append(res.Queues, q.Name)
		}
	}
	if opts.Shared && !slices.Contains(res.Queues, o.retry.PoisonQueue) && !slices.Contains(keptQ, o.retry.PoisonQueue) {
		res.Queues = append(res.Queues, o.retry.PoisonQueue)
	}
	if o.ctl != nil {
		found, _, err := o.peekAll(ctx, 0)
		if err != nil {
			return res, err
		}
		for _, q := range found {
			if !slices.Contains(res.Queues, q) && !keep(q, keptQ) {
				res.Queues = append(res.Queues, q)
			}
		}
	}
	for _, x := range t.Exchanges {
		if !keep(x.Name, keptX) {
			res.Exchanges = append(res.Exchanges, x.Name)
		}
	}

	// What is there: only that is removed.
	ready := map[string]int{} // what a passive declare sees
	present := []string{}
	for _, q := range res.Queues {
		declared, exists, err := o.inspect(q)
		if err != nil {
			return res, err
		}
		if exists {
			present = append(present, q)
			ready[q] = declared.Messages
		}
	}
	res.Queues = present
	presentX := []string{}
	for _, x := range res.Exchanges {
		kind := ""
		for _, tx := range t.Exchanges {
			if tx.Name == x {
				kind = tx.Kind
			}
		}
		ok, err := o.exchangeExists(x, kind)
		if err != nil {
			return res, err
		}
		if ok {
			presentX = append(presentX, x)
		}
	}
	res.Exchanges = presentX
	if len(res.Queues) == 0 && len(res.Exchanges) == 0 {
		return res, fmt.Errorf("%w: no queue or exchange of the %s backend under prefix %q (nothing removed); check the prefix and the backend (with its tiers or levels) against the configuration that declared them", ErrNothingToTearDown, o.retry.Backend, o.retry.Prefix)
	}
	n, err := o.bindingsFound(t, res)
	if err != nil {
		return res, err
	}
	res.Bindings = n

	// What waits there.
	var unknown []error
	var counts BrokerCounts
	if o.ctl == nil {
		unknown = append(unknown, errors.New("the broker's counts are unknown without rabbitmqctl (Config.Rabbitmqctl; the CLI's --rabbitmqctl): a passive declare does not see the messages a quorum queue holds for dead lettering"))
	} else {
		c, err := o.ctlCounts(ctx)
		if err != nil {
			return res, err
		}
		counts = c
	}
	for _, q := range res.Queues {
		// list_queues' count lags (the broker's stats interval, 5 s by default) and a
		// passive declare sees only the ready messages: the larger of the two.
		if n := max(counts.Messages[q], ready[q]); n > 0 {
			res.Waiting[q] = n
		}
	}
	if o.backend.Caps().Sealed && slices.Contains(res.Exchanges, o.names.Delayed()) {
		n, err := o.pluginWaiting(ctx)
		switch {
		case err != nil:
			unknown = append(unknown, err)
		case n > 0:
			res.Waiting[o.names.Delayed()] = n
		}
	}

	if !opts.Force {
		if len(res.Waiting) > 0 {
			var parts []string
			for _, name := range append(slices.Clone(res.Queues), res.Exchanges...) {
				if n, ok := res.Waiting[name]; ok {
					parts = append(parts, name+": "+strconv.Itoa(n))
				}
			}
			return res, fmt.Errorf("teardown refused: messages wait in %s; %s, or force it (they are lost)", strings.Join(parts, ", "), o.waitAdvice())
		}
		if len(unknown) > 0 {
			return res, fmt.Errorf("teardown refused: what waits there is unknown: %w; force it to remove them anyway", errors.Join(unknown...))
		}
	}
	if opts.DryRun {
		return res, nil
	}
	ch, err := o.channel()
	if err != nil {
		return res, err
	}
	defer func() { _ = ch.Close() }()
	for _, q := range res.Queues {
		// Quorum queues refuse if-empty (540 NOT_IMPLEMENTED): the counts above are the
		// check.
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return res, fmt.Errorf("delete queue %q: %w (nothing after it removed)", q, o.redact(err))
		}
	}
	for _, x := range res.Exchanges {
		if err := ch.ExchangeDelete(x, false, false); err != nil {
			return res, fmt.Errorf("delete exchange %q: %w", x, o.redact(err))
		}
	}
	return res, nil
}

// waitAdvice says what to do about the messages waiting in the storage of the backend
// torn down, short of forcing it.
func (o *Ops) waitAdvice() string {
	if o.backend.Caps().Sealed {
		// The plugin cannot give its messages back early: waiting is all there is.
		return "wait until the plugin's count reaches 0 as they come due (watch it with `amqpretry status --backend delayed-exchange`; the plugin offers no way to bring them back early)"
	}
	return "wait until they have come due (amqpretry status), bring them back now (amqpretry waiting retry-now)"
}

// bindingsFound counts the bindings of the backend's plan t that go with what res
// removes and whose two ends exist: only those can be on the broker.
func (o *Ops) bindingsFound(t topology.Topology, res TeardownResult) (int, error) {
	queues, exchanges := map[string]bool{}, map[string]bool{}
	for _, q := range res.Queues {
		queues[q] = true
	}
	for _, x := range res.Exchanges {
		exchanges[x] = true
	}
	kinds := map[string]string{}
	for _, x := range t.Exchanges {
		kinds[x.Name] = x.Kind
	}
	seenQ, seenX := map[string]bool{}, map[string]bool{}
	for q := range queues {
		seenQ[q] = true
	}
	for x := range exchanges {
		seenX[x] = true
	}
	exists := func(name string, exchange bool) (bool, error) {
		seen := seenQ
		if exchange {
			seen = seenX
		}
		if ok, known := seen[name]; known {
			return ok, nil
		}
		var ok bool
		var err error
		if exchange {
			ok, err = o.exchangeExists(name, kinds[name])
		} else {
			_, ok, err = o.inspect(name)
		}
		seen[name] = ok
		return ok, err
	}
	n := 0
	for _, b := range t.Bindings {
		if !exchanges[b.Exchange] && !(b.ToExchange && exchanges[b.Destination]) && !(!b.ToExchange && queues[b.Destination]) {
			continue
		}
		src, err := exists(b.Exchange, true)
		if err != nil {
			return n, err
		}
		dst, err := exists(b.Destination, b.ToExchange)
		if err != nil {
			return n, err
		}
		if src && dst {
			n++
		}
	}
	return n, nil
}

// ctlCounts reads every queue's messages with rabbitmqctl list_queues.
func (o *Ops) ctlCounts(ctx context.Context) (BrokerCounts, error) {
	out, err := o.ctl(ctx, "-q", "list_queues", "-p", o.vhost, "name", "messages", "--no-table-headers")
	if err != nil {
		return BrokerCounts{}, fmt.Errorf("rabbitmqctl list_queues: %w", o.redact(err))
	}
	c := BrokerCounts{Messages: map[string]int{}}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Split(strings.TrimSpace(line), "\t")
		if len(f) != 2 {
			continue
		}
		if n, err := strconv.Atoi(f[1]); err == nil {
			c.Messages[f[0]] = n
		}
	}
	return c, nil
}

// pluginExpr counts what the delayed-message plugin holds for one exchange, with its
// own rabbit_delayed_message:messages_delayed; it fails when the plugin does not run.
const pluginExpr = `case code:ensure_loaded(rabbit_delayed_message) of
  {module, _} ->
    case erlang:function_exported(rabbit_delayed_message, messages_delayed, 1) of
      true ->
        case rabbit_exchange:lookup(rabbit_misc:r(%[1]s, exchange, %[2]s)) of
          {ok, X} -> io:format("amqpretry-result ~p~n", [rabbit_delayed_message:messages_delayed(X)]);
          _ -> io:format("amqpretry-error exchange_not_found~n")
        end;
      false -> io:format("amqpretry-error plugin_has_no_count~n")
    end;
  _ -> io:format("amqpretry-error plugin_not_running~n")
end,
ok.`

// errPluginCount: the delayed-message plugin's count could not be read.
var errPluginCount = errors.New("the delayed-message plugin's count of waiting messages")

// pluginWaiting is how many messages the delayed-message plugin holds for the
// backend's exchange, as the plugin itself reports; never a guess.
func (o *Ops) pluginWaiting(ctx context.Context) (int, error) {
	x := o.names.Delayed()
	if o.ctl == nil {
		return 0, fmt.Errorf("%w for exchange %q is unknown: reading it needs rabbitmqctl eval (Config.Rabbitmqctl; the CLI's --rabbitmqctl)", errPluginCount, x)
	}
	out, err := o.ctl(ctx, "-q", "eval", fmt.Sprintf(pluginExpr, erlBinary(o.vhost), erlBinary(x)))
	if err != nil {
		return 0, fmt.Errorf("%w for exchange %q: rabbitmqctl eval (needs admin rights): %w", errPluginCount, x, o.redact(err))
	}
	r := readEval(out)
	if r.hasFailed {
		why := r.failed
		switch why {
		case "plugin_not_running":
			why = "the rabbitmq_delayed_message_exchange plugin does not run on this node (not enabled, or RabbitMQ 4.3+, which cannot run it): its messages, if any, are out of reach"
		case "plugin_has_no_count":
			why = "this version of the plugin has no messages_delayed"
		case "exchange_not_found":
			why = "the exchange does not exist"
		}
		return 0, fmt.Errorf("%w for exchange %q is unknown: %s", errPluginCount, x, why)
	}
	n, err := strconv.Atoi(r.result)
	if !r.hasResult || err != nil {
		return 0, fmt.Errorf("%w for exchange %q is unknown: rabbitmqctl eval printed %q", errPluginCount, x, strings.TrimSpace(string(out)))
	}
	return n, nil
}
