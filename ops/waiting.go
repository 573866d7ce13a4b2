package ops

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/derived"
	"github.com/amqpretry/amqpretry/internal/marshal"
)

// Waiting is the retries that wait in the delay backend to come back to their work
// queue: in the delay queues of ttl-tiers and binary-levels under Config.Retry.Prefix
// (those of the configured backend and any other such queue found under the prefix,
// left by a change of Backend, Tiers or Levels), and, on RabbitMQ 4.3, in the delayed
// retry of the work queue named by Filter.Queue (delayed-retry, or delay.HeldRetries).
// Filter.Queue selects the retries of one work queue.
//
//   - List reads them without changing anything a later delivery sees (see
//     docs/waiting.md): through Config.Rabbitmqctl, with rabbitmqctl eval of the
//     broker's own quorum-queue peek (a read-only query of the queue's leader: no
//     basic.get, no return, so no x-delivery-count, x-acquired-count, order or
//     expiry changes). Without Config.Rabbitmqctl List refuses Waiting. Messages come
//     in due order. For delayed-retry the broker keeps the message bodies in its log,
//     out of reach of a query: only the due time and the counters are listed.
//   - Redrive is "retry now": each matching retry is published to its work queue
//     (default exchange, mandatory, persistent, confirm awaited) and only then acked
//     in its delay queue. The retries it does not take keep their place but, taken and
//     given back, count one more delivery (x-delivery-count on RabbitMQ 3.x,
//     x-acquired-count on 4.x; 4.0 to 4.2 count it against the delivery-limit). For
//     delayed-retry, the broker's rabbit_quorum_queue:retry_delayed (rabbitmqctl
//     eval, admin rights): all of them, or the MoveOptions.Limit due first; it has
//     no other filter, and says so.
//   - Purge drops the matching ones (acked without a copy), dry run first. It cannot
//     drop what delayed-retry holds: RabbitMQ offers no way to, and Purge says so.
//
// On the delayed-exchange backend List, Redrive and Purge of Waiting refuse
// (ErrPluginWaiting): the delayed-message plugin offers no way to read, bring back or
// drop what it keeps. Status.PluginWaiting counts it.
const Waiting Source = "waiting"

// ErrPluginWaiting is wrapped by List, Redrive and Purge of Waiting on the
// delayed-exchange backend: its retries wait in the delayed-message plugin, which
// offers no way to list them, bring them back early or drop them; they come back when
// due.
var ErrPluginWaiting = errors.New("the delayed-message plugin offers no way to list, bring back or drop the retries it keeps")

// refusePlugin is the error of an operation on the waiting retries of the
// delayed-exchange backend (what, e.g. "list"), with the plugin's count when it can be
// read, or nil for another backend.
func (o *Ops) refusePlugin(ctx context.Context, what string) error {
	sealed, ok := o.backend.(backend.Sealed)
	if !ok {
		return nil
	}
	count := ""
	if n, err := o.sealedWaitingIn(ctx, sealed, sealed.SealedIn().Name); err == nil {
		count = fmt.Sprintf("; %d wait there now, by its own count", n)
	}
	return fmt.Errorf("%s waiting retries of the %s backend (exchange %q): %w%s. They come back to their work queues when due: watch the count reach 0 with `amqpretry status` (Status.PluginWaiting); see docs/waiting.md",
		what, o.backend.Name(), sealed.SealedIn().Name, ErrPluginWaiting, count)
}

// errNoCtl: reading waiting retries without changing them needs rabbitmqctl.
var errNoCtl = errors.New("listing waiting retries without changing them needs rabbitmqctl eval (Config.Rabbitmqctl; the CLI's --rabbitmqctl): AMQP 0-9-1 can only take a message and give it back, which changes its delivery counters and its order")

