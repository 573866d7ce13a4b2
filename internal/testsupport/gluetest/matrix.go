package gluetest

// Issue 49's matrix: every middleware of Watermill's message/router/middleware, on
// either side of the Retry, on the real broker. The middlewares and what each cell
// must show are in matrixcells.go; docs/watermill-middlewares.md is the table they
// render (matrixTable), checked by TestMatrixDocs.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
)

// The matrix's Retry: three attempts, retries after 200 ms, and a 3 s tier whose queue
// the test deletes, so that a hand-off to it fails (returned unroutable); three failed
// hand-offs in a row poison the message.
const (
	matrixAttempts = 3
	matrixGuard    = 10 // deliveries of one message after which the test acks it: a loop
)

var (
	errIgnored = errors.New("ignored by IgnoreErrors")
	errTrip    = errors.New("dependency down")
)

// The messages of every cell, published in this order, and what the handler does
// with each: flaky fails its first run (in a Timeout cell, by waiting for its
// context's deadline), perm fails with a Permanent error, always fails every run,
// panicky panics on its first run, ok succeeds, handoff asks for a 3 s delay, whose
// hand-off fails (its tier is gone) until it is poisoned. The few failures in a row
// stay under gobreaker's default threshold (6), whatever the order the retries come
// back in. A cell may add messages of its own (ignored, open).
var matrixMessages = []string{"flaky", "perm", "always", "panicky", "ok", "handoff"}

// side is where a cell's middleware is: outside the Retry (a router middleware added
// before Retry.AddHandler) or inside (added to the handler AddHandler returns).
type side int

const (
	outside side = iota
	inside
)

func (s side) String() string {
	if s == inside {
		return "inside"
	}
	return "outside"
}

// cellEnv is what a cell's middleware is built from.
type cellEnv struct {
	t      *testing.T
	m      Major
	r      Retry
	id     string // the cell's unique name: message UUIDs start with it
	wpoisn string // the topic of Watermill's PoisonQueue
	// breaker is the cell's CircuitBreaker, if it has one.
	breaker *wmiddleware.CircuitBreaker
}

// msgStats is what happened to one message of a cell.
type msgStats struct {
	deliveries int  // deliveries the router made (outermost)
	stopped    bool // acked by the test's guard, after matrixGuard deliveries: a loop
	runs       int  // handler runs
	succeeded  int  // handler runs that returned nil
	attempts   []int
	errs       []error  // each run's
	corrIDs    []string // the correlation ID each run saw
	delayedFor []string // Watermill's delay metadata each run saw
	poisoned   int      // copies in the Retry's poison queue
	wpoisoned  int      // copies in Watermill's PoisonQueue's topic
}

// cellRun is one cell's run: its counts, as the router, the handler and the poison
// queues saw them.
type cellRun struct {
	mu        sync.Mutex
	msgs      map[string]*msgStats
	inflight  int
	published int
	nacks     int // deliveries given back (nacked before any ack): each comes again
	changed   chan struct{}
	logs      *logCapture
	stats     middleware.Stats
	retryOf   func() int64 // the Retry's retries so far
}

func (c *cellRun) msg(name string) *msgStats {
	s := c.msgs[name]
	if s == nil {
		s = &msgStats{}
		c.msgs[name] = s
	}
	return s
}

func (c *cellRun) signal() {
	select {
	case c.changed <- struct{}{}:
	default:
	}
}

// counter is the outermost middleware: it counts each delivery and what the router
// does with it, and acks a message delivered more than matrixGuard times (a loop)
// without running the rest.
func (c *cellRun) counter(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (_ []*message.Message, err error) {
		name := msgName(msg.UUID)
		c.mu.Lock()
		s := c.msg(name)
		s.deliveries++
		if s.deliveries > matrixGuard {
			s.stopped = true
			c.mu.Unlock()
			c.signal()
			return nil, nil
		}
		c.inflight++
		c.mu.Unlock()
		defer func() {
			v := recover() // the router recovers it, and nacks the message
			c.mu.Lock()
			c.inflight--
			if err != nil || v != nil {
				select {
				case <-msg.Acked(): // the nack that follows does nothing: it is not redelivered
				default:
					c.nacks++
				}
			}
			c.mu.Unlock()
			c.signal()
			if v != nil {
				panic(v)
			}
		}()
		return h(msg)
	}
}

