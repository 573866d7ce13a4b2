package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// Order (issue 48, -only order): an event-sourced projection. Accounts × events, each
// account's numbered from 1, published in order (every account's event 1, then every
// account's event 2, ...) to one work queue before the consumer starts, as a projection
// rebuilt from its log; one subscriber (watermill-amqp's default prefetch, 1), one
// handler, applies them. Exactly one event in ten (-order-fail-every; a seeded draw,
// the same in every run) fails its first attempt (a lock timeout); its retry succeeds.
// Three modes:
//
//   - ordered: the router with our middleware, Config.OrderKey = the account;
//   - unordered: the same without OrderKey;
//   - in-process: Watermill's middleware.Retry, which sleeps the delay in the handler,
//     on a smaller projection of the same shape (it handles about 20 events a second:
//     the full size would take minutes for a figure that does not depend on it).
//
// Every retry waits orderDelay: the library's first (and only) delay, ttl-tiers' tier
// or delayed-retry's delay, and Watermill's InitialInterval, so that both sides wait
// the same before a retry.
//
// A run's clock starts at the first delivery and stops at the last event applied;
// events/s is the projection's events over that. The retries' lateness is the retry's
// arrival in the handler minus (the failed attempt's return + orderDelay). An event
// applied out of order is one that is not its account's next (as in the library's own
// projection test, gluetest.OrderKeepsEachKeysOrder); an event applied again is a
// duplicate. Ordered and unordered alternate, orderRounds times each (ABBA), on fresh
// queues; the ratios are of their medians (ordered ÷ unordered: the median of the
// rounds' ratios).

// orderDelay is every retry's delay, both sides. 500 ms is the issue's own measurement
// (Watermill's Retry: 30 s for 60 failing events) and half the library's default first
// delay (1 s): the shorter, the faster the in-process side, the harder the 10x goal.
const orderDelay = 500 * time.Millisecond

// orderRounds: rounds of ordered and of unordered per backend.
const orderRounds = 3

// orderBackends are the backends the order scenario runs (-order-backends); one this
// broker cannot run is skipped.
var orderBackends = []string{delay.TTLTiers().Name(), delay.DelayedRetry(0).Name()}

var errLockTimeout = errors.New("lock timeout")

// orderRun is one run's figures.
type orderRun struct {
	Mode            string    `json:"mode"`
	Round           int       `json:"round,omitempty"`
	Events          int       `json:"events"`
	Failing         int       `json:"failing"`
	Seconds         float64   `json:"seconds"`
	EventsPerS      float64   `json:"events_per_s"`
	RetryLatenessMS quantiles `json:"retry_lateness_ms"`
	OutOfOrder      int       `json:"out_of_order"`
	KeysOutOfOrder  int       `json:"keys_out_of_order"`
	Duplicates      int       `json:"duplicates"`
	// Ordered only: the keys blocked (EventKeyBlocked), the events put behind a key
	// (delivered while it was blocked: they reached the handler in a release), and how
	// long these waited, from their first delivery to their handler call.
	Blocks       int        `json:"blocks,omitempty"`
	PutBehind    int        `json:"put_behind,omitempty"`
	BehindWaitMS *quantiles `json:"behind_wait_ms,omitempty"`
	// Where the one consumer's time went: the deliveries by what became of them
	// (applied, failed and handed off, put behind, a head that released its key), the
	// count and the time spent in the middlewares and the handler; idle is the rest of
	// the run (waiting for a delivery). DrainedS: when the last event was first
	// delivered (the work queue's backlog consumed), from the start.
	Profile  map[string]orderSpent `json:"profile"`
	DrainedS float64               `json:"drained_s"`
}

// orderSpent is the deliveries of a kind and the time spent on them.
type orderSpent struct {
	N  int     `json:"n"`
	MS float64 `json:"ms"`
}

