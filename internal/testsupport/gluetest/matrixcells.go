package gluetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/sony/gobreaker"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

// matrixMiddleware is one row of the matrix: a middleware, how a cell builds it, and
// what each side must show.
type matrixMiddleware struct {
	key   string // names its cells
	name  string // as the table shows it
	build func(env *cellEnv) message.HandlerMiddleware
	// extra are messages of its own, published after matrixMessages.
	extra []string
	// deadline: flaky's first run waits for its context's deadline.
	deadline bool
	// then runs once the cell's messages are settled; it may send more.
	then  func(env *cellEnv, send func(names ...string))
	check func(t *testing.T, sd side, c *cellRun)
	want  [2]cellWant // by side
}

// cellWant is what a cell must show, and what the table says of it.
type cellWant struct {
	outcome
	verdict string
}

// both is w on either side.
func both(w cellWant) [2]cellWant { return [2]cellWant{w, w} }

// works is the outcome of a middleware that changes nothing of the four properties.
var works = outcome{Lost: 0, Loop: false, Retried: true, PoisonOnce: "once"}

// What the Retry says once, of a middleware, and how the table shows it.
const (
	saidDropped = "A retry was acked without its handler running"
	saidAcked   = "A middleware acked the message before the Retry could settle it"
	saidPoison  = "Watermill's PoisonQueue, inside the Retry, took a failed message to its own topic and returned success"
	saidRerun   = "A middleware inside the Retry ran the handler again after an error marked Permanent or RetryAfter"
	saidRefused = "Message redelivered after its handler failed without the retry middleware"
	saidPaced   = "Message redelivered after a middleware outside the Retry failed it"
)

var saidLabel = map[string]string{
	"":          "—",
	saidDropped: "ERROR: a retry was acked without its handler running",
	saidAcked:   "ERROR: the message was acked before the Retry could settle it",
	saidPoison:  "ERROR: PoisonQueue took a failure, none is retried",
	saidRerun:   "WARN: the handler ran again after a `Permanent` or `RetryAfter` error",
	saidRefused: "ERROR: its subscriber's messages come back with no Retry having read one: refused, paced",
	saidPaced:   "WARN: redelivered after a middleware outside the Retry failed it: paced",
}

