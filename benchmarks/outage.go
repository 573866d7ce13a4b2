package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// The outage scenario (issue 41, "an outage is not a poison"; -outage 30s,5m): the
// issue's own traffic. 40 messages a second are published to one work queue, paced,
// for the whole run; MaxAttempts 3, retries 0.5 s then 1 s (ttl-tiers with tiers
// 0.5 s and 1 s; delayed-retry: 0.5 s each); one message in 25 is bad for good (its
// handler returns Permanent before it touches the dependency); one in 5, drawn at
// random (the same draw in every run), fails once and then succeeds. After a warm-up
// the handler's dependency is down for the outage's length: every run of the handler
// fails with a plain error (not marked Unavailable: the outage is found by the
// failure rules). After its return the traffic goes on until every message published
// before the return is settled, and outageTail more. Each length runs twice, with
// outage detection (the default Config.Outage) and without (Outage.Consecutive -1), on
// fresh queues: 4 handlers on the queue (one subscription each), prefetch 10, 1 ms of
// handler work.
//
// Figures, per run: messages poisoned (by the outage, besides the Permanent ones),
// handler runs, retries (Stats.Retries) and probes while down, the broker's CPU while
// down (its beam.smp from /proc: -broker43pid, else `rabbitmqctl eval 'os:getpid().'`
// through -rabbitmqctl), the time from the dependency's return to the end of the
// first 1-second window whose handled count reaches the publish rate, and to the last
// message published before the return settled (handled or poisoned). Lost messages
// (published and confirmed, neither handled nor poisoned at the end) must be 0.

const (
	outageRate     = 40 // messages a second
	outageWarm     = 10 * time.Second
	outageTail     = 10 * time.Second
	outageHandlers = 4
	outagePrefetch = 10
	outageWork     = time.Millisecond
)

var errDependencyDown = errors.New("dial tcp 10.0.0.5:5432: connect: connection refused")

// outageRun is one run's figures (the JSON) and its time series (the plot).
type outageRun struct {
	Outage    string `json:"outage"`
	Detection bool   `json:"detection"`
	Published int    `json:"published"`
	Handled   int    `json:"handled"`
	// PoisonedByOutage: poisoned messages that were not bad (not Permanent);
	// PoisonedPermanent: the bad ones, which must all be poisoned.
	PoisonedByOutage  int `json:"poisoned_by_outage"`
	PoisonedPermanent int `json:"poisoned_permanent"`
	Lost              int `json:"lost"`
	Duplicates        int `json:"duplicates"`
	// While the dependency is down:
	HandlerRunsDown int64    `json:"handler_runs_down"`
	RetriesDown     int64    `json:"retries_down"`
	ProbesDown      int64    `json:"probes_down"`
	BrokerCPUDownS  *float64 `json:"broker_cpu_down_s"`
	ClientCPUDownS  float64  `json:"client_cpu_down_s"`
	// The broker is shared: its CPU per second of the warm-up before the outage and
	// of the outage tell what the rest of the machine did; QueueReductionsDown is the
	// work (Erlang reductions, through rabbitmqctl eval) of this run's own queues
	// while down, which nothing else moves.
	BrokerCPUWarmPerS   *float64 `json:"broker_cpu_warmup_per_s"`
	BrokerCPUDownPerS   *float64 `json:"broker_cpu_down_per_s"`
	QueueReductionsDown *int64   `json:"queue_reductions_down"`
	// Outages begun (Stats.Outages), when the first began after the dependency went
	// down, and when the last ended after it came back.
	Outages          int64    `json:"outages"`
	OutageBeganS     *float64 `json:"outage_began_after_down_s"`
	OutageEndedS     *float64 `json:"outage_ended_after_return_s"`
	FullThroughputS  *float64 `json:"full_throughput_after_return_s"`
	BacklogSettledS  *float64 `json:"backlog_settled_after_return_s"`
	MaxWaitingInProc int64    `json:"max_in_process"`
	MaxReady         int      `json:"max_ready_in_work_queue"`
	MaxParked        int      `json:"max_parked_in_delay_queues"`
	Seconds          float64  `json:"seconds"`

	series outageSeries
	down   [2]float64 // seconds from the start: the dependency down, back
}

// outageSeries: one value per second of the run.
type outageSeries struct {
	handled, poisoned, calls []float64 // per second; poisoned cumulative
	inProc, ready, parked    []float64 // sampled at the end of each second
}

// outageResults is the JSON of -outage.
type outageResults struct {
	Broker      string                           `json:"broker"`
	Backend     string                           `json:"backend"`
	Machine     string                           `json:"machine"`
	Command     string                           `json:"command"`
	Rate        int                              `json:"publish_rate_per_s"`
	Handlers    int                              `json:"handlers"`
	Prefetch    int                              `json:"prefetch"`
	BrokerPID   int                              `json:"broker_pid"`
	Runs        map[string]map[string]*outageRun `json:"runs"` // outage length -> "with"/"without"
	Order       []string                         `json:"order"`
	StartedUTC  string                           `json:"started_utc"`
	FinishedUTC string                           `json:"finished_utc"`
}

// parseOutages parses -outage: durations, comma-separated.
func parseOutages(s string) ([]time.Duration, error) {
	var out []time.Duration
	for _, f := range strings.Split(s, ",") {
		d, err := time.ParseDuration(strings.TrimSpace(f))
		if err != nil || d < 5*time.Second {
			return nil, fmt.Errorf("-outage: %q is not a duration of at least 5s (e.g. -outage 30s,5m)", f)
		}
		out = append(out, d)
	}
	return out, nil
}

