package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// Throughput under failure: one watermill-amqp router over one durable queue
// (NewDurableQueueConfig: prefetch 1; a subscription handles one message at a time), N
// messages published before the router starts. The figures use ONE handler, as
// Watermill's own measurement (33 msg/s with in-process retry); the same runs with 4
// handlers on the queue are printed beside them. In the failing runs every tenth message fails on
// its first two attempts and succeeds on the third; the policy is 100 ms, x2, no jitter.
//
//   - no failures: the same router, nothing fails, no middleware;
//   - broker retry: our middleware, ttl-tiers with tiers 100ms 200ms 400ms;
//   - in-process retry: Watermill's middleware.Retry (MaxRetries 2, InitialInterval
//     100 ms, Multiplier 2, MaxInterval 1 s, no randomisation), which sleeps in the
//     handler.
//
// A run's clock starts at the first handler call. Its rates: all messages over the time
// to the last success (handled msg/s), and the never-failing messages over the time to
// the last of them (healthy msg/s).

const failKey = "bench-fail"

// runSeq numbers the router runs, so that each has a queue of its own.
var runSeq int

var errPlanned = errors.New("planned failure")

type variant int

const (
	noFailures variant = iota
	brokerRetry
	inprocessRetry
	ceilingRetry // see ceiling.go
	plainRetry   // see ceiling.go; no router
)

func (v variant) String() string {
	return [...]string{"no-failures", "broker-retry", "inprocess-retry", "ceiling", "plain-amqp091"}[v]
}

// throughputSet is one set of runs at a number of handlers.
type throughputSet struct {
	handlers          int
	n, inprocN        int
	noFailRates       [2]float64       // msg/s, before and after the broker-retry run
	noFailRate        float64          // their mean
	healthyRate       float64          // msg/s of the never-failing messages, broker retry
	oursHandledRate   float64          // msg/s, all messages, broker retry
	inprocHandledRate float64          // msg/s, all messages, in-process retry
	oursGaps          [2]time.Duration // mean time from failed attempt 1 to 2, and 2 to 3
	inprocGaps        [2]time.Duration
	// steady-state handled rates (runStats.steadyRate), one per round, ours and
	// in-process alternately, and the ceiling middleware's (ceiling.go) in the same
	// rounds: what the same at-least-once work reaches without our code
	oursSteady, inprocSteady, ceilSteady []float64
}

func (t throughputSet) healthyRatio() float64     { return t.healthyRate / t.noFailRate }
func (t throughputSet) vsInprocessWhole() float64 { return t.oursHandledRate / t.inprocHandledRate }

// vsInprocessRounds are the steady-state ratios of the rounds.
func (t throughputSet) vsInprocessRounds() []float64 {
	r := make([]float64, len(t.oursSteady))
	for i := range r {
		r[i] = t.oursSteady[i] / t.inprocSteady[i]
	}
	return r
}

// vsInprocess is the median of the rounds' steady-state ratios.
func (t throughputSet) vsInprocess() float64 { return median(t.vsInprocessRounds()) }

// ceilingVsInprocess is the same median with the ceiling middleware in place of ours:
// the bound of vsInprocess.
func (t throughputSet) ceilingVsInprocess() float64 {
	r := make([]float64, len(t.ceilSteady))
	for i := range r {
		r[i] = t.ceilSteady[i] / t.inprocSteady[i]
	}
	return median(r)
}

// throughputDetail: sets[0] is the figure of the issue (one handler, as Watermill's
// own measurement); sets[1] shows what several handlers on the queue change.
type throughputDetail struct {
	sets []throughputSet
}

// runStats is what the handler saw during one router run.
type runStats struct {
	mu          sync.Mutex
	n           int
	work        time.Duration // handler work per call (a sleep)
	doneAt      []time.Time   // first success of each message, in order
	first       time.Time
	last        time.Time // last first-time success
	lastHealthy time.Time
	healthy     int
	calls       int
	attempts    map[string][]time.Time // failing messages: the time of every attempt
	done        map[string]struct{}
	finished    chan struct{}
	failTimes   int    // attempts a failing message fails before it succeeds
	cpu         cpuUse // CPU used from the router's start to the last success (native43.go)
}

func newRunStats(n int, work time.Duration) *runStats {
	return &runStats{n: n, work: work, attempts: map[string][]time.Time{}, done: map[string]struct{}{}, finished: make(chan struct{}), failTimes: 2}
}