// matrixCells are the rows of the matrix, in Watermill's alphabetical order, then
// CircuitBreaker.
func matrixCells() []matrixMiddleware {
	return []matrixMiddleware{
		{
			key:   "CorrelationID",
			name:  "`CorrelationID`",
			build: func(*cellEnv) message.HandlerMiddleware { return wmiddleware.CorrelationID },
			want:  both(cellWant{works, "works: a retry carries the message's metadata, its correlation ID included (CorrelationID sets it on the messages the handler produces)"}),
			check: func(t *testing.T, sd side, c *cellRun) {
				for name, s := range c.msgs {
					for _, id := range s.corrIDs {
						if id != "corr-CorrelationID."+sd.String() {
							t.Errorf("%s %s: a run saw correlation ID %q", name, sd, id)
						}
					}
				}
			},
		},
		{
			key:  "Deduplicator",
			name: "`Deduplicator` (default key)",
			build: func(*cellEnv) message.HandlerMiddleware {
				return (&wmiddleware.Deduplicator{}).Middleware
			},
			want: both(cellWant{outcome{Lost: 4, Retried: false, PoisonOnce: "once", Said: saidDropped},
				"does not work: it records a message's key before the handler runs and keeps it when the handler fails, so a retry, and a message given back after a failed hand-off, are taken for duplicates and acked, their work never done"}),
		},
		{
			key:  "Deduplicator DedupKey",
			name: "`Deduplicator{KeyFactory: amqpretry.DedupKey}`",
			build: func(*cellEnv) message.HandlerMiddleware {
				return (&wmiddleware.Deduplicator{KeyFactory: amqpretry.DedupKey}).Middleware
			},
			want: both(cellWant{works, "works: `amqpretry.DedupKey` tells a retry (the next attempt) and a message given back after a failed hand-off from a duplicate"}),
			check: func(t *testing.T, sd side, c *cellRun) {
				if s := c.msgs["handoff"]; s.runs != matrixAttempts {
					t.Errorf("%s: the message whose hand-offs failed ran %d times, want %d: a redelivery was dropped", sd, s.runs, matrixAttempts)
				}
			},
		},
		{
			key:  "DelayOnError",
			name: "`DelayOnError`",
			build: func(*cellEnv) message.HandlerMiddleware {
				return (&wmiddleware.DelayOnError{InitialInterval: time.Second, MaxInterval: 4 * time.Second, Multiplier: 2}).Middleware
			},
			want: [2]cellWant{
				{works, "works, and does nothing: the Retry returns success for a failure it hands off, so DelayOnError sees no error"},
				{works, "works, its delay unused: the Retry's `Policy` (or a `RetryAfter`) sets the delay; the delay metadata DelayOnError sets travels with the retry"},
			},
			check: func(t *testing.T, sd side, c *cellRun) {
				want := map[side]string{outside: "", inside: "1s"}[sd]
				if got := c.msgs["flaky"].delayedFor; len(got) != 2 || got[1] != want {
					t.Errorf("%s: flaky's runs saw Watermill's delay %q, want %q on its retry", sd, got, want)
				}
			},
		},
		{
			key:   "Duplicator",
			name:  "`Duplicator`",
			build: func(*cellEnv) message.HandlerMiddleware { return wmiddleware.Duplicator },
			want: [2]cellWant{
				{works, "works: each success runs the handler twice; a failure is handed off once (the Retry does nothing with a delivery it has handed off or poisoned that a middleware outside runs through it again)"},
				{works, "works: each success runs the handler twice; a failure is handed off once"},
			},
			check: func(t *testing.T, sd side, c *cellRun) {
				if ok, flaky := c.msgs["ok"].runs, c.msgs["flaky"].runs; ok != 2 || flaky != 3 {
					t.Errorf("%s: ok ran %d times, flaky %d; want 2 and 3 (a failure, then a success twice)", sd, ok, flaky)
				}
			},
		},
		{
			key:   "IgnoreErrors",
			name:  "`IgnoreErrors`",
			extra: []string{"ignored"},
			build: func(*cellEnv) message.HandlerMiddleware {
				return wmiddleware.NewIgnoreErrors([]error{errIgnored}).Middleware
			},
			want: [2]cellWant{
				{works, "does not work: the Retry has retried or poisoned an error before IgnoreErrors could see it, so it ignores none (its errors are retried, then poisoned)"},
				{works, "works: an error it ignores is a success (acked, not retried); the others reach the Retry"},
			},
			check: func(t *testing.T, sd side, c *cellRun) {
				s := c.msgs["ignored"]
				want := map[side][2]int{outside: {matrixAttempts, 1}, inside: {1, 0}}[sd]
				if got := [2]int{s.deliveries, s.poisoned}; got != want {
					t.Errorf("%s: the ignored error's message: %d deliveries, poisoned %d times; want %v", sd, got[0], got[1], want)
				}
			},
		},
		{
			key:   "InstantAck",
			name:  "`InstantAck`",
			build: func(*cellEnv) message.HandlerMiddleware { return wmiddleware.InstantAck },
			want: both(cellWant{outcome{Lost: 0, Retried: true, PoisonOnce: "once", Said: saidAcked},
				"works, at most once: a retry and a poisoning still work, but the message is acked before the Retry could settle it, so a message in flight when the process stops is lost, and one whose hand-off fails is poisoned at once (it can no longer be given back)"}),
			check: func(t *testing.T, sd side, c *cellRun) {
				if s := c.msgs["handoff"]; s.deliveries != 1 || s.poisoned != 1 {
					t.Errorf("%s: the message whose hand-off failed: %d deliveries, poisoned %d times; want 1, once", sd, s.deliveries, s.poisoned)
				}
			},
		},
		{
			key:  "PoisonQueue",
			name: "`PoisonQueue`",
			build: func(env *cellEnv) message.HandlerMiddleware {
				pq, err := wmiddleware.PoisonQueue(env.m.Publisher(env.t, Sub{URI: brokertest.URI()}), env.wpoisn)
				if err != nil {
					env.t.Fatal(err)
				}
				return pq
			},
			want: [2]cellWant{
				{works, "works: it sees only what the Retry returns as an error, a failed hand-off, which it publishes to its topic (without the Retry's envelope) instead of the broker redelivering it"},
				{outcome{Lost: 0, Retried: false, PoisonOnce: "once", Said: saidPoison},
					"does not work: it takes every failure to its own topic at its first attempt and returns success, so nothing is retried"},
			},
			check: func(t *testing.T, sd side, c *cellRun) {
				want := map[side]map[string]int{
					outside: {"handoff": 1},
					inside:  {"flaky": 1, "perm": 1, "always": 1, "handoff": 1},
				}[sd]
				for name, s := range c.msgs {
					if s.wpoisoned != want[name] {
						t.Errorf("%s: %s is %d times in PoisonQueue's topic, want %d", sd, name, s.wpoisoned, want[name])
					}
				}
			},
		},
		{
			key:   "RandomFail",
			name:  "`RandomFail(1)`",
			build: func(*cellEnv) message.HandlerMiddleware { return wmiddleware.RandomFail(1) },
			want: [2]cellWant{
				{outcome{Lost: 0, Loop: false, Retried: false, PoisonOnce: "never", Said: saidRefused},
					"does not work, and nothing loops: its failures come before the Retry, which never sees them; with p = 1 the Retry never reads a message of the subscriber, which looks like a handler without it, and refuses each message that comes back, paced, until the middleware goes inside (with p < 1, a message failed outside after others went through is redelivered paced, 100 ms doubling to 5 s, until a delivery gets through)"},
				{outcome{Lost: 0, Retried: false, PoisonOnce: "once"},
					"works: its failures are the handler's, retried, then poisoned after the last attempt (with p = 1 the handler never runs)"},
			},
			check: func(t *testing.T, sd side, c *cellRun) {
				for name, s := range c.msgs {
					if s.runs != 0 || sd == inside && (s.deliveries != matrixAttempts || s.poisoned != 1) || sd == outside && s.deliveries != 1 {
						t.Errorf("%s: %s: %d runs, %d deliveries, poisoned %d times, stopped by the test %v", sd, name, s.runs, s.deliveries, s.poisoned, s.stopped)
					}
				}
			},
		},
		{
			key:   "RandomPanic",
			name:  "`RandomPanic(1)`",
			build: func(*cellEnv) message.HandlerMiddleware { return wmiddleware.RandomPanic(1) },
			want: [2]cellWant{
				{outcome{Lost: 0, Loop: false, Retried: false, PoisonOnce: "never", Said: saidRefused},
					"does not work, and nothing loops: its panics come before the Retry, which never sees them (the router recovers each and nacks the message); with p = 1 the Retry never reads a message of the subscriber and refuses each one that comes back, paced, until the middleware goes inside (put `Recoverer` outside it and the same holds: the error never reaches the Retry)"},
				{outcome{Lost: 0, Retried: false, PoisonOnce: "once"},
					"works: the Retry recovers its panics as the handler's, retries them, then poisons after the last attempt, with the stack (with p = 1 the handler never runs)"},
			},
			check: func(t *testing.T, sd side, c *cellRun) {
				for name, s := range c.msgs {
					if s.runs != 0 || sd == inside && (s.deliveries != matrixAttempts || s.poisoned != 1) || sd == outside && s.deliveries != 1 {
						t.Errorf("%s: %s: %d runs, %d deliveries, poisoned %d times, stopped by the test %v", sd, name, s.runs, s.deliveries, s.poisoned, s.stopped)
					}
				}
			},
		},
		{
			key:   "Recoverer",
			name:  "`Recoverer`",
			build: func(*cellEnv) message.HandlerMiddleware { return wmiddleware.Recoverer },
			want:  both(cellWant{works, "works: the Retry recovers a panic itself, with its stack; inside, Recoverer makes it an error first, which the Retry retries alike"}),
		},
		{
			key:  "Retry",
			name: "`wmiddleware.Retry{MaxRetries: 1}`",
			build: func(*cellEnv) message.HandlerMiddleware {
				return wmiddleware.Retry{MaxRetries: 1, InitialInterval: 10 * time.Millisecond}.Middleware
			},
			want: [2]cellWant{
				{works, "works, and does little: the Retry returns success for a failure it hands off; Watermill's Retry runs it again only after a failed hand-off"},
				{outcome{Lost: 0, Retried: true, PoisonOnce: "once", Said: saidRerun},
					"works, with runs to spare: retries in this process first (`MaxRetries` + 1 runs per delivery), a `Permanent` or `RetryAfter` error included: use `Policy.Immediate` instead, which retries in this process only what the Retry would retry at once"},
			},
			check: func(t *testing.T, sd side, c *cellRun) {
				want := map[side][2]int{outside: {2, 1}, inside: {1, 2}}[sd]
				if got := [2]int{c.msgs["flaky"].deliveries, c.msgs["perm"].runs}; got != want {
					t.Errorf("%s: flaky delivered %d times, perm run %d times; want %v", sd, got[0], got[1], want)
				}
			},
		},
		{
			key:  "Throttle",
			name: "`Throttle`",
			build: func(*cellEnv) message.HandlerMiddleware {
				return wmiddleware.NewThrottle(100, time.Second).Middleware
			},
			want: [2]cellWant{
				{works, "works: it paces deliveries, retries included"},
				{works, "works: it paces the handler's runs"},
			},
		},
		{
			key:      "Timeout",
			name:     "`Timeout`",
			deadline: true,
			build:    func(*cellEnv) message.HandlerMiddleware { return wmiddleware.Timeout(300 * time.Millisecond) },
			want: [2]cellWant{
				{works, "works: the handler's context ends at the deadline, and its failure is retried (the deadline covers the Retry's work too, whose hand-off does not use that context)"},
				{works, "works: the handler's context ends at the deadline, and its failure is retried; the Retry goes on with the delivery's own context"},
			},
			check: func(t *testing.T, sd side, c *cellRun) {
				if errs := c.msgs["flaky"].errs; len(errs) != 2 || !errors.Is(errs[0], context.DeadlineExceeded) || errs[1] != nil {
					t.Errorf("%s: flaky's runs returned %v, want the deadline, then nil", sd, errs)
				}
			},
		},
		{
			key:  "CircuitBreaker",
			name: "`CircuitBreaker`",
			build: func(env *cellEnv) message.HandlerMiddleware {
				cb := wmiddleware.NewCircuitBreaker(gobreaker.Settings{Name: env.id, Timeout: 2 * time.Second})
				env.breaker = &cb
				return cb.Middleware
			},
			then: func(env *cellEnv, send func(names ...string)) {
				// Open it (6 failures in a row, gobreaker's default), for 2 s, then
				// send a message.
				fail := env.breaker.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errTrip })
				for range 6 {
					_, _ = fail(message.NewMessage("trip", nil))
				}
				send("open")
			},
			want: [2]cellWant{
				{outcome{Lost: 0, Loop: false, Retried: true, PoisonOnce: "once", Said: saidPaced},
					"works, paced, and sees little: it never sees the handler's failures (the Retry returns success for those it hands off); once open (after failed hand-offs) it refuses messages before the Retry, and each redelivery of a message it refused waits, 100 ms doubling to 5 s, until it lets one through: put it inside, where its refusal begins the work queue's outage"},
				{works, "works: it sees the handler's failures, which are retried; open, its refusal begins the work queue's outage: messages wait, spending no attempt, and each probe (an attempt) runs another message until one gets through"},
			},
			check: func(t *testing.T, sd side, c *cellRun) {
				s := c.msgs["open"]
				if sd == outside && (s.stopped || s.succeeded != 1) || sd == inside && (s.deliveries > matrixAttempts || s.succeeded != 1 || c.stats.Outages != 1) {
					t.Errorf("%s: the message sent while it was open: %d deliveries, %d successes, stopped by the test %v, %d outages", sd, s.deliveries, s.succeeded, s.stopped, c.stats.Outages)
				}
			},
		},
	}
}