// beamPID asks the broker for its VM's OS process through rabbitmqctl eval; 0 when it
// cannot.
func beamPID(ctl []string) int {
	if len(ctl) == 0 {
		return 0
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, ctl[0], append(ctl[1:], "eval", "os:getpid().")...).Output()
	if err != nil {
		return 0
	}
	m := regexp.MustCompile(`\d+`).FindString(string(out))
	pid, _ := strconv.Atoi(m)
	if checkBrokerPID(pid) != nil {
		return 0
	}
	return pid
}

// runOutages runs every length with and without detection, alternately.
func runOutages(ctx context.Context, e *env, lengths []time.Duration, backendName string, ctl []string) (*outageResults, error) {
	res := &outageResults{Broker: e.brokerVersion(), Backend: backendName, Rate: outageRate, Handlers: outageHandlers, Prefetch: outagePrefetch,
		BrokerPID: brokerPID, Runs: map[string]map[string]*outageRun{}, StartedUTC: time.Now().UTC().Format(time.RFC3339)}
	var errs []error
	for _, d := range lengths {
		key := d.String()
		res.Runs[key] = map[string]*outageRun{}
		res.Order = append(res.Order, key)
		for _, detect := range []bool{true, false} {
			if ctx.Err() != nil {
				return res, errors.Join(append(errs, ctx.Err())...)
			}
			name := map[bool]string{true: "with", false: "without"}[detect]
			fmt.Printf("== outage %s, %s detection\n", d, name)
			r, err := e.outageRun(ctx, d, detect, backendName, ctl)
			if cerr := e.cleanup(e.reg.takeUnsure()); cerr != nil {
				err = errors.Join(err, fmt.Errorf("cleanup: %w", cerr))
			}
			if r != nil {
				res.Runs[key][name] = r
				fmt.Print(indent(outageLine(r)))
			}
			if err != nil {
				fmt.Printf("   FAILED: %v\n", err)
				errs = append(errs, fmt.Errorf("outage %s %s: %w", d, name, err))
			}
		}
	}
	res.FinishedUTC = time.Now().UTC().Format(time.RFC3339)
	return res, errors.Join(errs...)
}

func indent(s string) string {
	return "   " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n   ") + "\n"
}

func outageLine(r *outageRun) string {
	return fmt.Sprintf("published %d, handled %d, poisoned %d by the outage + %d Permanent, lost %d, duplicates %d\n"+
		"while down: handler runs %d, retries %d, probes %d, broker CPU %s s (%s/s; warm-up %s/s), our queues' reductions %sM, client CPU %.1f s\n"+
		"outages %d (began %s s after the dependency went down, ended %s s after it came back); full throughput %s s and backlog settled %s s after the return; max in process %d, ready %d, parked %d\n",
		r.Published, r.Handled, r.PoisonedByOutage, r.PoisonedPermanent, r.Lost, r.Duplicates,
		r.HandlerRunsDown, r.RetriesDown, r.ProbesDown, fmtOpt(r.BrokerCPUDownS), fmt2(r.BrokerCPUDownPerS), fmt2(r.BrokerCPUWarmPerS), fmtMillions(r.QueueReductionsDown), r.ClientCPUDownS,
		r.Outages, fmtOpt(r.OutageBeganS), fmtOpt(r.OutageEndedS), fmtOpt(r.FullThroughputS), fmtOpt(r.BacklogSettledS),
		r.MaxWaitingInProc, r.MaxReady, r.MaxParked)
}

func fmt2(x *float64) string {
	if x == nil {
		return "-"
	}
	return strconv.FormatFloat(*x, 'f', 2, 64)
}

func fmtMillions(x *int64) string {
	if x == nil {
		return "-"
	}
	return strconv.FormatFloat(float64(*x)/1e6, 'f', 1, 64)
}

func fmtOpt(x *float64) string {
	if x == nil {
		return "-"
	}
	return strconv.FormatFloat(*x, 'f', 1, 64)
}

// outageState is what the handler, the observer and the sampler share during a run.
type outageState struct {
	t0       time.Time
	down     atomic.Bool
	runsDown atomic.Int64
	inProc   atomic.Int64

	mu        sync.Mutex
	handled   []float64 // per second
	calls     []float64
	poisoned  []float64 // per second (made cumulative at the end)
	seen      map[int]int
	handledAt map[int]time.Time // first success
	flakyDone map[int]bool
	began     []time.Time // EventOutageStarted
	ended     []time.Time
}

func (s *outageState) bin(series *[]float64, at time.Time) {
	i := int(at.Sub(s.t0) / time.Second)
	for len(*series) <= i {
		*series = append(*series, 0)
	}
	(*series)[i]++
}

// bad and flaky are the message's fate: one in 25 bad for good; one in 5, drawn at
// random, fails once.
func outageFates(n int) (bad, flaky []bool) {
	rng := rand.New(rand.NewPCG(41, 41))
	bad, flaky = make([]bool, n), make([]bool, n)
	for i := range n {
		bad[i] = i%25 == 0
		flaky[i] = rng.Float64() < 0.2
	}
	return bad, flaky
}