func (s *runStats) handle(msg *message.Message) error {
	if s.work > 0 {
		time.Sleep(s.work)
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.first.IsZero() {
		s.first = now
	}
	s.calls++
	failing := msg.Metadata.Get(failKey) == "1"
	if failing {
		ts := append(s.attempts[msg.UUID], now)
		s.attempts[msg.UUID] = ts
		if len(ts) <= s.failTimes {
			return errPlanned
		}
	}
	if _, dup := s.done[msg.UUID]; dup { // a redelivery (at least once)
		return nil
	}
	s.done[msg.UUID] = struct{}{}
	s.doneAt = append(s.doneAt, now)
	s.last = now
	if !failing {
		s.healthy++
		s.lastHealthy = now
	}
	if len(s.done) == s.n {
		close(s.finished)
	}
	return nil
}

func (s *runStats) handledRate() float64 {
	return float64(len(s.done)) / s.last.Sub(s.first).Seconds()
}

func (s *runStats) healthyRate() float64 {
	return float64(s.healthy) / s.lastHealthy.Sub(s.first).Seconds()
}

// steadyRate is the handled rate over the window from the first success of the
// steadyFrom-th fraction of the messages to that of the steadyTo-th: without the
// warm-up, and without the tail where only retries of the last failing messages are
// left.
func (s *runStats) steadyRate() float64 {
	i, j := int(steadyFrom*float64(len(s.doneAt))), int(steadyTo*float64(len(s.doneAt)))-1
	return float64(j-i) / s.doneAt[j].Sub(s.doneAt[i]).Seconds()
}

const steadyFrom, steadyTo = 0.1, 0.9

// gaps returns the mean time between attempts 1 and 2, and 2 and 3, of failing messages.
func (s *runStats) gaps() (g [2]time.Duration) {
	var sum [2]time.Duration
	var cnt [2]int
	for _, ts := range s.attempts {
		for i := 0; i < 2 && i+1 < len(ts); i++ {
			sum[i] += ts[i+1].Sub(ts[i])
			cnt[i]++
		}
	}
	for i := range g {
		if cnt[i] > 0 {
			g[i] = sum[i] / time.Duration(cnt[i])
		}
	}
	return g
}

// policy is the retry schedule both retry variants follow: 100 ms, then 200 ms.
var (
	throughputTiers  = []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond}
	throughputPolicy = amqpretry.Policy{MaxAttempts: 3, Delays: amqpretry.Exponential(100*time.Millisecond, 2, 10*time.Minute), Jitter: -1}
	inprocessPolicy  = wmiddleware.Retry{MaxRetries: 2, InitialInterval: 100 * time.Millisecond, Multiplier: 2, MaxInterval: time.Second}
)

func runThroughput(ctx context.Context, e *env, rep *report) error {
	rep.tp = &throughputDetail{}
	for _, handlers := range e.sz.throughputHandlers {
		t, err := e.throughputSet(ctx, handlers)
		if err != nil {
			return err
		}
		rep.tp.sets = append(rep.tp.sets, *t)
		if handlers == 1 {
			rep.results.HealthyThroughputRatio = ptr(round(t.healthyRatio(), 3))
			rep.results.VsInprocessRetry = ptr(round(t.vsInprocess(), 1))
			for _, x := range t.vsInprocessRounds() {
				rep.results.VsInprocessRetryRounds = append(rep.results.VsInprocessRetryRounds, round(x, 1))
			}
			rep.results.VsInprocessRetryCeiling = ptr(round(t.ceilingVsInprocess(), 1))
		}
	}
	return nil
}

func (e *env) throughputSet(ctx context.Context, handlers int) (*throughputSet, error) {
	t := &throughputSet{handlers: handlers, n: e.sz.throughputN, inprocN: e.sz.inprocessN}
	fmt.Printf("   %d handler(s) on the queue:\n", handlers)
	// No-failure runs before and after the first broker-retry run: their mean is the
	// reference, which evens out drift from other load on the broker.
	base, err := e.routerRun(ctx, noFailures, t.n, handlers, 0)
	if err != nil {
		return nil, err
	}
	t.noFailRates[0] = base.handledRate()
	for round := range e.sz.vsRounds {
		ours, err := e.routerRun(ctx, brokerRetry, t.n, handlers, 0)
		if err != nil {
			return nil, err
		}
		if round == 0 {
			t.healthyRate, t.oursHandledRate, t.oursGaps = ours.healthyRate(), ours.handledRate(), ours.gaps()
			if base, err = e.routerRun(ctx, noFailures, t.n, handlers, 0); err != nil {
				return nil, err
			}
			t.noFailRates[1] = base.handledRate()
			t.noFailRate = (t.noFailRates[0] + t.noFailRates[1]) / 2
			fmt.Printf("     no failures:      %6.0f msg/s (%.0f before, %.0f after; %d messages)\n", t.noFailRate, t.noFailRates[0], t.noFailRates[1], t.n)
			fmt.Printf("     broker retry:     %6.0f msg/s handled, %6.0f msg/s of the never-failing: ratio %.3f (attempt gaps %s, %s)\n",
				t.oursHandledRate, t.healthyRate, t.healthyRatio(), t.oursGaps[0].Round(time.Millisecond), t.oursGaps[1].Round(time.Millisecond))
		}
		inproc, err := e.routerRun(ctx, inprocessRetry, t.inprocN, handlers, 0)
		if err != nil {
			return nil, err
		}
		ceil, err := e.routerRun(ctx, ceilingRetry, t.n, handlers, 0)
		if err != nil {
			return nil, err
		}
		if round == 0 {
			t.inprocHandledRate, t.inprocGaps = inproc.handledRate(), inproc.gaps()
		}
		t.oursSteady = append(t.oursSteady, ours.steadyRate())
		t.inprocSteady = append(t.inprocSteady, inproc.steadyRate())
		t.ceilSteady = append(t.ceilSteady, ceil.steadyRate())
		fmt.Printf("     round %d: steady state (messages %.0f%%-%.0f%% done): broker retry %6.0f msg/s, in-process retry %5.1f msg/s (%d messages): ratio %.1f; whole run %.1f; ceiling %6.0f msg/s: ratio %.1f\n",
			round+1, 100*steadyFrom, 100*steadyTo, last(t.oursSteady), last(t.inprocSteady), t.inprocN,
			last(t.oursSteady)/last(t.inprocSteady), ours.handledRate()/inproc.handledRate(), last(t.ceilSteady), last(t.ceilSteady)/last(t.inprocSteady))
	}
	return t, nil
}