// orderBackend is a backend's runs and the goals' ratios.
type orderBackend struct {
	Skipped   string     `json:"skipped,omitempty"`
	Ordered   []orderRun `json:"ordered,omitempty"`
	Unordered []orderRun `json:"unordered,omitempty"`
	// Medians of the rounds' events/s.
	OrderedEventsPerS   float64 `json:"ordered_events_per_s,omitempty"`
	UnorderedEventsPerS float64 `json:"unordered_events_per_s,omitempty"`
	// OrderedVsInprocess: the ordered median over the in-process run (goal >= 10);
	// OrderedVsUnordered: the median of the rounds' ordered ÷ unordered (goal >= 0.8).
	OrderedVsInprocess float64   `json:"ordered_vs_inprocess,omitempty"`
	OrderedVsUnordered float64   `json:"ordered_vs_unordered,omitempty"`
	RoundRatios        []float64 `json:"ordered_vs_unordered_rounds,omitempty"`
	// OrderedOutOfOrder: events out of order over every ordered run (goal 0).
	OrderedOutOfOrder int  `json:"ordered_out_of_order"`
	GoalsMet          bool `json:"goals_met"`
}

// orderFigures is the JSON's "order".
type orderFigures struct {
	Accounts       int                      `json:"accounts"`
	FailEvery      int                      `json:"fail_every"` // one event in this many fails once
	EventsPerKey   int                      `json:"events_per_account"`
	InprocAccounts int                      `json:"inprocess_accounts"`
	DelayMS        float64                  `json:"retry_delay_ms"`
	Prefetch       int                      `json:"prefetch"`
	Rounds         int                      `json:"rounds"`
	Inprocess      *orderRun                `json:"inprocess"`
	Backends       map[string]*orderBackend `json:"backends"`
}