func (e *env) outageRun(ctx context.Context, length time.Duration, detect bool, backendName string, ctl []string) (_ *outageRun, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	maxAfter := length + 3*time.Minute // after the return: the backlog's bound
	maxN := int((outageWarm+length+maxAfter+outageTail)/time.Second)*outageRate + outageRate
	bad, flaky := outageFates(maxN)

	runSeq++
	topic := e.name("outage", fmt.Sprintf("%s-%v-%d", length, detect, runSeq))
	prefix := e.name("outage-delay", strconv.Itoa(runSeq))
	amqpCfg := wamqp.NewDurableQueueConfig(e.uri)
	amqpCfg.Consume.Qos.PrefetchCount = outagePrefetch
	b, err := delay.Parse(backendName)
	if err != nil {
		return nil, err
	}
	rcfg := amqpretry.Config{
		Backend:     b,
		Prefix:      prefix,
		PoisonQueue: prefix + ".poison",
	}
	if !detect {
		rcfg.Outage.Consecutive = -1 // detection off
	}
	switch b.Name() {
	case delay.DelayedRetry(0).Name():
		rcfg.Policy = amqpretry.Policy{MaxAttempts: 3}
		rcfg.Backend = delay.DelayedRetry(500 * time.Millisecond)
		amqpCfg.Queue.Arguments = backend.WorkQueueArgs(500 * time.Millisecond)
	case delay.TTLTiers().Name():
		rcfg.Backend = delay.TTLTiers(500*time.Millisecond, time.Second)
		rcfg.Policy = amqpretry.Policy{MaxAttempts: 3, Delays: amqpretry.Exponential(500*time.Millisecond, 2, time.Second), Jitter: -1}
	default:
		rcfg.Policy = amqpretry.Policy{MaxAttempts: 3, Delays: amqpretry.Exponential(500*time.Millisecond, 2, time.Second), Jitter: -1}
	}
	st := &outageState{seen: map[int]int{}, handledAt: map[int]time.Time{}, flakyDone: map[int]bool{}}
	rcfg.Observe = func(ev amqpretry.Event) {
		now := time.Now()
		st.mu.Lock()
		defer st.mu.Unlock()
		switch ev.Kind {
		case amqpretry.EventPoisoned:
			st.bin(&st.poisoned, now)
		case amqpretry.EventOutageStarted:
			st.began = append(st.began, now)
		case amqpretry.EventOutageEnded:
			st.ended = append(st.ended, now)
		}
	}
	e.reg.queue(topic, rcfg.PoisonQueue)
	plan, err := rcfg.Plan(topic)
	if err != nil {
		return nil, err
	}
	e.reg.topology(plan)
	var parkQueues []string
	for _, q := range plan.Queues {
		if q.Name != topic && q.Name != rcfg.PoisonQueue {
			parkQueues = append(parkQueues, q.Name)
		}
	}
	r, err := wamqp3.New(amqpCfg, rcfg)
	if err != nil {
		return nil, err
	}
	defer r.Close() //nolint:errcheck // after the router
	subCfg := r.SubscriberConfig()

	conn, err := e.dial()
	if err != nil {
		return nil, err
	}
	defer conn.Close() //nolint:errcheck
	if err := e.declare(conn, topology.Topology{Queues: []topology.Queue{{Name: topic, Args: subCfg.Queue.Arguments}}}); err != nil {
		return nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	// Outermost: counts the messages inside the middleware (in the handler, or
	// waiting for an outage to end).
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			st.inProc.Add(1)
			defer st.inProc.Add(-1)
			return h(m)
		}
	})
	router.AddMiddleware(r.Middleware)
	sub, err := wamqp.NewSubscriber(subCfg, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	defer sub.Close() //nolint:errcheck
	handle := func(m *message.Message) error {
		i, perr := strconv.Atoi(strings.TrimPrefix(m.UUID, "o-"))
		if perr != nil {
			return amqpretry.Permanent(fmt.Errorf("message id %q: %w", m.UUID, perr))
		}
		time.Sleep(outageWork)
		now := time.Now()
		st.mu.Lock()
		defer st.mu.Unlock()
		st.bin(&st.calls, now)
		down := st.down.Load()
		if down {
			st.runsDown.Add(1)
		}
		if bad[i] { // checked before the dependency is used
			return amqpretry.Permanent(errors.New("malformed booking"))
		}
		if down {
			return errDependencyDown
		}
		if flaky[i] && !st.flakyDone[i] {
			st.flakyDone[i] = true
			return errors.New("deadlock detected; try again")
		}
		st.seen[i]++
		if st.seen[i] == 1 {
			st.handledAt[i] = now
			st.bin(&st.handled, now)
		}
		return nil
	}
	for h := range outageHandlers {
		router.AddConsumerHandler(fmt.Sprintf("outage-%d", h), topic, sub, func(m *message.Message) error { return handle(m) })
	}
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-runErr:
		return nil, fmt.Errorf("router: %w", err)
	case <-time.After(time.Minute):
		return nil, errors.New("router not running after 1 min")
	}
	defer func() {
		if cerr := router.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	// The poison queue (declared by now), read as it fills: which messages were
	// poisoned.
	poison, err := e.consume(rcfg.PoisonQueue, maxN)
	if err != nil {
		return nil, err
	}
	defer poison.close()

	// The publisher: outageRate a second, paced, confirmed.
	pubConn, err := e.dial()
	if err != nil {
		return nil, err
	}
	defer pubConn.Close() //nolint:errcheck
	pch, err := pubConn.Channel()
	if err == nil {
		err = pch.Confirm(false)
	}
	if err != nil {
		return nil, err
	}
	// Sampler: the gauges, once a second.
	sampleConn, err := e.dial()
	if err != nil {
		return nil, err
	}
	defer sampleConn.Close() //nolint:errcheck

	out := &outageRun{Outage: length.String(), Detection: detect}
	st.t0 = time.Now()
	out.down = [2]float64{outageWarm.Seconds(), (outageWarm + length).Seconds()}
	var (
		published   int
		confirms    []*amqp.DeferredConfirmation
		downAt      = st.t0.Add(outageWarm)
		backAt      = downAt.Add(length)
		cpuStart    = cpuNow()
		cpuDown     cpuUse
		redDown     = make(chan int64, 1)
		redBack     = make(chan int64, 1)
		statsDown   middleware.Stats
		backPub     = -1 // messages published before the return
		settledAt   time.Time
		settledOnce bool
		stopAt      time.Time
		pace        = time.NewTicker(time.Second / outageRate)
		sample      = time.NewTicker(time.Second)
	)
	defer pace.Stop()
	defer sample.Stop()
	poisonedIDs := map[int]string{}
	drainPoison := func() error {
		for {
			select {
			case a := <-poison.arrivals:
				i, perr := strconv.Atoi(strings.TrimPrefix(a.msg.UUID, "o-"))
				if perr != nil {
					return fmt.Errorf("poison queue: message %q is not this run's", a.msg.UUID)
				}
				poisonedIDs[i] = string(middleware.ReadEnvelope(a.msg.Metadata).Reason)
			case err := <-poison.errs:
				return err
			default:
				return nil
			}
		}
	}
	settledOf := func(n int) (bool, time.Time) { // handled, or poisoned
		st.mu.Lock()
		defer st.mu.Unlock()
		var last time.Time
		for i := range n {
			at, ok := st.handledAt[i]
			if !ok {
				if _, p := poisonedIDs[i]; !p {
					return false, time.Time{}
				}
				continue
			}
			if at.After(last) {
				last = at
			}
		}
		return true, last
	}
	phase := 0 // 0 warm, 1 down, 2 back, 3 tail, 4 publishing stopped
	deadline := backAt.Add(maxAfter)
	for phase < 4 {
		select {
		case <-ctx.Done():
			return out, ctx.Err()
		case err := <-runErr:
			return out, fmt.Errorf("router stopped: %w", err)
		case now := <-pace.C:
			switch {
			case phase == 0 && !now.Before(downAt):
				phase = 1
				cpuDown = cpuNow()
				statsDown = r.Stats()
				go func() { redDown <- queueReductions(ctl, topic, prefix+".") }()
				st.down.Store(true)
			case phase == 1 && !now.Before(backAt):
				phase = 2
				st.down.Store(false)
				used := cpuNow().since(cpuDown)
				go func() { redBack <- queueReductions(ctl, topic, prefix+".") }()
				if brokerPID > 0 {
					out.BrokerCPUWarmPerS = ptr(round(cpuDown.since(cpuStart).broker.Seconds()/outageWarm.Seconds(), 3))
					out.BrokerCPUDownPerS = ptr(round(used.broker.Seconds()/length.Seconds(), 3))
				}
				s := r.Stats()
				out.HandlerRunsDown = st.runsDown.Load()
				out.RetriesDown = s.Retries - statsDown.Retries
				out.ProbesDown = s.Probes - statsDown.Probes
				out.ClientCPUDownS = round(used.client.Seconds(), 2)
				if brokerPID > 0 {
					out.BrokerCPUDownS = ptr(round(used.broker.Seconds(), 2))
				}
				backPub = published
			case phase == 3 && !now.Before(stopAt):
				phase = 4
				continue
			}
			if now.After(deadline) {
				return out, fmt.Errorf("the messages published before the return not settled %s after it", maxAfter)
			}
			msg := message.NewMessage(fmt.Sprintf("o-%06d", published), []byte(`{"booking":"12345","seats":2}`))
			p, merr := wamqp.DefaultMarshaler{}.Marshal(msg)
			if merr != nil {
				return out, merr
			}
			dc, perr := pch.PublishWithDeferredConfirmWithContext(ctx, "", topic, false, false, p)
			if perr != nil {
				return out, fmt.Errorf("publish: %w", perr)
			}
			confirms = append(confirms, dc)
			published++
		case now := <-sample.C:
			if err := drainPoison(); err != nil {
				return out, err
			}
			st.mu.Lock()
			i := int(now.Sub(st.t0) / time.Second)
			st.mu.Unlock()
			ready, _ := queueDepth(sampleConn, topic)
			parked := 0
			for _, q := range parkQueues {
				n, _ := queueDepth(sampleConn, q)
				parked += n
			}
			for len(out.series.inProc) < i {
				out.series.inProc = append(out.series.inProc, float64(st.inProc.Load()))
				out.series.ready = append(out.series.ready, float64(ready))
				out.series.parked = append(out.series.parked, float64(parked))
			}
			out.MaxWaitingInProc = max(out.MaxWaitingInProc, st.inProc.Load())
			out.MaxReady, out.MaxParked = max(out.MaxReady, ready), max(out.MaxParked, parked)
			if phase == 2 && !settledOnce {
				if ok, at := settledOf(backPub); ok {
					settledOnce, settledAt = true, at
					phase, stopAt = 3, now.Add(outageTail)
				}
			}
		}
	}
	// Every publish confirmed; then every message settled.
	for _, dc := range confirms {
		ok, cerr := dc.WaitContext(ctx)
		if cerr != nil {
			return out, cerr
		}
		if !ok {
			return out, fmt.Errorf("publish to %s nacked", topic)
		}
	}
	out.Published = published
	end := time.Now().Add(2 * time.Minute)
	for {
		if err := drainPoison(); err != nil {
			return out, err
		}
		if ok, _ := settledOf(published); ok {
			break
		}
		if time.Now().After(end) {
			break // the rest is lost: counted below
		}
		select {
		case <-ctx.Done():
			return out, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	out.Seconds = round(time.Since(st.t0).Seconds(), 1)
	if a, b := <-redDown, <-redBack; a >= 0 && b >= 0 {
		out.QueueReductionsDown = &[]int64{b - a}[0]
	}
	s := r.Stats()
	out.Outages = s.Outages

	st.mu.Lock()
	defer st.mu.Unlock()
	for i := range published {
		_, ok := st.handledAt[i]
		reason, p := poisonedIDs[i]
		switch {
		case ok && p:
			out.Duplicates++ // handled and poisoned: not expected either
		case ok:
			out.Handled++
		case p && bad[i] && reason == string(amqpretry.ReasonPermanent):
			out.PoisonedPermanent++
		case p:
			out.PoisonedByOutage++
		default:
			out.Lost++
		}
		if st.seen[i] > 1 {
			out.Duplicates++
		}
	}
	if len(st.began) > 0 {
		out.OutageBeganS = ptr(round(st.began[0].Sub(downAt).Seconds(), 2))
	}
	if len(st.ended) > 0 {
		out.OutageEndedS = ptr(round(st.ended[len(st.ended)-1].Sub(backAt).Seconds(), 2))
	}
	if settledOnce {
		out.BacklogSettledS = ptr(round(max(settledAt.Sub(backAt), 0).Seconds(), 2))
	}
	// The first whole second after the return whose handled count reaches the
	// publish rate; its end, from the return.
	back := int(outageWarm+length) / int(time.Second)
	for i := back; i < len(st.handled); i++ {
		if st.handled[i] >= outageRate {
			out.FullThroughputS = ptr(float64(i + 1 - back))
			break
		}
	}
	out.series.handled = append([]float64(nil), st.handled...)
	out.series.calls = append([]float64(nil), st.calls...)
	cum := 0.0
	for i := range len(st.handled) {
		if i < len(st.poisoned) {
			cum += st.poisoned[i]
		}
		out.series.poisoned = append(out.series.poisoned, cum)
	}
	if out.Lost > 0 {
		return out, fmt.Errorf("%d of %d messages lost (neither handled nor poisoned)", out.Lost, published)
	}
	return out, nil
}

// outageTable is the results table of -outage.
func outageTable(res *outageResults) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Outage of the handler's dependency, RabbitMQ %s, %s; %d msg/s, MaxAttempts 3, %d handlers, prefetch %d, %d CPUs\n\n",
		res.Broker, res.Backend, res.Rate, res.Handlers, res.Prefetch, numCPU())
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight|tabwriter.Debug)
	fmt.Fprintln(tw, "outage\tdetection\tpublished\tpoisoned by the outage\tpoisoned, Permanent\tlost\thandler runs while down\tretries while down\tprobes\tbroker CPU while down, s (per s; warm-up per s)\tour queues' reductions while down, M\toutage ended after return, s\tfull throughput after return, s\tbacklog settled after return, s\tmax waiting in process\tmax ready in work queue\tmax parked\t")
	for _, k := range res.Order {
		for _, v := range []string{"with", "without"} {
			r := res.Runs[k][v]
			if r == nil {
				continue
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s (%s; %s)\t%s\t%s\t%s\t%s\t%d\t%d\t%d\t\n", k, v, r.Published, r.PoisonedByOutage, r.PoisonedPermanent, r.Lost,
				r.HandlerRunsDown, r.RetriesDown, r.ProbesDown, fmtOpt(r.BrokerCPUDownS), fmt2(r.BrokerCPUDownPerS), fmt2(r.BrokerCPUWarmPerS), fmtMillions(r.QueueReductionsDown), fmtOpt(r.OutageEndedS), fmtOpt(r.FullThroughputS), fmtOpt(r.BacklogSettledS),
				r.MaxWaitingInProc, r.MaxReady, r.MaxParked)
		}
	}
	_ = tw.Flush()
	return b.String()
}