// quiet tells that nothing more can come: no delivery in flight, and every message
// published, given back or retried was delivered.
func (c *cellRun) quiet() bool {
	retries := c.retryOf()
	c.mu.Lock()
	defer c.mu.Unlock()
	delivered := 0
	for _, s := range c.msgs {
		delivered += s.deliveries
	}
	if c.inflight == 0 && c.refused() {
		// A message given back is refused when it comes back (no Retry read a message
		// of the subscriber), paced: the router never sees it again, nor those behind
		// it, which wait in the work queue.
		return true
	}
	return c.inflight == 0 && int64(delivered) == int64(c.published+c.nacks)+retries
}

// paced tells that the Retry paced the redeliveries of a message a middleware outside
// it failed, which it says once.
func (c *cellRun) paced() bool {
	c.logs.mu.Lock()
	defer c.logs.mu.Unlock()
	for _, l := range c.logs.lines {
		if strings.HasPrefix(l.Msg, saidPaced) {
			return true
		}
	}
	return false
}

// refused tells that the Retry refuses the redeliveries of the cell's subscriber (its
// middleware never read one of its messages), which it says once.
func (c *cellRun) refused() bool {
	c.logs.mu.Lock()
	defer c.logs.mu.Unlock()
	for _, l := range c.logs.lines {
		if strings.HasPrefix(l.Msg, saidRefused) {
			return true
		}
	}
	return false
}

// waitQuiet waits until quiet, or fails t after timeout.
func (c *cellRun) waitQuiet(t *testing.T, timeout time.Duration) {
	t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond) // retries come back from the broker: no event here
	defer tick.Stop()
	for !c.quiet() {
		select {
		case <-c.changed:
		case <-tick.C:
		case <-deadline.C:
			c.mu.Lock()
			defer c.mu.Unlock()
			t.Fatalf("not settled within %s: %d in flight, %d published, %d given back, %d retries; %s", timeout, c.inflight, c.published, c.nacks, c.retryOf(), c.describe())
		}
	}
}

func (c *cellRun) describe() string {
	var b strings.Builder
	for _, name := range slices.Sorted(maps.Keys(c.msgs)) {
		s := c.msgs[name]
		fmt.Fprintf(&b, "%s: %d deliveries, %d runs %v, %d ok; ", name, s.deliveries, s.runs, s.attempts, s.succeeded)
	}
	return b.String()
}

// msgName is the message's name in its cell: its UUID after the cell's id.
func msgName(uuid string) string {
	_, name, _ := strings.Cut(uuid, "/")
	return name
}

// handle is the cell's handler.
func (c *cellRun) handle(deadline bool) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		name := msgName(msg.UUID)
		c.mu.Lock()
		s := c.msg(name)
		s.runs++
		run := s.runs
		s.attempts = append(s.attempts, amqpretry.Attempt(msg))
		s.corrIDs = append(s.corrIDs, wmiddleware.MessageCorrelationID(msg))
		s.delayedFor = append(s.delayedFor, msg.Metadata.Get("_watermill_delayed_for"))
		c.mu.Unlock()
		err := matrixOutcome(msg, name, run, deadline)
		c.mu.Lock()
		s.errs = append(s.errs, err)
		if err == nil {
			s.succeeded++
		}
		c.mu.Unlock()
		return err
	}
}