// storagePattern matches the delay queues any backend may have declared under the
// prefix, whatever its settings were: the configured backend's and every other's
// (backend.Storage), each pattern its own.
func (o *Ops) storagePattern() (string, error) {
	var patterns []string
	add := func(b backend.Backend) {
		if s, ok := b.(backend.Storage); ok && !slices.Contains(patterns, s.StoragePattern()) {
			patterns = append(patterns, s.StoragePattern())
		}
	}
	add(o.backend)
	setup := derived.Of(o.retry).Setup
	for _, value := range backend.All(o.retry.Backend) {
		b, err := backend.Open(value, setup)
		if err != nil {
			return "", fmt.Errorf("the queues the %s backend declares under prefix %q: %w", value.Name(), o.retry.Prefix, err)
		}
		add(b)
	}
	if len(patterns) == 0 {
		return "^$", nil // no backend keeps retries in queues: match none
	}
	return "(?:" + strings.Join(patterns, ")|(?:") + ")", nil
}

// waitingQueues returns the delay queues that may have retries: the backend's, then
// the other queues under the prefix named as ttl-tiers' or binary-levels' (found with
// rabbitmqctl eval when Config.Rabbitmqctl is set), sorted; old reports which are not
// the configured backend's.
func (o *Ops) waitingQueues(ctx context.Context) (queues []string, old map[string]bool, err error) {
	old = map[string]bool{}
	for _, dq := range o.backend.DelayQueues() {
		queues = append(queues, dq.Name)
	}
	if o.ctl == nil {
		return queues, old, nil
	}
	found, _, err := o.peekAll(ctx, 0)
	if err != nil {
		return queues, old, err
	}
	for _, name := range found {
		if !slices.Contains(queues, name) {
			queues = append(queues, name)
			old[name] = true
		}
	}
	return queues, old, nil
}

// peekExpr lists, one JSON document a line, every quorum queue of the vhost whose name
// matches the pattern (a line with pos 0) and up to max of its messages, with the queue
// leader's read-only peek (the aux command behind rabbitmq-queues peek), on RabbitMQ
// 3.10 to 4.3: the header the queue keeps (delivery_count, acquired_count, expiry) and
// the message as rabbit_quorum_queue:peek formats it (its string and integer fields;
// the payload left out). One eval for every queue: each rabbitmqctl run costs seconds.
const peekExpr = `V = %[1]s, Pat = %[2]s, Max = %[3]d,
Cnt = fun(H, K) when is_map(H) -> maps:get(K, H, 0); (_, _) -> 0 end,
Exp = fun(H) when is_map(H) -> maps:get(expiry, H, null); ([_ | E]) when is_integer(E) -> E; (_) -> null end,
Str = fun(B) -> is_binary(B) andalso unicode:characters_to_binary(B) =:= B end,
Fmt = fun(M) when element(1, M) =:= basic_message ->
             rabbit_basic:peek_fmt_message(rabbit_basic:add_header(<<"x-amqpretry-peek">>, long, 0, M));
         (M) -> rabbit_basic:peek_fmt_message(mc:exchange(M), mc:routing_keys(M),
                  mc:protocol_state(mc:prepare(read, mc:convert(mc_amqpl, M)))) end,
Peek = fun(N, L) ->
  Loop = fun Loop(P) when P > Max -> ok;
             Loop(P) ->
               case ra:aux_command(L, {peek, P}) of
                 {ok, {H, M}} ->
                   F = Fmt(M),
                   Props = maps:from_list([{K, X} || {K, X} <- F, K =/= <<"payload (max 64 bytes)">>,
                                                        Str(X) orelse is_integer(X)]),
                   RK = [K || K <- proplists:get_value(<<"routing_keys">>, F, []), Str(K)],
                   io:format("~s~n", [rabbit_json:encode(#{<<"queue">> => N, <<"pos">> => P, <<"props">> => Props,
                     <<"routing_keys">> => RK, <<"delivery_count">> => Cnt(H, delivery_count),
                     <<"acquired_count">> => Cnt(H, acquired_count), <<"expiry">> => Exp(H)})]),
                   Loop(P + 1);
                 {error, no_message_at_pos} -> ok;
                 Err -> io:format("amqpretry-error ~ts: ~p~n", [N, Err])
               end
         end,
  Loop(1)
end,
lists:foreach(fun(Q) ->
    {resource, _, queue, N} = amqqueue:get_name(Q),
    case re:run(N, Pat) of
      nomatch -> ok;
      _ ->
        io:format("~s~n", [rabbit_json:encode(#{<<"queue">> => N, <<"pos">> => 0})]),
        case amqqueue:get_type(Q) of
          rabbit_quorum_queue -> Peek(N, amqqueue:get_pid(Q));
          T -> io:format("amqpretry-error ~ts: ~p is not a quorum queue: the broker can peek only quorum queues~n", [N, T])
        end
    end
  end, rabbit_amqqueue:list(V)),
ok.`