// queueReductions sums the reductions (the Erlang VM's unit of work) of the processes
// of the broker's queues whose names start with one of prefixes, through rabbitmqctl
// eval; -1 when it cannot.
func queueReductions(ctl []string, prefixes ...string) int64 {
	if len(ctl) == 0 {
		return -1
	}
	var pre []string
	for _, p := range prefixes {
		pre = append(pre, fmt.Sprintf("<<%q>>", p))
	}
	expr := `Pre = [` + strings.Join(pre, ",") + `],
Mine = fun(N) -> lists:any(fun(P) -> binary:longest_common_prefix([N, P]) == byte_size(P) end, Pre) end,
Pid = fun(Q) -> case amqqueue:get_pid(Q) of {R, _} when is_atom(R) -> whereis(R); P -> P end end,
lists:sum([R || Q <- rabbit_amqqueue:list(), {resource, _, queue, N} <- [amqqueue:get_name(Q)], Mine(N),
  P <- [Pid(Q)], is_pid(P), {reductions, R} <- [erlang:process_info(P, reductions)]]).`
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, ctl[0], append(ctl[1:], "eval", expr)...).Output()
	if err != nil {
		return -1
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
	if err != nil {
		return -1
	}
	return n
}

// loadAvg is /proc/loadavg's first three fields, or "unknown".
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) >= 3 {
		return strings.Join(f[:3], " ")
	}
	return "unknown"
}

