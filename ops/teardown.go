package ops

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/amqpretry/amqpretry/delay"
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

// TeardownResult is what Teardown removed (in a dry run: would remove).
type TeardownResult struct {
	// Queues and Exchanges removed, and the Bindings that went with them.
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
// It refuses, removing nothing, while anything waits there, unless opts.Force: the
// broker's own counts are read with Config.Rabbitmqctl (rabbitmqctl list_queues: what
// a passive declare cannot see, the expired messages a quorum queue holds for dead
// lettering), and, for delayed-exchange, the plugin's own count (rabbitmqctl eval);
// without them it cannot know and refuses. Queues go first, then exchanges. Quorum
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
	for _, b := range t.Bindings {
		if slices.Contains(res.Exchanges, b.Exchange) || slices.Contains(res.Queues, b.Destination) || slices.Contains(res.Exchanges, b.Destination) {
			res.Bindings++
		}
	}

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
	var present []string
	for _, q := range res.Queues {
		declared, exists, err := o.inspect(q)
		if err != nil {
			return res, err
		}
		if !exists {
			continue
		}
		present = append(present, q)
		// list_queues' count lags (the broker's stats interval, 5 s by default) and a
		// passive declare sees only the ready messages: the larger of the two.
		if n := max(counts.Messages[q], declared.Messages); n > 0 {
			res.Waiting[q] = n
		}
	}
	res.Queues = present
	var presentX []string
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
		if !ok {
			continue
		}
		presentX = append(presentX, x)
		if o.retry.Backend == delay.DelayedExchange && x == o.names.Delayed() {
			n, err := o.pluginWaiting(ctx)
			switch {
			case err != nil:
				unknown = append(unknown, err)
			case n > 0:
				res.Waiting[x] = n
			}
		}
	}
	res.Exchanges = presentX

	if !opts.Force {
		if len(res.Waiting) > 0 {
			var parts []string
			for _, name := range append(slices.Clone(res.Queues), res.Exchanges...) {
				if n, ok := res.Waiting[name]; ok {
					parts = append(parts, name+": "+strconv.Itoa(n))
				}
			}
			return res, fmt.Errorf("teardown refused: messages wait in %s; wait until they have come due (amqpretry status), bring them back now (amqpretry waiting retry-now), or force it (they are lost)", strings.Join(parts, ", "))
		}
		if len(unknown) > 0 && (len(res.Queues) > 0 || len(res.Exchanges) > 0) {
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
	s := string(out)
	if i := strings.Index(s, "amqpretry-error "); i >= 0 {
		why, _, _ := strings.Cut(s[i+len("amqpretry-error "):], "\n")
		why = strings.TrimSpace(why)
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
	i := strings.Index(s, "amqpretry-result ")
	if i < 0 {
		return 0, fmt.Errorf("%w for exchange %q is unknown: rabbitmqctl eval printed %q", errPluginCount, x, strings.TrimSpace(s))
	}
	num, _, _ := strings.Cut(s[i+len("amqpretry-result "):], "\n")
	n, err := strconv.Atoi(strings.TrimSpace(num))
	if err != nil {
		return 0, fmt.Errorf("%w for exchange %q is unknown: rabbitmqctl eval printed %q", errPluginCount, x, strings.TrimSpace(s))
	}
	return n, nil
}