// delayedExpr lists what a RabbitMQ 4.3 quorum queue holds in delayed retry: due time,
// raft index and the header (the bodies stay in the log), with a read-only local query
// of its state.
const delayedExpr = `V = %[1]s, N = %[2]s,
case rabbit_amqqueue:lookup(rabbit_misc:r(V, queue, N)) of
  {ok, Q} ->
    L = amqqueue:get_pid(Q),
    Cnt = fun(H, K) when is_map(H) -> maps:get(K, H, 0); (_, _) -> 0 end,
    Hdr = fun([_ | H]) -> H; (_) -> 0 end,
    Take = fun(S) ->
             case [E || E <- tuple_to_list(S), is_tuple(E), tuple_size(E) >= 2, element(1, E) =:= delayed] of
               [D | _] -> gb_trees:to_list(element(2, D));
               [] -> no_delayed_retry
             end
           end,
    case ra:local_query(L, Take) of
      {ok, {_, no_delayed_retry}, _} -> io:format("amqpretry-error no_delayed_retry~n");
      {ok, {_, Items}, _} ->
        lists:foreach(fun({[At | Idx], M}) ->
            H = Hdr(M),
            io:format("~s~n", [rabbit_json:encode(#{<<"pos">> => Idx, <<"release">> => At,
              <<"delivery_count">> => Cnt(H, delivery_count), <<"acquired_count">> => Cnt(H, acquired_count)})])
          end, Items);
      Err -> io:format("amqpretry-error ~p~n", [Err])
    end;
  {error, not_found} -> io:format("amqpretry-error not_found~n")
end,
ok.`

// retryDelayedExpr runs RabbitMQ 4.3's internal "retry now" on a quorum queue: all its
// delayed retries (all) or the n due first.
const retryDelayedExpr = `case rabbit_amqqueue:lookup(rabbit_misc:r(%[1]s, queue, %[2]s)) of
  {ok, Q} ->
    case erlang:function_exported(rabbit_quorum_queue, retry_delayed, 2) of
      true -> io:format("amqpretry-result ~p~n", [rabbit_quorum_queue:retry_delayed(Q, %[3]s)]);
      false -> io:format("amqpretry-error no_retry_delayed~n")
    end;
  {error, not_found} -> io:format("amqpretry-error not_found~n")
end,
ok.`

// peeked is one line of peekExpr or delayedExpr.
type peeked struct {
	Queue         string            `json:"queue"`
	Pos           int               `json:"pos"`
	Props         map[string]any    `json:"props"`
	RoutingKeys   []string          `json:"routing_keys"`
	DeliveryCount int64             `json:"delivery_count"`
	AcquiredCount int64             `json:"acquired_count"`
	Expiry        *int64            `json:"expiry"`
	Release       *int64            `json:"release"`
	headers       map[string]string // Props' header.* strings
}

// peekAll lists the delay queues under the prefix (queues, sorted) and up to max
// messages of each, without changing them.
func (o *Ops) peekAll(ctx context.Context, max int) (queues []string, msgs []Message, err error) {
	pattern, err := o.storagePattern()
	if err != nil {
		return nil, nil, err
	}
	lines, err := o.eval(ctx, o.retry.Prefix+".*", fmt.Sprintf(peekExpr, backend.ErlBinary(o.vhost), backend.ErlBinary(pattern), max))
	if err != nil {
		return nil, nil, err
	}
	var body []peeked
	for _, p := range lines {
		if p.Pos == 0 {
			queues = append(queues, p.Queue)
		} else {
			body = append(body, p)
		}
	}
	slices.Sort(queues)
	out, err := o.peekedMessages(body)
	return queues, out, err
}