func runOrder(ctx context.Context, e *env, rep *report) error {
	f := &orderFigures{
		Accounts: e.sz.orderAccounts, FailEvery: e.sz.orderFailEvery, EventsPerKey: e.sz.orderEvents, InprocAccounts: e.sz.orderInprocAccounts,
		DelayMS: ms(orderDelay), Prefetch: wamqp.NewDurableQueueConfig(e.uri).Consume.Qos.PrefetchCount,
		Rounds: orderRounds, Backends: map[string]*orderBackend{},
	}
	rep.order = f
	rep.results.Order = f
	in, err := e.orderRun(ctx, "", "inprocess", e.sz.orderInprocAccounts, 0)
	if err != nil {
		return fmt.Errorf("in-process: %w", err)
	}
	f.Inprocess = in
	printOrderRun(in)
	var errs []error
	for _, name := range orderBackends {
		b := &orderBackend{}
		f.Backends[name] = b
		fmt.Printf("   %s:\n", name)
		for round := 1; round <= orderRounds; round++ {
			modes := []string{"ordered", "unordered"}
			if round%2 == 0 {
				slices.Reverse(modes)
			}
			for _, mode := range modes {
				r, err := e.orderRun(ctx, name, mode, e.sz.orderAccounts, round)
				var unsupported *skippedError
				switch {
				case errors.As(err, &unsupported):
					b.Skipped = unsupported.reason
					fmt.Printf("     skipped: %s\n", b.Skipped)
				case err != nil:
					errs = append(errs, fmt.Errorf("%s %s round %d: %w", name, mode, round, err))
					rep.noteFailure(errs[len(errs)-1])
				case mode == "ordered":
					b.Ordered = append(b.Ordered, *r)
				default:
					b.Unordered = append(b.Unordered, *r)
				}
				if r != nil {
					printOrderRun(r)
				}
				if b.Skipped != "" || err != nil || ctx.Err() != nil {
					break
				}
			}
			if b.Skipped != "" || ctx.Err() != nil || len(errs) > 0 {
				break
			}
		}
		b.summarise(in)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	return errors.Join(errs...)
}

// summarise computes b's medians and ratios against in.
func (b *orderBackend) summarise(in *orderRun) {
	if len(b.Ordered) == 0 || len(b.Unordered) == 0 {
		return
	}
	rates := func(rs []orderRun) []float64 {
		var out []float64
		for _, r := range rs {
			out = append(out, r.EventsPerS)
		}
		return out
	}
	b.OrderedEventsPerS, b.UnorderedEventsPerS = round(median(rates(b.Ordered)), 1), round(median(rates(b.Unordered)), 1)
	for i := range min(len(b.Ordered), len(b.Unordered)) {
		b.RoundRatios = append(b.RoundRatios, round(b.Ordered[i].EventsPerS/b.Unordered[i].EventsPerS, 3))
	}
	b.OrderedVsUnordered = round(median(b.RoundRatios), 3)
	if in != nil && in.EventsPerS > 0 {
		b.OrderedVsInprocess = round(b.OrderedEventsPerS/in.EventsPerS, 1)
	}
	for _, r := range b.Ordered {
		b.OrderedOutOfOrder += r.OutOfOrder
	}
	b.GoalsMet = b.OrderedVsInprocess >= 10 && b.OrderedVsUnordered >= 0.8 && b.OrderedOutOfOrder == 0
}

func printOrderRun(r *orderRun) {
	extra := ""
	if r.BehindWaitMS != nil {
		extra = fmt.Sprintf("; %d keys blocked, %d events put behind, waited p50 %.0f p99 %.0f ms", r.Blocks, r.PutBehind, r.BehindWaitMS.P50, r.BehindWaitMS.P99)
	}
	fmt.Printf("     %-10s %6d events (%d failing once) in %6.2f s: %7.1f events/s; retry lateness p50 %.0f p99 %.0f ms; out of order %d (%d keys), duplicates %d%s\n",
		r.Mode, r.Events, r.Failing, r.Seconds, r.EventsPerS, r.RetryLatenessMS.P50, r.RetryLatenessMS.P99, r.OutOfOrder, r.KeysOutOfOrder, r.Duplicates, extra)
	var kinds []string
	for k := range r.Profile {
		kinds = append(kinds, k)
	}
	slices.Sort(kinds)
	var parts []string
	for _, k := range kinds {
		parts = append(parts, fmt.Sprintf("%s %d/%.0f ms", k, r.Profile[k].N, r.Profile[k].MS))
	}
	fmt.Printf("       backlog drained at %.2f s; deliveries/time: %s\n", r.DrainedS, strings.Join(parts, ", "))
}

// skippedError: the backend cannot run on this broker.
type skippedError struct{ reason string }

func (s *skippedError) Error() string { return s.reason }

// orderAccount and orderSeq are the metadata of a projection's event.
const (
	orderAccount = "account"
	orderSeq     = "seq"
)

func orderAccountOf(msg *message.Message) string { return msg.Metadata.Get(orderAccount) }

// orderEvents returns the projection's events in publishing order (every account's
// event 1, then every account's event 2, ...) and which of them fail once: exactly one
// in failEvery, a seeded draw.
func orderEvents(accounts, perAccount, failEvery int) ([]*message.Message, map[string]bool) {
	var msgs []*message.Message
	for seq := 1; seq <= perAccount; seq++ {
		for a := range accounts {
			acc := fmt.Sprintf("acc%04d", a)
			msg := message.NewMessage(acc+"-"+strconv.Itoa(seq), []byte(`{"type":"deposited","amount":"42.00"}`))
			msg.Metadata.Set(orderAccount, acc)
			msg.Metadata.Set(orderSeq, strconv.Itoa(seq))
			msgs = append(msgs, msg)
		}
	}
	fails := map[string]bool{}
	perm := rand.New(rand.NewPCG(48, uint64(len(msgs)))).Perm(len(msgs))
	for _, i := range perm[:len(msgs)/failEvery] {
		fails[msgs[i].UUID] = true
	}
	return msgs, fails
}

// projection applies the events and measures a run.
type projection struct {
	mu        sync.Mutex
	fails     map[string]bool
	calls     map[string]int
	failedAt  map[string]time.Time
	firstSeen map[string]time.Time
	behind    map[string]bool // put behind its key at its first delivery
	last      map[string]int
	applied   map[string]bool
	keysOut   map[string]bool
	out, dups int
	late      []time.Duration
	waited    []time.Duration
	handled   int // handler calls
	putBehind int
	spent     map[string]*[2]float64 // kind: deliveries, ms
	drained   time.Time
	start     time.Time
	end       time.Time
	count     int
	total     int
	done      chan struct{}
}

func newProjection(total int, fails map[string]bool) *projection {
	return &projection{
		fails: fails, calls: map[string]int{}, failedAt: map[string]time.Time{}, firstSeen: map[string]time.Time{},
		behind: map[string]bool{}, last: map[string]int{}, applied: map[string]bool{}, keysOut: map[string]bool{},
		total: total, done: make(chan struct{}), spent: map[string]*[2]float64{},
	}
}

// outer is the outermost middleware: it sees each delivery, and tells the ones that
// returned without reaching the handler (put behind their key).
func (p *projection) outer(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		now := time.Now()
		p.mu.Lock()
		if p.start.IsZero() {
			p.start = now
		}
		if _, ok := p.firstSeen[msg.UUID]; !ok {
			p.firstSeen[msg.UUID] = now
			p.drained = now
		}
		before := p.handled
		p.mu.Unlock()
		out, err := h(msg)
		took := time.Since(now)
		p.mu.Lock()
		kind := "applied"
		switch ran := p.handled - before; {
		case err != nil:
			kind = "error"
		case ran == 0 && p.calls[msg.UUID] == 0 && orderAccountOf(msg) != "":
			kind = "put_behind"
			p.behind[msg.UUID] = true
			p.putBehind++
		case ran == 0:
			kind = "other"
		case p.failedAt[msg.UUID].After(now):
			kind = "failed"
		case ran > 1:
			kind = "release"
		}
		if p.spent[kind] == nil {
			p.spent[kind] = &[2]float64{}
		}
		p.spent[kind][0]++
		p.spent[kind][1] += float64(took) / float64(time.Millisecond)
		p.mu.Unlock()
		return out, err
	}
}

