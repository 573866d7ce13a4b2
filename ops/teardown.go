package ops

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/derived"
	"github.com/amqpretry/amqpretry/topology"
)

// TeardownOptions configures Teardown.
type TeardownOptions struct {
	// Keep is what must stay: the topology of the configuration in use now (its
	// Config.Plan), when the one torn down shares a prefix with it. A queue or exchange
	// named in Keep is never removed.
	Keep topology.Topology
	// Shared also removes what every backend under the prefix shares: the parking
	// exchange and queue, the poison queue (Config.Retry.PoisonQueue), and the behind
	// queues of the blocked order keys (amqpretry.Config.OrderKey; found with
	// Config.Rabbitmqctl), whose keys an empty one still blocks.
	Shared bool
	// DryRun reports what would be removed and what waits there, and removes nothing.
	DryRun bool
	// Force removes even while messages wait there: they are lost.
	Force bool
	// Only, when not nil, names the queues and exchanges that may be removed: what a
	// dry run showed and the user confirmed. Anything else found stays, in
	// TeardownResult.Left.
	Only []string
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
	// BindingList are those Bindings: with Config.Rabbitmqctl, every binding the
	// broker lists from or to what goes (rabbitmqctl list_bindings), those to the work
	// queues from a delivery exchange included; without it, those of the backends'
	// plans.
	BindingList []topology.Binding `json:"binding_list"`
	// Waiting counts the messages each queue (or the delayed-message plugin, by its
	// exchange) keeps, all of them: ready, unacked, and those kept for dead lettering.
	Waiting map[string]int `json:"waiting"`
	// Left names what Teardown found and left there, and why: what
	// TeardownOptions.Keep names, the parking exchange and queue and the poison queue
	// without TeardownOptions.Shared, what TeardownOptions.Only leaves out, and, with
	// Config.Rabbitmqctl, the application's work queues bound from an exchange that
	// goes, and the exchanges bound to them (its topics).
	Left []Left `json:"left"`
	// Unsearched are the names, as patterns, Teardown could not look for: without
	// Config.Rabbitmqctl, the delay queues of ttl-tiers tiers other than the
	// configured and the default ones, which only a listing finds.
	Unsearched []string `json:"unsearched"`
	// DryRun: nothing was removed.
	DryRun bool `json:"dry_run"`
}

// Left is a queue or exchange Teardown found and left, and why.
type Left struct {
	Name string `json:"name"`
	Kind string `json:"kind"` // "queue" or "exchange"
	// Why: LeftKept, LeftShared, LeftNotShown or LeftApplication.
	Why string `json:"why"`
}

// Values of Left.Why.
const (
	// LeftKept: TeardownOptions.Keep names it (in use).
	LeftKept = "kept"
	// LeftShared: every backend under the prefix shares it (the parking exchange and
	// queue, the poison queue, the behind queues); TeardownOptions.Shared removes it.
	LeftShared = "shared"
	// LeftNotShown: TeardownOptions.Only does not name it (not shown at the
	// confirmation: it appeared since).
	LeftNotShown = "not shown"
	// LeftApplication: the application's, never removed: a work queue bound from an
	// exchange that goes (its binding goes with that exchange), or an exchange bound to
	// such a work queue (a topic its subscribers declare).
	LeftApplication = "application"
)