// throughputMessages returns n messages, every tenth marked to fail unless v is
// noFailures.
func throughputMessages(v variant, n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("tp-%s-%05d", v, i), []byte(`{"order":"12345","amount":"42.00"}`))
		if v != noFailures && i%10 == 0 {
			msgs[i].Metadata.Set(failKey, "1")
		}
	}
	return msgs
}

// routerRun publishes n messages to a fresh queue, runs one router handler over it with
// the variant's middleware on the given number of handlers (each its own subscription
// on the queue) until every message has succeeded, and returns the stats.
func (e *env) routerRun(ctx context.Context, v variant, n, handlers int, work time.Duration) (*runStats, error) {
	conn, err := e.dial()
	if err != nil {
		return nil, err
	}
	defer conn.Close() //nolint:errcheck

	runSeq++
	topic := e.name("tp", fmt.Sprintf("%s-h%d-%d", v, handlers, runSeq)) // NewDurableQueueConfig: queue name = topic
	cfg := wamqp.NewDurableQueueConfig(e.uri)
	if err := e.declare(conn, queueTopology(topic)); err != nil {
		return nil, err
	}
	if err := prefill(ctx, conn, topic, throughputMessages(v, n)); err != nil {
		return nil, fmt.Errorf("prefill %s: %w", topic, err)
	}

	logger := watermill.NopLogger{}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		return nil, err
	}
	subCfg := cfg
	switch v {
	case brokerRetry, ceilingRetry:
		rcfg := amqpretry.Config{
			Backend:     delay.TTLTiers(throughputTiers...),
			Prefix:      e.name("tp-delay"),
			Policy:      throughputPolicy,
			PoisonQueue: e.name("tp-poison"),
		}
		if plan, err := rcfg.Plan(topic); err == nil {
			e.reg.topology(plan)
		}
		r, err := wamqp3.New(cfg, rcfg)
		if err != nil {
			return nil, err
		}
		defer r.Close() //nolint:errcheck
		subCfg = r.SubscriberConfig()
		if v == brokerRetry {
			router.AddMiddleware(r.Middleware)
			break
		}
		c, err := e.newCeiling(e.name("tp-delay"), throughputTiers)
		if err != nil {
			return nil, err
		}
		defer c.close()
		router.AddMiddleware(c.middleware)
	case inprocessRetry:
		router.AddMiddleware(inprocessPolicy.Middleware)
	}
	sub, err := wamqp.NewSubscriber(subCfg, logger)
	if err != nil {
		return nil, err
	}
	defer sub.Close() //nolint:errcheck

	st := newRunStats(n, work)
	for i := range handlers {
		router.AddConsumerHandler(fmt.Sprintf("bench-%d", i), topic, sub, st.handle)
	}
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	// 10 msg/s is far below any variant's rate (in-process retry at one handler: about
	// 33); it only bounds a broken run.
	timeout := time.Minute + time.Duration(n)*100*time.Millisecond
	select {
	case <-st.finished:
	case err := <-runErr:
		return nil, fmt.Errorf("router stopped: %w", err)
	case <-ctx.Done():
	case <-time.After(timeout):
	}
	if err := router.Close(); err != nil {
		return nil, err
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if len(st.done) < n {
		return nil, fmt.Errorf("%s: %d of %d messages handled within %s", v, len(st.done), n, timeout)
	}
	return st, nil
}