func (p *projection) handle(msg *message.Message) error {
	now := time.Now()
	acc := orderAccountOf(msg)
	seq, _ := strconv.Atoi(msg.Metadata.Get(orderSeq))
	p.mu.Lock()
	defer p.mu.Unlock()
	p.handled++
	id := msg.UUID
	n := p.calls[id]
	p.calls[id]++
	if n == 0 && p.behind[id] {
		p.waited = append(p.waited, now.Sub(p.firstSeen[id]))
	}
	if n == 1 {
		if at, ok := p.failedAt[id]; ok {
			p.late = append(p.late, now.Sub(at.Add(orderDelay)))
		}
	}
	if n == 0 && p.fails[id] {
		p.failedAt[id] = time.Now()
		return errLockTimeout
	}
	key := acc + "/" + strconv.Itoa(seq)
	if p.applied[key] {
		p.dups++
		return nil
	}
	if seq != p.last[acc]+1 {
		p.out++
		p.keysOut[acc] = true
	}
	p.applied[key] = true
	p.last[acc] = max(p.last[acc], seq)
	p.end = now
	if p.count++; p.count == p.total {
		close(p.done)
	}
	return nil
}

// keyEvents counts the key events the Retry observes.
type keyEvents struct {
	mu                sync.Mutex
	blocked, released int
}

func (k *keyEvents) observe(ev amqpretry.Event) {
	k.mu.Lock()
	defer k.mu.Unlock()
	switch ev.Kind {
	case amqpretry.EventKeyBlocked:
		k.blocked++
	case amqpretry.EventKeyReleased:
		k.released++
	}
}

func (k *keyEvents) counts() (blocked, released int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.blocked, k.released
}