// Teardown removes the broker side of the backends under the prefix of Config.Retry:
// the delay queues and exchanges, delivery exchanges and the bindings that go with
// them of the backend Config.Retry describes (with its Tiers or Levels) and of every
// other backend, whatever it was configured with (binary-levels' levels, up to the
// most it can have; the delayed-exchange backend's exchange), so that one teardown
// removes the old storage after any change of Backend, Tiers, Levels or Prefix. The
// delay queues of ttl-tiers tiers other than the configured and default ones are found
// only by a listing, with Config.Rabbitmqctl; without it TeardownResult.Unsearched says
// so. What opts.Keep names stays; the parking exchange and queue and the poison queue
// stay unless opts.Shared, and so do the behind queues of the blocked order keys (found
// with Config.Rabbitmqctl): they belong to the configuration in use, whatever its
// backend. TeardownResult.Left names what stayed, and why. Work queues
// and the application's exchanges are never removed: with Config.Rabbitmqctl the
// bindings are listed, and Left names the work queues bound from an exchange that
// goes, and the exchanges bound to them.
//
// It counts and removes only what it finds on the broker; when it finds nothing under
// the prefix (a typo in it, storage already removed) it fails, saying so
// ("teardown: nothing to remove").
//
// It refuses ("teardown refused"), removing nothing, while anything waits there,
// unless opts.Force: the broker's own counts are read with Config.Rabbitmqctl
// (rabbitmqctl list_queues: what a passive declare cannot see, the expired messages a
// quorum queue keeps for dead lettering), and, for a delayed-message exchange found,
// the plugin's own count (rabbitmqctl eval); without them it cannot know and refuses.
// Queues go first, then exchanges. Quorum queues cannot be deleted "if empty": a retry
// parked into the old storage between the count and the delete would be lost, so stop
// every application instance still running the old configuration first.
func (o *Ops) Teardown(ctx context.Context, opts TeardownOptions) (TeardownResult, error) {
	res := TeardownResult{Queues: []string{}, Exchanges: []string{}, BindingList: []topology.Binding{}, Waiting: map[string]int{}, Left: []Left{}, Unsearched: []string{}, DryRun: opts.DryRun}
	t, sealed, err := o.everyBackend()
	if err != nil {
		return res, err
	}
	var keptQ, keptX []string
	for _, q := range opts.Keep.Queues {
		keptQ = append(keptQ, q.Name)
	}
	for _, x := range opts.Keep.Exchanges {
		keptX = append(keptX, x.Name)
	}
	// The behind queues of the blocked order keys: only a listing finds them.
	behind := map[string]bool{}
	if o.ctl != nil {
		keys, err := o.behindQueues(ctx)
		if err != nil {
			return res, err
		}
		for _, b := range keys {
			behind[b.BehindQueue] = true
		}
	}
	// left names why name stays, or "" when it goes.
	left := func(name string, kept []string) string {
		switch {
		case slices.Contains(kept, name):
			return LeftKept
		case !opts.Shared && (name == o.names.Parking() || name == o.retry.PoisonQueue || behind[name]):
			return LeftShared
		case opts.Only != nil && !slices.Contains(opts.Only, name):
			return LeftNotShown
		}
		return ""
	}
	var candQ, candX []string // what may be there, each once, in plan order
	for _, q := range t.Queues {
		if !slices.Contains(candQ, q.Name) {
			candQ = append(candQ, q.Name)
		}
	}
	if !slices.Contains(candQ, o.retry.PoisonQueue) {
		candQ = append(candQ, o.retry.PoisonQueue)
	}
	if o.ctl != nil {
		found, _, err := o.peekAll(ctx, 0)
		if err != nil {
			return res, err
		}
		for _, q := range found {
			if !slices.Contains(candQ, q) {
				candQ = append(candQ, q)
			}
		}
		var bs []string
		for q := range behind {
			bs = append(bs, q)
		}
		slices.Sort(bs)
		candQ = append(candQ, bs...)
	}
	for _, x := range t.Exchanges {
		if !slices.Contains(candX, x.Name) {
			candX = append(candX, x.Name)
		}
	}

	// What is there: only that is removed, or named as left.
	ready := map[string]int{} // what a passive declare sees
	for _, q := range candQ {
		declared, exists, err := o.inspect(q)
		if err != nil {
			return res, err
		}
		switch {
		case !exists:
		case left(q, keptQ) != "":
			res.Left = append(res.Left, Left{Name: q, Kind: "queue", Why: left(q, keptQ)})
		default:
			res.Queues = append(res.Queues, q)
			ready[q] = declared.Messages
		}
	}
	for _, x := range candX {
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
		switch {
		case !ok:
		case left(x, keptX) != "":
			res.Left = append(res.Left, Left{Name: x, Kind: "exchange", Why: left(x, keptX)})
		default:
			res.Exchanges = append(res.Exchanges, x)
		}
	}
	if o.ctl == nil {
		// Without a listing, only the names the backends' plans give are looked for.
		unsearched, err := o.unenumerable()
		if err != nil {
			return res, err
		}
		res.Unsearched = append(res.Unsearched, unsearched...)
		if opts.Shared {
			res.Unsearched = append(res.Unsearched, o.names.BehindQueues())
		}
	}
	if len(res.Queues) == 0 && len(res.Exchanges) == 0 {
		if len(res.Left) > 0 {
			return res, fmt.Errorf("%w under prefix %q: of what any backend declares there, only what stays was found (%d, TeardownResult.Left: shared by every backend, or kept); the shared ones go with Shared (the CLI's --shared)", ErrNothingToTearDown, o.retry.Prefix, len(res.Left))
		}
		return res, fmt.Errorf("%w: no queue or exchange of any backend under prefix %q (nothing removed); check the prefix against the configuration that declared them", ErrNothingToTearDown, o.retry.Prefix)
	}
	if o.ctl != nil {
		listed, err := o.ctlBindings(ctx)
		if err != nil {
			return res, err
		}
		res.BindingList, res.Left = boundWith(listed, res)
	} else {
		res.BindingList, err = o.bindingsFound(t, res)
		if err != nil {
			return res, err
		}
	}
	res.Bindings = len(res.BindingList)

	// What waits there.
	var unknown []error
	var counts BrokerCounts
	if o.ctl == nil {
		unknown = append(unknown, errors.New("the broker's counts are unknown without rabbitmqctl (Config.Rabbitmqctl; the CLI's --rabbitmqctl): a passive declare does not see the messages a quorum queue keeps for dead lettering"))
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
	for _, x := range res.Exchanges {
		sb, ok := sealed[x]
		if !ok {
			continue
		}
		n, err := o.sealedWaitingIn(ctx, sb.(backend.Sealed), x)
		switch {
		case err != nil:
			unknown = append(unknown, err)
		case n > 0:
			res.Waiting[x] = n
		}
	}

	if !opts.Force {
		if len(res.Waiting) > 0 {
			var parts []string
			var kinds waitKinds
			total := 0
			for _, name := range append(slices.Clone(res.Queues), res.Exchanges...) {
				n, ok := res.Waiting[name]
				if !ok {
					continue
				}
				parts = append(parts, name+": "+strconv.Itoa(n))
				total += n
				sb, inPlugin := sealed[name]
				switch {
				case inPlugin && slices.Contains(res.Exchanges, name):
					if kinds.inPlugin == "" {
						kinds.inPlugin = sb.Name()
					}
				case name == o.retry.PoisonQueue:
					kinds.poison = name
				case name == o.names.Parking():
					kinds.parking = name
				case behind[name]:
					kinds.behind = o.names.BehindQueues()
				default:
					kinds.delay = true
				}
			}
			if len(parts) > shownWaiting {
				parts = append(parts[:shownWaiting], fmt.Sprintf("and %d more (%d messages in all)", len(parts)-shownWaiting, total))
			}
			return res, fmt.Errorf("teardown refused: messages wait in %s; %s; or force it (they are lost)", strings.Join(parts, ", "), waitAdvice(kinds))
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
		// check. A behind queue is a classic queue: if-empty keeps a message put behind
		// its key since the count.
		ifEmpty := behind[q] && !opts.Force
		if _, err := ch.QueueDelete(q, false, ifEmpty, false); err != nil {
			if ifEmpty {
				return res, fmt.Errorf("delete queue %q: %w: a message was put behind its key since the count (an application still runs there): release the key (amqpretry blocked release), stop the application, and run teardown again (nothing after it removed)", q, o.redact(err))
			}
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

// everyBackend is what every backend with storage on the broker declares under the
// prefix: the configured backend's plan first, then each other backend's at its
// widest (backend.Widest: binary-levels with backend.MaxLevels levels; ttl-tiers with
// the configured tiers, or the default ones); sealed maps the exchanges of a backend
// whose messages only its plugin counts (backend.Sealed) to that backend.
func (o *Ops) everyBackend() (t topology.Topology, sealed map[string]backend.Backend, err error) {
	sealed = map[string]backend.Backend{}
	add := func(b backend.Backend) {
		bt := b.Topology()
		t.Queues = append(t.Queues, bt.Queues...)
		t.Exchanges = append(t.Exchanges, bt.Exchanges...)
		for _, nb := range bt.Bindings {
			// The same binding in two plans (a tier of the configured and the default
			// ladders) is one binding.
			if !slices.ContainsFunc(t.Bindings, func(b topology.Binding) bool {
				return b.Exchange == nb.Exchange && b.Destination == nb.Destination && b.Key == nb.Key && b.ToExchange == nb.ToExchange
			}) {
				t.Bindings = append(t.Bindings, nb)
			}
		}
		if _, ok := b.(backend.Sealed); ok {
			for _, x := range bt.Exchanges {
				if _, seen := sealed[x.Name]; !seen {
					sealed[x.Name] = b
				}
			}
		}
	}
	add(o.backend)
	setup := derived.Of(o.retry).Setup
	for _, value := range backend.All(o.retry.Backend) {
		b, err := backend.Open(value, setup)
		if err != nil {
			return t, nil, fmt.Errorf("teardown: the names the %s backend declares under prefix %q: %w", value.Name(), o.retry.Prefix, err)
		}
		if w, ok := b.(backend.Widest); ok {
			b = w.Widest()
		}
		if _, ok := b.(backend.InProcess); !ok {
			add(b)
		}
	}
	return t, sealed, nil
}

// unenumerable are the patterns of the delay queues of any backend that only a listing
// finds (backend.Storage): ttl-tiers' tiers of any earlier ladder.
func (o *Ops) unenumerable() ([]string, error) {
	var out []string
	add := func(b backend.Backend) {
		if s, ok := b.(backend.Storage); ok && s.Unenumerable() != "" && !slices.Contains(out, s.Unenumerable()) {
			out = append(out, s.Unenumerable())
		}
	}
	add(o.backend)
	setup := derived.Of(o.retry).Setup
	for _, value := range backend.All(o.retry.Backend) {
		b, err := backend.Open(value, setup)
		if err != nil {
			return nil, fmt.Errorf("teardown: the names the %s backend declares under prefix %q: %w", value.Name(), o.retry.Prefix, err)
		}
		add(b)
	}
	return out, nil
}

// shownWaiting is how many of the places where messages wait a refusal names (the
// result's Waiting has them all).
const shownWaiting = 3

// waitKinds are the kinds of places where a refused teardown found messages waiting.
type waitKinds struct {
	delay    bool   // delay queues
	inPlugin string // the backend whose plugin keeps some (backend.Sealed), or ""
	poison   string // the poison queue, or ""
	parking  string // the parking queue, or ""
	behind   string // the pattern of the behind queues, when some wait there, or ""
}

// waitAdvice says what to do about the messages waiting in the storage torn down,
// short of forcing it, for each kind of place where they wait: each has its own fix.
func waitAdvice(k waitKinds) string {
	var advice []string
	if k.delay {
		advice = append(advice, "the retries in the delay queues: wait until they have come due (amqpretry status), or bring them back now (amqpretry waiting retry-now)")
	}
	if k.inPlugin != "" {
		// The plugin cannot give its messages back early: waiting is all there is.
		advice = append(advice, "the retries in the delayed-message plugin: wait until the plugin's count reaches 0 as they come due (watch it with `amqpretry status --backend "+k.inPlugin+"`; the plugin offers no way to bring them back early)")
	}
	if k.poison != "" {
		advice = append(advice, "the messages in the poison queue "+k.poison+": redrive them to their work queues (amqpretry poison redrive), or drop them (amqpretry poison purge)")
	}
	if k.parking != "" {
		advice = append(advice, "the retries in the parking queue "+k.parking+": re-create the work queues `amqpretry parking list` names and redrive them (amqpretry parking redrive), or drop them (amqpretry parking purge)")
	}
	if k.behind != "" {
		advice = append(advice, "the messages behind blocked order keys ("+k.behind+"): release the keys first (`amqpretry blocked list` shows them, `amqpretry blocked release` releases one), and let the application that consumes their work queues run them")
	}
	return "for " + strings.Join(advice, "; for ")
}

// ctlBindings lists the bindings of the vhost with rabbitmqctl list_bindings, but those
// of the default exchange (every queue has one).
func (o *Ops) ctlBindings(ctx context.Context) ([]topology.Binding, error) {
	out, err := o.ctl(ctx, "-q", "list_bindings", "-p", o.vhost, "source_name", "destination_name", "destination_kind", "routing_key", "--no-table-headers")
	if err != nil {
		return nil, fmt.Errorf("rabbitmqctl list_bindings: %w", o.redact(err))
	}
	var bs []topology.Binding
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Split(strings.TrimRight(line, "\r"), "\t")
		if len(f) != 4 || f[0] == "" {
			continue
		}
		bs = append(bs, topology.Binding{Exchange: f[0], Destination: f[1], ToExchange: f[2] == "exchange", Key: f[3]})
	}
	return bs, nil
}

// boundWith returns, of the bindings listed, those that go with what res removes (from
// or to it), and res.Left with the application's objects they name: the work queues
// bound from an exchange that goes, then the exchanges bound to those queues (its
// topics), each once.
func boundWith(listed []topology.Binding, res TeardownResult) (gone []topology.Binding, left []Left) {
	gone, left = []topology.Binding{}, res.Left
	isLeft := func(name, kind string) bool {
		return slices.ContainsFunc(left, func(l Left) bool { return l.Name == name && l.Kind == kind })
	}
	var work []string
	for _, b := range listed {
		fromGone := slices.Contains(res.Exchanges, b.Exchange)
		toGone := slices.Contains(res.Exchanges, b.Destination)
		if !b.ToExchange {
			toGone = slices.Contains(res.Queues, b.Destination)
		}
		if !fromGone && !toGone {
			continue
		}
		gone = append(gone, b)
		if fromGone && !toGone && !b.ToExchange && !isLeft(b.Destination, "queue") {
			left = append(left, Left{Name: b.Destination, Kind: "queue", Why: LeftApplication})
			work = append(work, b.Destination)
		}
	}
	for _, b := range listed {
		if !b.ToExchange && slices.Contains(work, b.Destination) && !slices.Contains(res.Exchanges, b.Exchange) && !isLeft(b.Exchange, "exchange") {
			left = append(left, Left{Name: b.Exchange, Kind: "exchange", Why: LeftApplication})
		}
	}
	return gone, left
}

// bindingsFound are the bindings of the backends' plan t that go with what res
// removes and whose two ends exist: only those can be on the broker.
func (o *Ops) bindingsFound(t topology.Topology, res TeardownResult) ([]topology.Binding, error) {
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
	found := []topology.Binding{}
	for _, b := range t.Bindings {
		if !exchanges[b.Exchange] && !(b.ToExchange && exchanges[b.Destination]) && !(!b.ToExchange && queues[b.Destination]) {
			continue
		}
		src, err := exists(b.Exchange, true)
		if err != nil {
			return found, err
		}
		dst, err := exists(b.Destination, b.ToExchange)
		if err != nil {
			return found, err
		}
		if src && dst {
			found = append(found, b)
		}
	}
	return found, nil
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

// errSealedCount: a sealed backend's count of its waiting retries could not be read.
var errSealedCount = errors.New("the count of the retries waiting in exchange")

// sealedWaiting is how many retries wait in the configured backend's sealed exchange,
// as the backend reads them (backend.Sealed); 0 for another backend.
func (o *Ops) sealedWaiting(ctx context.Context) (int, error) {
	sealed, ok := o.backend.(backend.Sealed)
	if !ok {
		return 0, nil
	}
	return o.sealedWaitingIn(ctx, sealed, sealed.SealedIn().Name)
}

// sealedWaitingIn is how many retries wait in exchange x of sealed, as it reads them
// with rabbitmqctl eval; never a guess.
func (o *Ops) sealedWaitingIn(ctx context.Context, sealed backend.Sealed, x string) (int, error) {
	if o.ctl == nil {
		return 0, fmt.Errorf("%w %q is unknown: reading it needs rabbitmqctl eval (Config.Rabbitmqctl; the CLI's --rabbitmqctl)", errSealedCount, x)
	}
	eval := func(ctx context.Context, expr string) ([]byte, error) {
		out, err := o.ctl(ctx, "-q", "eval", expr)
		if err != nil {
			return out, fmt.Errorf("rabbitmqctl eval (needs admin rights): %w", o.redact(err))
		}
		return out, nil
	}
	n, err := sealed.CountSealed(ctx, eval, o.vhost, x)
	if err != nil {
		return 0, fmt.Errorf("%w %q is unknown: %w", errSealedCount, x, err)
	}
	return n, nil
}