// The false-trip scenario (issue 49; -false-trips N): how often the outage rules take
// a queue whose messages fail for reasons of their own for one whose dependency is
// down, what such a false trip costs, and that a real outage is still caught and
// poisons nothing. Each failure pattern runs in two shapes of traffic, N rounds each,
// on fresh queues, with the default Config.Outage; MaxAttempts 3, retries 0.5 s then
// 1 s (ttl-tiers), a plain error for every failure (nothing marked Unavailable).
//
// Patterns: fail once (every message fails its first attempt), fail twice (its first
// two), a flaky fifth (every run fails with probability 0.2, retries included), a
// third that fail twice (issue 49's warming dependency: every third message fails its
// first two attempts), Unavailable by mistake (one message in 50 fails every attempt
// with an error its handler marks Unavailable: each run of it begins an outage, a
// false trip every time), and a real outage (every run fails while the dependency is
// down). Shapes: paced, issue 41's traffic (40 messages a second for 20 s, 4 handlers
// on the queue, prefetch 10; the outage from 5 s to 15 s); burst, issue 49's CQRS
// handler (100 messages published at once, one handler on its queue, prefetch 10; the
// outage from the start for 5 s).
//
// Figures per run: outages begun, the probe that ended each (1: the first), the time
// the queue spent in outage, messages that ran more than once on one attempt (more
// often than their attempts), the most runs of one message, poisoned messages,
// messages still unsettled tripSettle after the last publish (a stalled queue: they
// are counted in the queues once the router has closed, and any not found there are
// lost); for the real outage, when it was caught.