// orderRun runs mode (ordered, unordered: our middleware on backendName; inprocess:
// Watermill's Retry) on a fresh projection of accounts accounts.
func (e *env) orderRun(ctx context.Context, backendName, mode string, accounts, rnd int) (*orderRun, error) {
	conn, err := e.dial()
	if err != nil {
		return nil, err
	}
	defer conn.Close() //nolint:errcheck

	runSeq++
	tag := mode
	if backendName != "" {
		tag += "-" + backendName
	}
	topic := e.name("order", fmt.Sprintf("%s-%d", tag, runSeq))
	msgs, fails := orderEvents(accounts, e.sz.orderEvents, e.sz.orderFailEvery)
	p := newProjection(len(msgs), fails)
	ev := &keyEvents{}

	logger := watermill.NopLogger{}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		return nil, err
	}
	router.AddMiddleware(p.outer)
	subCfg := wamqp.NewDurableQueueConfig(e.uri)
	var retry *wamqp3.Retry
	switch mode {
	case "inprocess":
		router.AddMiddleware(wmiddleware.Retry{MaxRetries: 4, InitialInterval: orderDelay, Multiplier: 1, MaxInterval: orderDelay}.Middleware)
	case "ordered", "unordered":
		prefix := e.name("order-delay", strconv.Itoa(runSeq))
		rcfg := amqpretry.Config{Prefix: prefix, PoisonQueue: prefix + ".poison", Observe: ev.observe}
		switch backendName {
		case delay.DelayedRetry(0).Name():
			rcfg.Backend = delay.DelayedRetry(orderDelay)
			rcfg.Policy = amqpretry.Policy{MaxAttempts: 5}
		case delay.TTLTiers().Name():
			rcfg.Backend = delay.TTLTiers(orderDelay)
			rcfg.Policy = amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{orderDelay}, Jitter: -1}
		default:
			return nil, fmt.Errorf("backend %q: the order scenario runs %s", backendName, strings.Join(orderBackends, ", "))
		}
		if mode == "ordered" {
			rcfg.OrderKey = orderAccountOf
			for a := range accounts {
				e.reg.queue(names.Names{Prefix: prefix}.Behind(topic, fmt.Sprintf("acc%04d", a)))
			}
		}
		e.reg.queue(rcfg.PoisonQueue)
		if plan, perr := rcfg.Plan(topic); perr == nil {
			e.reg.topology(plan)
		}
		retry, err = wamqp3.New(subCfg, rcfg)
		if errors.Is(err, delay.ErrUnsupported) || errors.Is(err, delay.ErrPluginMissing) {
			e.reg.markUnsure()
			return nil, &skippedError{err.Error()}
		}
		if err != nil {
			return nil, err
		}
		defer retry.Close() //nolint:errcheck // after the router
		subCfg = retry.SubscriberConfig()
		router.AddMiddleware(retry.Middleware)
	default:
		return nil, fmt.Errorf("unknown mode %q", mode)
	}
	// The work queue as the subscriber declares it, then the events.
	if err := e.declare(conn, topology.Topology{Queues: []topology.Queue{{Name: topic, Args: subCfg.Queue.Arguments}}}); err != nil {
		return nil, err
	}
	if err := prefill(ctx, conn, topic, msgs); err != nil {
		return nil, fmt.Errorf("prefill %s: %w", topic, err)
	}
	sub, err := wamqp.NewSubscriber(subCfg, logger)
	if err != nil {
		return nil, err
	}
	defer sub.Close() //nolint:errcheck
	router.AddConsumerHandler("projection", topic, sub, p.handle)
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	// 10 events/s is far below any mode's rate (in-process: about 20); it only bounds a
	// broken run.
	timeout := time.Minute + time.Duration(len(msgs))*100*time.Millisecond
	var failed error
	select {
	case <-p.done:
	case err := <-runErr:
		failed = fmt.Errorf("router stopped: %w", err)
	case <-ctx.Done():
		failed = ctx.Err()
	case <-time.After(timeout):
		p.mu.Lock()
		failed = fmt.Errorf("%d of %d events applied within %s", p.count, p.total, timeout)
		p.mu.Unlock()
	}
	// Every key blocked is released (its behind queue deleted) before the router stops.
	if failed == nil && mode == "ordered" {
		deadline := time.Now().Add(time.Minute)
		for b, r := ev.counts(); b != r; b, r = ev.counts() {
			if time.Now().After(deadline) {
				failed = fmt.Errorf("%d keys blocked, %d released a minute after the last event", b, r)
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	if err := router.Close(); err != nil && failed == nil {
		failed = err
	}
	if failed != nil {
		return nil, failed
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	secs := p.end.Sub(p.start).Seconds()
	r := &orderRun{
		Mode: mode, Round: rnd, Events: p.total, Failing: len(fails), Seconds: round(secs, 2), EventsPerS: round(float64(p.total)/secs, 1),
		RetryLatenessMS: quantilesOf(p.late), OutOfOrder: p.out, KeysOutOfOrder: len(p.keysOut), Duplicates: p.dups,
		Profile: map[string]orderSpent{}, DrainedS: round(p.drained.Sub(p.start).Seconds(), 2),
	}
	busy := 0.0
	for k, v := range p.spent {
		r.Profile[k] = orderSpent{N: int(v[0]), MS: round(v[1], 0)}
		busy += v[1]
	}
	r.Profile["idle"] = orderSpent{MS: round(secs*1000-busy, 0)}
	if mode == "ordered" {
		b, _ := ev.counts()
		q := quantilesOf(p.waited)
		r.Blocks, r.PutBehind, r.BehindWaitMS = b, p.putBehind, &q
		if st := retry.Stats(); st.BlockedKeys != 0 || st.Behind != 0 {
			return nil, fmt.Errorf("stats after every release: %d keys blocked, %d behind", st.BlockedKeys, st.Behind)
		}
	}
	return r, nil
}

// orderTable is the order scenario's rows of the results table.
func orderTable(w func(format string, a ...any), f *orderFigures) {
	row := func(name string, r orderRun) {
		w("order %s\t%.1f events/s\t\t\t%d events (%d failing once) in %.2f s; retry lateness p50 %.0f, p99 %.0f ms; out of order %d events (%d keys); duplicates %d",
			name, r.EventsPerS, r.Events, r.Failing, r.Seconds, r.RetryLatenessMS.P50, r.RetryLatenessMS.P99, r.OutOfOrder, r.KeysOutOfOrder, r.Duplicates)
		if r.BehindWaitMS != nil {
			w("; %d keys blocked, %d events put behind, waited p50 %.0f, p99 %.0f ms", r.Blocks, r.PutBehind, r.BehindWaitMS.P50, r.BehindWaitMS.P99)
		}
		w("\n")
	}
	if f.Inprocess != nil {
		row("Watermill middleware.Retry", *f.Inprocess)
	}
	for _, name := range orderBackends {
		b := f.Backends[name]
		switch {
		case b == nil:
			continue
		case b.Skipped != "":
			w("order %s\tskipped\t\t\t%s\n", name, short(b.Skipped))
			continue
		}
		for _, r := range b.Ordered {
			row(fmt.Sprintf("%s ordered, round %d", name, r.Round), r)
		}
		for _, r := range b.Unordered {
			row(fmt.Sprintf("%s unordered, round %d", name, r.Round), r)
		}
		if len(b.RoundRatios) == 0 {
			continue
		}
		w("order %s ordered vs in-process\t%.1f\t>= 10\t%s\tmedian ordered %.1f events/s vs Watermill middleware.Retry %.1f events/s (%d accounts)\n",
			name, b.OrderedVsInprocess, met(b.OrderedVsInprocess >= 10), b.OrderedEventsPerS, f.Inprocess.EventsPerS, f.InprocAccounts)
		w("order %s ordered vs unordered\t%.3f\t>= 0.8\t%s\tmedian of the rounds' ratios %s; medians ordered %.1f, unordered %.1f events/s\n",
			name, b.OrderedVsUnordered, met(b.OrderedVsUnordered >= 0.8), joinf(b.RoundRatios, 3), b.OrderedEventsPerS, b.UnorderedEventsPerS)
		w("order %s ordered out of order\t%d\t0\t%s\tevents applied out of order over the %d ordered runs\n",
			name, b.OrderedOutOfOrder, met(b.OrderedOutOfOrder == 0), len(b.Ordered))
	}
	w("  (order: %d accounts x %d events, one in %d failing once, in-process %d accounts; retry delay %.0f ms both sides; prefetch %d, one handler)\n",
		f.Accounts, f.EventsPerKey, f.FailEvery, f.InprocAccounts, f.DelayMS, f.Prefetch)
}