// matrixOutcome is what the handler does with the run-th run of message name.
func matrixOutcome(msg *message.Message, name string, run int, deadline bool) error {
	switch name {
	case "flaky":
		if run > 1 {
			return nil
		}
		if deadline {
			select {
			case <-msg.Context().Done():
				return msg.Context().Err()
			case <-time.After(10 * time.Second):
				return errors.New("the context had no deadline")
			}
		}
		return errFlaky
	case "perm":
		return amqpretry.Permanent(errors.New("malformed"))
	case "always":
		return errFlaky
	case "panicky":
		if run == 1 {
			panic("inventory gone")
		}
		return nil
	case "handoff":
		if amqpretry.Attempt(msg) == 1 {
			return amqpretry.RetryAfter(errFlaky, 3*time.Second)
		}
		return nil
	case "ignored":
		return errIgnored
	}
	return nil // ok, open
}

// matrixSetup is the broker-side world every cell of one major shares: a prefix, a
// Retry config, Watermill's poison topic.
type matrixSetup struct {
	prefix  string
	cfg     amqpretry.Config
	wpoison string
}

// cellID names the cell of mw on side sd: its work queue, its messages' UUIDs.
func cellID(mw matrixMiddleware, sd side) string {
	return strings.ReplaceAll(mw.key, " ", "-") + "." + sd.String()
}

// newMatrixSetup declares the topology of the cells' Retries and their work queues,
// then deletes the 3 s tier: a hand-off to it is returned unroutable, and fails. The
// cells' Retries declare nothing (topology mode none), so nothing declares it again.
func newMatrixSetup(t *testing.T, rows []matrixMiddleware) matrixSetup {
	t.Helper()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	prefix := brokertest.Prefix(t)
	s := matrixSetup{prefix: prefix, wpoison: prefix + ".wpoison"}
	// A message is poisoned after matrixAttempts failed hand-offs, as after its
	// attempts: the Retrys of this matrix are built while the hook is set.
	t.Cleanup(backend.SetHandoffAttemptsForTest(matrixAttempts))
	s.cfg = amqpretry.Config{
		Backend:  delay.TTLTiers(200*time.Millisecond, 3*time.Second),
		Prefix:   prefix,
		Policy:   amqpretry.Policy{MaxAttempts: matrixAttempts, Delays: []time.Duration{200 * time.Millisecond}, Jitter: -1},
		Topology: topology.ModeNone,
		Logger:   Logger(),
	}
	queues := []string{s.wpoison}
	for _, mw := range rows {
		for _, sd := range []side{outside, inside} {
			queues = append(queues, s.prefix+".m."+cellID(mw, sd))
		}
	}
	plan, err := s.cfg.Plan(queues[1:]...)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, plan)
	brokertest.Cleanup(t, queues, nil)
	for _, q := range queues {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := plan.Apply(ch, topology.ModeDeclare); err != nil {
		t.Fatal(err)
	}
	var tier string
	for _, q := range plan.Queues {
		if q.Role == "delay" && fmt.Sprint(q.Args["x-message-ttl"]) == "3000" {
			tier = q.Name
		}
	}
	if tier == "" {
		t.Fatalf("no 3 s tier in %v", plan.Queues)
	}
	if _, err := ch.QueueDelete(tier, false, false, false); err != nil {
		t.Fatal(err)
	}
	return s
}

// cell is one cell of the matrix, running.
type cell struct {
	*cellRun
	mw   matrixMiddleware
	side side
	env  *cellEnv
	send func(names ...string)
	stop func()
}