const (
	tripRate       = 40
	tripPaced      = 20 * time.Second
	tripBurst      = 100
	tripPacedDown  = 5 * time.Second
	tripPacedBack  = 15 * time.Second
	tripBurstBack  = 5 * time.Second
	tripSettle     = time.Minute // after the last publish: a queue still stalled then is reported so
	tripMaxAttempt = 3
)

// tripPatterns are the failure patterns, in the table's order.
var tripPatterns = []string{"fail once", "fail twice", "flaky fifth", "a third fail twice", "Unavailable by mistake", "real outage"}

// falseTripRun is one run's figures.
type falseTripRun struct {
	Shape     string `json:"shape"`
	Pattern   string `json:"pattern"`
	Round     int    `json:"round"`
	Published int    `json:"published"`
	Succeeded int    `json:"succeeded"`
	Poisoned  int    `json:"poisoned"`
	// Unsettled: neither handled nor poisoned tripSettle after the last publish;
	// Lost: of those, not in the work queue or the delay queues after the close.
	Unsettled int `json:"unsettled"`
	Lost      int `json:"lost"`
	// Outages begun; for each ended one, the probe that ended it (1: the first); how
	// long each lasted (the last one, if not over, until the end of the run).
	Outages      int       `json:"outages"`
	Probes       int       `json:"probes"`
	EndedAtProbe []int     `json:"ended_at_probe"`
	OutageS      []float64 `json:"outage_s"`
	// Messages that ran more than once on one attempt; the most runs of one message.
	Repeated int `json:"repeated_attempts"`
	MostRuns int `json:"most_runs"`
	// The real outage: when the first outage began, after the dependency went down.
	CaughtAfterS *float64 `json:"caught_after_s,omitempty"`
	Seconds      float64  `json:"seconds"`
}

// falseTripResults is the JSON of -false-trips.
type falseTripResults struct {
	Broker      string          `json:"broker"`
	Rules       string          `json:"rules"`
	Machine     string          `json:"machine"`
	Command     string          `json:"command"`
	Rounds      int             `json:"rounds"`
	Runs        []*falseTripRun `json:"runs"`
	StartedUTC  string          `json:"started_utc"`
	FinishedUTC string          `json:"finished_utc"`
}

// runFalseTrips runs every shape and pattern, rounds times, on fresh queues.
func runFalseTrips(ctx context.Context, e *env, rounds int, rules string) (*falseTripResults, error) {
	res := &falseTripResults{Broker: e.brokerVersion(), Rules: rules, Rounds: rounds, StartedUTC: time.Now().UTC().Format(time.RFC3339)}
	var errs []error
	for round := 1; round <= rounds; round++ {
		for _, shape := range []string{"paced", "burst"} {
			for _, p := range tripPatterns {
				if ctx.Err() != nil {
					return res, errors.Join(append(errs, ctx.Err())...)
				}
				fmt.Printf("== round %d, %s, %s\n", round, shape, p)
				r, err := e.falseTripRun(ctx, shape, p, round)
				if cerr := e.cleanup(e.reg.takeUnsure()); cerr != nil {
					err = errors.Join(err, fmt.Errorf("cleanup: %w", cerr))
				}
				if r != nil {
					res.Runs = append(res.Runs, r)
					fmt.Printf("   outages %d (ended at probe %v, lasting %v s), probes %d; repeated attempts %d, most runs %d; succeeded %d, poisoned %d, unsettled %d, lost %d of %d (%.1f s)\n",
						r.Outages, r.EndedAtProbe, r.OutageS, r.Probes, r.Repeated, r.MostRuns, r.Succeeded, r.Poisoned, r.Unsettled, r.Lost, r.Published, r.Seconds)
				}
				if err != nil {
					fmt.Printf("   FAILED: %v\n", err)
					errs = append(errs, fmt.Errorf("round %d, %s, %s: %w", round, shape, p, err))
				}
			}
		}
	}
	res.FinishedUTC = time.Now().UTC().Format(time.RFC3339)
	return res, errors.Join(errs...)
}

// tripState is what the handler and the observer share during a run.
type tripState struct {
	mu        sync.Mutex
	t0        time.Time
	rng       *rand.Rand
	runs      map[int][]int // attempts each message ran on
	succeeded map[int]bool
	began     []time.Time
	probes    []error // of the current outage
	endedAt   []int
	lasted    []float64
	allProbes int
}