// peekedMessages reads what peekExpr printed.
func (o *Ops) peekedMessages(lines []peeked) ([]Message, error) {
	out := make([]Message, 0, len(lines))
	for _, p := range lines {
		d := amqp.Delivery{Headers: amqp.Table{}}
		for k, v := range p.headers {
			d.Headers[k] = v
		}
		d.MessageId, _ = p.Props["message_id"].(string)
		d.Exchange, _ = p.Props["exchange"].(string)
		if ts, ok := p.Props["timestamp"].(float64); ok {
			d.Timestamp = time.Unix(int64(ts), 0)
		}
		if len(p.RoutingKeys) > 0 {
			d.RoutingKey = p.RoutingKeys[0]
		}
		m, err := o.message(d, false)
		if err != nil {
			return out, err
		}
		m.UUID = p.headers[marshal.DefaultUUIDKey]
		m.Size = 0 // the peek leaves the payload out
		m.DelayQueue, m.Position = p.Queue, p.Pos
		m.DeliveryCount, m.AcquiredCount = p.DeliveryCount, p.AcquiredCount
		if p.Expiry != nil {
			m.Release = time.UnixMilli(*p.Expiry)
		}
		out = append(out, m)
	}
	return out, nil
}

// peekDelayed lists what the work queue holds in RabbitMQ 4.3's delayed retry.
func (o *Ops) peekDelayed(ctx context.Context, queue string) ([]Message, error) {
	lines, err := o.eval(ctx, queue, fmt.Sprintf(delayedExpr, backend.ErlBinary(o.vhost), backend.ErlBinary(queue)))
	if err != nil {
		return nil, err
	}
	out := make([]Message, 0, len(lines))
	for _, p := range lines {
		m := Message{DelayQueue: queue, Position: p.Pos, DeliveryCount: p.DeliveryCount, AcquiredCount: p.AcquiredCount}
		m.Queue = queue
		if p.Release != nil {
			m.Release = time.UnixMilli(*p.Release)
			m.Due = m.Release
		}
		out = append(out, m)
	}
	return out, nil
}

// listWaiting is List(Waiting): every delay queue peeked, the matching retries in due
// order.
func (o *Ops) listWaiting(ctx context.Context, opts ListOptions) (ListResult, error) {
	res := ListResult{Queue: opts.Queue, Messages: []Message{}}
	if err := o.refusePlugin(ctx, "list"); err != nil {
		return res, err
	}
	if o.ctl == nil {
		return res, errNoCtl
	}
	if err := errors.Join(opts.validate(), nonNegative("Window", opts.Window)); err != nil {
		return res, fmt.Errorf("list waiting retries: invalid options: %w", err)
	}
	if opts.Limit == 0 {
		opts.Limit = defaultListLimit
	}
	window := opts.Window
	if window == 0 {
		window = defaultWindow
	}
	all, complete, err := o.waiting(ctx, opts.Queue, window)
	if err != nil {
		return res, err
	}
	now := time.Now()
	res.Depth, res.Scanned, res.Complete = len(all), len(all), complete
	for _, m := range all {
		if opts.match(m, now) {
			res.Messages = append(res.Messages, m)
		}
	}
	if opts.Limit > 0 && len(res.Messages) > opts.Limit {
		res.Messages, res.Complete = res.Messages[:opts.Limit], false
	}
	return res, nil
}

// waiting reads every waiting retry (of workQueue, if named), at most window per
// queue, in due order; complete is false when a queue had more.
func (o *Ops) waiting(ctx context.Context, workQueue string, window int) (all []Message, complete bool, err error) {
	_, msgs, err := o.peekAll(ctx, window)
	if err != nil {
		return nil, false, err
	}
	complete = true
	for _, m := range msgs {
		complete = complete && m.Position < window
		if workQueue == "" || m.Queue == workQueue {
			all = append(all, m)
		}
	}
	if workQueue != "" && o.holdsRetries() {
		msgs, err := o.peekDelayed(ctx, workQueue)
		if err != nil {
			return nil, false, err
		}
		all = append(all, msgs...)
	}
	slices.SortStableFunc(all, func(a, b Message) int { return due(a).Compare(due(b)) })
	return all, complete, nil
}

// due is when a waiting retry is due back: its envelope's due time, else when the
// broker releases it.
func due(m Message) time.Time {
	if !m.Due.IsZero() {
		return m.Due
	}
	return m.Release
}