// startCell starts one cell: a Retry of its own (on the shared prefix), a router whose
// outermost middleware counts deliveries, the middleware on its side; and publishes
// the messages. What it declares is removed when t ends.
func startCell(t *testing.T, m Major, s matrixSetup, mw matrixMiddleware, sd side) *cell {
	t.Helper()
	id := cellID(mw, sd)
	topic := s.prefix + ".m." + id
	logs := &logCapture{}
	cfg := s.cfg
	cfg.Logger = logs
	r, err := m.New(Sub{URI: brokertest.URI()}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	c := &cell{mw: mw, side: sd, cellRun: &cellRun{msgs: map[string]*msgStats{}, changed: make(chan struct{}, 1), logs: logs,
		retryOf: func() int64 { return r.Stats().Retries }}}
	c.env = &cellEnv{t: t, m: m, r: r, id: id, wpoisn: s.wpoison}
	built := mw.build(c.env)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, Logger())
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(c.counter)
	if sd == outside {
		router.AddMiddleware(built)
	}
	h, err := r.AddHandler(router, "matrix-"+id, topic, c.handle(mw.deadline))
	if err != nil {
		t.Fatal(err)
	}
	if sd == inside {
		h.AddMiddleware(built)
	}
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	var once sync.Once
	c.stop = func() {
		once.Do(func() {
			_ = router.Close()
			_ = r.Close()
			c.stats = r.Stats()
		})
	}
	t.Cleanup(c.stop)
	pub := m.Publisher(t, Sub{URI: brokertest.URI()})
	c.send = func(names ...string) {
		for _, name := range names {
			msg := message.NewMessage(id+"/"+name, []byte("payload of "+id+"/"+name))
			wmiddleware.SetCorrelationID("corr-"+id, msg)
			c.mu.Lock()
			c.published++
			c.mu.Unlock()
			if err := pub.Publish(topic, msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	c.send(append(slices.Clone(matrixMessages), mw.extra...)...)
	return c
}

// finish waits until c is settled (and runs its then), and stops it.
func (c *cell) finish(t *testing.T) {
	c.waitQuiet(t, 60*time.Second)
	if c.mw.then != nil {
		c.env.t = t
		c.mw.then(c.env, c.send)
		c.waitQuiet(t, 60*time.Second)
	}
	c.stop()
}

// The outcome of a cell, as the table shows it.
type outcome struct {
	Lost       int    // messages neither handled nor poisoned (the guard's excepted)
	Loop       bool   // a message delivered more times than it has attempts
	Retried    bool   // flaky's failure was retried, and the retry ran the handler
	PoisonOnce string // how many times perm was poisoned: "once", "never", "twice", ...
	Said       string // what the Retry said, once, of this middleware ("" for nothing)
}

// measure reads a cell's outcome from its run.
func (c *cellRun) measure() outcome {
	var o outcome
	names := append(slices.Clone(matrixMessages), "open")
	for _, name := range names {
		s := c.msgs[name]
		if s == nil {
			continue
		}
		if s.deliveries > matrixAttempts && !c.paced() {
			o.Loop = true // more deliveries than attempts, none of them paced
		}
		if !s.stopped && s.succeeded == 0 && s.poisoned+s.wpoisoned == 0 && !c.refused() {
			o.Lost++ // (refused messages wait in the work queue)
		}
	}
	if f := c.msgs["flaky"]; f != nil {
		o.Retried = f.runs >= 2 && f.succeeded > 0
	}
	o.PoisonOnce = times(0)
	if p := c.msgs["perm"]; p != nil {
		o.PoisonOnce = times(p.poisoned + p.wpoisoned)
	}
	o.Said = c.said()
	return o
}

func times(n int) string {
	switch n {
	case 0:
		return "never"
	case 1:
		return "once"
	case 2:
		return "twice"
	}
	return fmt.Sprintf("%d times", n)
}

// said lists what the Retry logged once (fields said=once) about a middleware.
func (c *cellRun) said() string {
	var out []string
	c.logs.mu.Lock()
	defer c.logs.mu.Unlock()
	for _, l := range c.logs.lines {
		if l.Fields["said"] == "once" && (l.Level == watermill.ErrorLogLevel || l.Level == watermill.InfoLogLevel) {
			key := l.Msg
			if i := strings.IndexAny(key, ":."); i > 0 {
				key = key[:i]
			}
			if !slices.Contains(out, key) {
				out = append(out, key)
			}
		}
	}
	return strings.Join(out, "; ")
}

// MiddlewareMatrix: issue 49's matrix. Every middleware of Watermill's
// message/router/middleware, plus CircuitBreaker, outside the Retry (a router
// middleware added before Retry.AddHandler) and inside it (added to the handler
// AddHandler returns), each cell with a Retry of its own on one shared ttl-tiers
// prefix, all cells at once. Each cell publishes the same messages (matrixMessages)
// and shows: how many are lost (neither handled nor poisoned), whether one is
// delivered more times than it has attempts (a loop), whether a failure's retry
// reaches the handler, how many times a permanent failure is poisoned, and what the
// Retry says of the middleware, once. Each must be what matrixCells declares, which
// docs/watermill-middlewares.md shows (TestMatrixDocs); the middleware's own checks
// follow.
func MiddlewareMatrix(t *testing.T, m Major) {
	rows := matrixCells()
	s := newMatrixSetup(t, rows)
	// Every cell at once: each waits on the broker most of the time.
	cells := make([][2]*cell, len(rows))
	for i, mw := range rows {
		for _, sd := range []side{outside, inside} {
			cells[i][sd] = startCell(t, m, s, mw, sd)
		}
	}
	for i, mw := range rows {
		for _, sd := range []side{outside, inside} {
			t.Run(mw.key+"/"+sd.String(), func(t *testing.T) { cells[i][sd].finish(t) })
		}
	}
	if t.Failed() {
		return
	}
	// Every cell is over: count the poisoned copies, by cell and message.
	for _, q := range []string{s.prefix + ".poison", s.wpoison} {
		for _, msg := range brokertest.Drain(t, q) {
			id, name, _ := strings.Cut(msg.UUID, "/")
			for i := range rows {
				for _, sd := range []side{outside, inside} {
					if c := cells[i][sd]; c.env.id == id {
						if q == s.wpoison {
							c.msg(name).wpoisoned++
						} else {
							c.msg(name).poisoned++
						}
					}
				}
			}
		}
	}
	for i, mw := range rows {
		for _, sd := range []side{outside, inside} {
			c := cells[i][sd]
			got := c.measure()
			t.Logf("%s %s: %+v; %s; stats %+v", mw.key, sd, got, c.describe(), c.stats)
			if want := mw.want[sd].outcome; got != want {
				t.Errorf("%s %s the Retry: %+v, want %+v", mw.key, sd, got, want)
			}
			if mw.check != nil {
				mw.check(t, sd, c.cellRun)
			}
		}
	}
}

// Markers of the matrix in docs/watermill-middlewares.md.
const (
	matrixBegin = "<!-- matrix: generated from internal/testsupport/gluetest/matrixcells.go; go test ./internal/testsupport/gluetest -run TestMatrixDocs -update -->"
	matrixEnd   = "<!-- matrix end -->"
)

// matrixTable is the matrix as docs/watermill-middlewares.md shows it: what
// matrixCells declares, which MiddlewareMatrix asserts on the broker for both majors.
func matrixTable() string {
	yes := map[bool]string{false: "no", true: "yes"}
	var b strings.Builder
	b.WriteString("| Middleware | Where | Lost | Loops | A retry reaches the handler | A permanent failure is poisoned | The Retry says, once | Verdict |\n")
	b.WriteString("| --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, mw := range matrixCells() {
		for _, sd := range []side{outside, inside} {
			w, verdict := mw.want[sd], mw.want[sd].verdict
			if sd == inside && verdict == mw.want[outside].verdict {
				verdict = "the same"
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %s | %s | %s | %s | %s |\n",
				mw.name, sd, w.Lost, yes[w.Loop], yes[w.Retried], w.PoisonOnce, saidLabel[w.Said], verdict)
		}
	}
	return b.String()
}