func (e *env) falseTripRun(ctx context.Context, shape, pattern string, rnd int) (_ *falseTripRun, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	runSeq++
	topic := e.name("falsetrip", fmt.Sprintf("%s-%d", strings.ReplaceAll(shape+"-"+pattern, " ", "-"), runSeq))
	prefix := e.name("falsetrip-delay", strconv.Itoa(runSeq))
	handlers, n, downFrom, downTo := outageHandlers, int(tripPaced/time.Second)*tripRate, tripPacedDown, tripPacedBack
	if shape == "burst" {
		handlers, n, downFrom, downTo = 1, tripBurst, 0, tripBurstBack
	}
	st := &tripState{rng: rand.New(rand.NewPCG(49, uint64(rnd))), runs: map[int][]int{}, succeeded: map[int]bool{}}
	rcfg := amqpretry.Config{
		Backend:     delay.TTLTiers(500*time.Millisecond, time.Second),
		Policy:      amqpretry.Policy{MaxAttempts: tripMaxAttempt, Delays: amqpretry.Exponential(500*time.Millisecond, 2, time.Second), Jitter: -1},
		Prefix:      prefix,
		PoisonQueue: prefix + ".poison",
		Observe: func(ev amqpretry.Event) {
			now := time.Now()
			st.mu.Lock()
			defer st.mu.Unlock()
			switch ev.Kind {
			case amqpretry.EventOutageStarted:
				st.began = append(st.began, now)
				st.probes = nil
			case amqpretry.EventProbe:
				st.probes = append(st.probes, ev.Err)
				st.allProbes++
			case amqpretry.EventOutageEnded:
				st.endedAt = append(st.endedAt, len(st.probes))
				st.lasted = append(st.lasted, round(ev.Duration.Seconds(), 1))
			}
		},
	}
	e.reg.queue(topic, rcfg.PoisonQueue)
	plan, err := rcfg.Plan(topic)
	if err != nil {
		return nil, err
	}
	e.reg.topology(plan)
	amqpCfg := wamqp.NewDurableQueueConfig(e.uri)
	amqpCfg.Consume.Qos.PrefetchCount = outagePrefetch
	r, err := wamqp3.New(amqpCfg, rcfg)
	if err != nil {
		return nil, err
	}
	defer r.Close() //nolint:errcheck // after the router
	subCfg := r.SubscriberConfig()
	conn, err := e.dial()
	if err != nil {
		return nil, err
	}
	defer conn.Close() //nolint:errcheck
	if err := e.declare(conn, topology.Topology{Queues: []topology.Queue{{Name: topic, Args: subCfg.Queue.Arguments}}}); err != nil {
		return nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	router.AddMiddleware(r.Middleware)
	sub, err := wamqp.NewSubscriber(subCfg, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	defer sub.Close() //nolint:errcheck
	errOwn := errors.New("the invoice service is warming up")
	handle := func(m *message.Message) error {
		i, perr := strconv.Atoi(strings.TrimPrefix(m.UUID, "f-"))
		if perr != nil {
			return amqpretry.Permanent(fmt.Errorf("message id %q: %w", m.UUID, perr))
		}
		time.Sleep(outageWork)
		attempt := amqpretry.Attempt(m)
		st.mu.Lock()
		defer st.mu.Unlock()
		st.runs[i] = append(st.runs[i], attempt)
		at := time.Since(st.t0)
		var fail bool
		switch pattern {
		case "fail once":
			fail = attempt == 1
		case "fail twice":
			fail = attempt <= 2
		case "flaky fifth":
			fail = st.rng.Float64() < 0.2
		case "a third fail twice":
			fail = i%3 == 0 && attempt <= 2
		case "Unavailable by mistake":
			if i%50 == 7 {
				return amqpretry.Unavailable(errors.New("customer 42 not found"))
			}
		case "real outage":
			if at >= downFrom && at < downTo {
				return errDependencyDown
			}
		}
		if fail {
			return errOwn
		}
		st.succeeded[i] = true
		return nil
	}
	for h := range handlers {
		router.AddConsumerHandler(fmt.Sprintf("falsetrip-%d", h), topic, sub, func(m *message.Message) error { return handle(m) })
	}
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-runErr:
		return nil, fmt.Errorf("router: %w", err)
	case <-time.After(time.Minute):
		return nil, errors.New("router not running after 1 min")
	}
	defer func() {
		if cerr := router.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	poison, err := e.consume(rcfg.PoisonQueue, n)
	if err != nil {
		return nil, err
	}
	defer poison.close()
	pubConn, err := e.dial()
	if err != nil {
		return nil, err
	}
	defer pubConn.Close() //nolint:errcheck
	pch, err := pubConn.Channel()
	if err == nil {
		err = pch.Confirm(false)
	}
	if err != nil {
		return nil, err
	}
	out := &falseTripRun{Shape: shape, Pattern: pattern, Round: rnd}
	st.mu.Lock()
	st.t0 = time.Now()
	st.mu.Unlock()
	var confirms []*amqp.DeferredConfirmation
	publish := func(i int) error {
		p, merr := wamqp.DefaultMarshaler{}.Marshal(message.NewMessage(fmt.Sprintf("f-%06d", i), []byte(`{"booking":"12345"}`)))
		if merr != nil {
			return merr
		}
		dc, perr := pch.PublishWithDeferredConfirmWithContext(ctx, "", topic, false, false, p)
		if perr != nil {
			return fmt.Errorf("publish: %w", perr)
		}
		confirms = append(confirms, dc)
		return nil
	}
	if shape == "burst" {
		for i := range n {
			if err := publish(i); err != nil {
				return out, err
			}
		}
	} else {
		pace := time.NewTicker(time.Second / tripRate)
		for i := 0; i < n; i++ {
			select {
			case <-ctx.Done():
				pace.Stop()
				return out, ctx.Err()
			case err := <-runErr:
				pace.Stop()
				return out, fmt.Errorf("router stopped: %w", err)
			case <-pace.C:
			}
			if err := publish(i); err != nil {
				pace.Stop()
				return out, err
			}
		}
		pace.Stop()
	}
	for _, dc := range confirms {
		ok, cerr := dc.WaitContext(ctx)
		if cerr != nil {
			return out, cerr
		}
		if !ok {
			return out, fmt.Errorf("publish to %s nacked", topic)
		}
	}
	out.Published = n
	poisoned := map[int]bool{}
	settled := func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		for i := range n {
			if !st.succeeded[i] && !poisoned[i] {
				return false
			}
		}
		return true
	}
	for end := time.Now().Add(tripSettle); !settled() && time.Now().Before(end); {
		select {
		case <-ctx.Done():
			return out, ctx.Err()
		case a := <-poison.arrivals:
			i, perr := strconv.Atoi(strings.TrimPrefix(a.msg.UUID, "f-"))
			if perr != nil {
				return out, fmt.Errorf("poison queue: message %q is not this run's", a.msg.UUID)
			}
			poisoned[i] = true
		case err := <-poison.errs:
			return out, err
		case <-time.After(100 * time.Millisecond):
		}
	}
	// A stalled queue's messages go back to the broker when the router closes: count
	// them there.
	var left int
	st.mu.Lock()
	if len(st.began) > len(st.endedAt) { // an outage not over: its time so far
		st.lasted = append(st.lasted, round(time.Since(st.began[len(st.began)-1]).Seconds(), 1))
	}
	st.mu.Unlock()
	unsettled := func() int {
		st.mu.Lock()
		defer st.mu.Unlock()
		k := 0
		for i := range n {
			if !st.succeeded[i] && !poisoned[i] {
				k++
			}
		}
		return k
	}
	if k := unsettled(); k > 0 {
		// The subscriber's close nacks what it holds: ready again, the broker
		// counts it (a retry still in a delay queue is counted there).
		for _, c := range []interface{ Close() error }{router, sub, r} {
			if cerr := c.Close(); cerr != nil {
				return out, cerr
			}
		}
		for end := time.Now().Add(10 * time.Second); left < k && time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
			left = 0
			for _, q := range append(plan.Queues, topology.Queue{Name: topic}) {
				if q.Name == rcfg.PoisonQueue || (q.Name == topic && q.Role != "") {
					continue // the work queue once
				}
				d, qerr := queueDepth(conn, q.Name)
				if qerr != nil {
					return out, qerr
				}
				left += d
			}
		}
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	out.Seconds = round(time.Since(st.t0).Seconds(), 1)
	for i := range n {
		switch {
		case st.succeeded[i]:
			out.Succeeded++
		case poisoned[i]:
			out.Poisoned++
		default:
			out.Unsettled++
		}
		seen := map[int]bool{}
		for _, a := range st.runs[i] {
			if seen[a] {
				out.Repeated++
				break
			}
			seen[a] = true
		}
		out.MostRuns = max(out.MostRuns, len(st.runs[i]))
	}
	out.Outages, out.Probes = len(st.began), st.allProbes
	out.EndedAtProbe, out.OutageS = append([]int{}, st.endedAt...), append([]float64{}, st.lasted...)
	if pattern == "real outage" && len(st.began) > 0 {
		out.CaughtAfterS = ptr(round(st.began[0].Sub(st.t0.Add(downFrom)).Seconds(), 2))
	}
	out.Lost = max(out.Unsettled-left, 0)
	if out.Lost > 0 {
		return out, fmt.Errorf("%d of %d messages lost: neither handled, poisoned, nor in the queues", out.Lost, n)
	}
	return out, nil
}

// falseTripTable is the results table of -false-trips: per shape and pattern, the
// rounds summed.
func falseTripTable(res *falseTripResults) string {
	var b strings.Builder
	fmt.Fprintf(&b, "False trips of the outage rules (%s), RabbitMQ %s, ttl-tiers; MaxAttempts %d, retries 0.5 s then 1 s; %d rounds, %d CPUs\n\n",
		res.Rules, res.Broker, tripMaxAttempt, res.Rounds, numCPU())
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight|tabwriter.Debug)
	fmt.Fprintf(tw, "shape\tpattern\tmessages\toutages begun\tended at probe (0: by a run under way): outages\tin outage, s\tprobes\tmessages run twice on an attempt\tmost runs of a message\tpoisoned\tunsettled %s after the last publish\tlost\treal outage caught after, s\t\n", tripSettle)
	for _, shape := range []string{"paced", "burst"} {
		for _, p := range tripPatterns {
			var msgs, outages, probes, repeated, most, poisoned, unsettled, lost, notOver int
			endedAt := map[int]int{} // probe: outages it ended
			var inOutage float64
			var caught []string
			found := false
			for _, r := range res.Runs {
				if r.Shape != shape || r.Pattern != p {
					continue
				}
				found = true
				msgs += r.Published
				outages += r.Outages
				probes += r.Probes
				repeated += r.Repeated
				most = max(most, r.MostRuns)
				poisoned += r.Poisoned
				unsettled += r.Unsettled
				lost += r.Lost
				for _, k := range r.EndedAtProbe {
					endedAt[k]++
				}
				notOver += r.Outages - len(r.EndedAtProbe)
				for _, s := range r.OutageS {
					inOutage += s
				}
				if r.CaughtAfterS != nil {
					caught = append(caught, strconv.FormatFloat(*r.CaughtAfterS, 'f', 2, 64))
				}
			}
			if !found {
				continue
			}
			var ended []string
			for _, k := range slices.Sorted(maps.Keys(endedAt)) {
				ended = append(ended, fmt.Sprintf("%d: %d", k, endedAt[k]))
			}
			if notOver > 0 {
				ended = append(ended, fmt.Sprintf("not over: %d", notOver))
			}
			endedAtProbe := "-"
			if len(ended) > 0 {
				endedAtProbe = strings.Join(ended, ", ")
			}
			caughtAt := "-"
			if len(caught) > 0 {
				caughtAt = strings.Join(caught, ", ")
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%.1f\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t\n", shape, p, msgs, outages, endedAtProbe, inOutage, probes, repeated, most, poisoned, unsettled, lost, caughtAt)
		}
	}
	_ = tw.Flush()
	return b.String()
}