// moveWaiting is Redrive (retry now) or Purge of Waiting: each delay queue in turn,
// then, for retry now, the delayed retries RabbitMQ 4.3 holds in the work queue.
func (o *Ops) moveWaiting(ctx context.Context, opts MoveOptions, redrive bool) (MoveResult, error) {
	res := MoveResult{Queue: opts.Queue, DryRun: opts.DryRun, Messages: []Message{}, Unrouted: []Message{}, DelayQueues: []string{}}
	what := "purge"
	if redrive {
		what = "retry now"
	}
	if err := o.refusePlugin(ctx, what); err != nil {
		return res, err
	}
	queues, _, err := o.waitingQueues(ctx)
	if err != nil {
		return res, err
	}
	for _, q := range queues {
		_, exists, err := o.inspect(q)
		if err != nil {
			return res, err
		}
		if !exists {
			continue
		}
		res.DelayQueues = append(res.DelayQueues, q)
		limit := opts.Limit
		if limit > 0 {
			limit -= res.Matched
		}
		one := opts
		one.Limit, one.Progress = limit, nil
		if opts.Progress != nil {
			before := res
			one.Progress = func(r MoveResult) { opts.Progress(sum(before, r)) }
		}
		r, err := o.moveQueue(ctx, q, one, redrive, true)
		res = sum(res, r)
		if err != nil || r.Stopped != "" {
			return res, err
		}
	}
	if opts.Queue == "" || !o.holdsRetries() {
		return res, nil
	}
	return o.retryDelayed(ctx, opts, redrive, res)
}

// retryDelayed brings back (or, refusing, would purge) what RabbitMQ 4.3 holds in
// delayed retry in the work queue opts.Queue.
func (o *Ops) retryDelayed(ctx context.Context, opts MoveOptions, redrive bool, res MoveResult) (MoveResult, error) {
	q := opts.Queue
	held, err := o.peekDelayed(ctx, q)
	if err != nil {
		return res, err
	}
	if len(held) == 0 {
		return res, nil
	}
	res.DelayQueues = append(res.DelayQueues, q)
	if !redrive {
		return res, fmt.Errorf("queue %q holds %d delayed retries: RabbitMQ offers no way to drop them (purge the queue, or consume them); retry now brings them back", q, len(held))
	}
	f := opts.Filter
	f.Queue = ""
	if !f.empty() {
		return res, fmt.Errorf("queue %q holds %d delayed retries: the broker's retry now (rabbit_quorum_queue:retry_delayed) takes all or the first due, with no filter: use --limit alone", q, len(held))
	}
	mode := "all"
	n := len(held)
	if opts.Limit > 0 {
		n = min(n, max(opts.Limit-res.Matched, 0))
		mode = strconv.Itoa(n)
	}
	res.Scanned += len(held)
	res.Depth += len(held)
	res.Matched += n
	res.Messages = append(res.Messages, held[:n]...)
	if opts.DryRun || n == 0 {
		return res, nil
	}
	out, err := o.ctl(ctx, "-q", "eval", fmt.Sprintf(retryDelayedExpr, backend.ErlBinary(o.vhost), backend.ErlBinary(q), mode))
	if err != nil {
		return res, fmt.Errorf("queue %q: rabbitmqctl eval rabbit_quorum_queue:retry_delayed (needs admin rights): %w", q, o.redact(err))
	}
	r := readEval(out)
	if r.hasFailed {
		return res, evalError(q, r.failed)
	}
	num, ok := strings.CutPrefix(r.result, "{ok,")
	if !r.hasResult || !ok {
		return res, fmt.Errorf("queue %q: rabbit_quorum_queue:retry_delayed: %s", q, strings.TrimSpace(string(out)))
	}
	done, _ := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(num, "}")))
	res.Done += done
	return res, nil
}

// sum adds the counts of b to a.
func sum(a, b MoveResult) MoveResult {
	a.Depth += b.Depth
	a.Scanned += b.Scanned
	a.Matched += b.Matched
	a.Done += b.Done
	a.Skipped += b.Skipped
	a.Unroutable += b.Unroutable
	a.Messages = append(a.Messages, b.Messages...)
	a.DelayQueues = append(a.DelayQueues, b.DelayQueues...)
	a.Unrouted = append(a.Unrouted, b.Unrouted...)
	a.Stopped = b.Stopped
	return a
}
