package amqpretry_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqpv2 "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wamqpv3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/wamqp2"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// wrongUsage is one way a user can get the library wrong (issue 25), what they do, and
// the fix the library must name. To add a case, add a row: its config, what the user
// does (do: one of the steps below, or a function of your own returning the text the
// user is shown, an error or a log line), and the texts that name the fix.
type wrongUsage struct {
	name string
	// broker: "" needs none; brokerAny the broker at AMQP_URI (skipped cleanly without
	// one, failed under CI=true); broker43 RabbitMQ 4.3 or later there (skipped on an
	// older one: scripts/test.sh runs the package on 4.3 too).
	broker string
	// cfg is the user's config; e.Prefix and e.Queue are unique to the case.
	cfg func(e *wuEnv) amqpretry.Config
	// setup prepares the broker (the user's existing queues), before do.
	setup func(e *wuEnv)
	// do is what the user does; it returns what the user is shown ("" for nothing
	// refused). Default: validate.
	do func(e *wuEnv, cfg amqpretry.Config) string
	// want are the texts that must all appear in it: the fix named, exactly. Nil: do
	// must show nothing (the usage is right after all).
	want []string
	// not are texts that must not appear in it: a fix that does not apply.
	not []string
	// is, if set, must be wrapped by the error (do's err, kept in e.Err).
	is error
}

const (
	brokerAny = "any"
	broker43  = "4.3"
	// brokerBefore43: a broker older than 4.3 there (skipped on 4.3 or later).
	brokerBefore43 = "before 4.3"
)

// wuEnv is a case's world: its unique names, the logs, the last error.
type wuEnv struct {
	t      *testing.T
	Prefix string
	Queue  string // a work queue of the case's own
	Logs   *logged
	Err    error
	conn   *amqp.Connection
}

// validate: Config.Validate.
func validate(e *wuEnv, cfg amqpretry.Config) string { return e.shown(cfg.Validate()) }

// newRetry: wamqp3.New on a subscriber config of the broker at AMQP_URI (a port nothing
// listens on without a broker case: an invalid config is refused before dialling).
func newRetry(e *wuEnv, cfg amqpretry.Config) string {
	r, err := wamqp3.New(e.subConfig(), cfg)
	if err == nil {
		_ = r.Close()
	}
	return e.shown(err)
}

// runRouter: wamqp3.New, AddHandler on e.Queue with a handler that always fails, and
// router.Run: what New or Run returns (the first subscribe is where a work queue is
// checked), or "" when the router runs.
func runRouter(e *wuEnv, cfg amqpretry.Config) string {
	r, err := wamqp3.New(e.subConfig(), cfg)
	if err != nil {
		return e.shown(err)
	}
	return e.run(r)
}

// runRouterV2: runRouter through watermill-amqp v2 (wamqp2).
func runRouterV2(e *wuEnv, cfg amqpretry.Config) string {
	r, err := wamqp2.New(wamqpv2.NewDurableQueueConfig(e.subConfig().Connection.AmqpURI), cfg)
	if err != nil {
		return e.shown(err)
	}
	return e.run(r)
}

// addHandler: wamqp3.New and AddHandler on e.Queue, without running the router: what
// New or AddHandler returns, or "" when the handler is added.
func addHandler(e *wuEnv, cfg amqpretry.Config) string {
	r, err := wamqp3.New(e.subConfig(), cfg)
	if err != nil {
		return e.shown(err)
	}
	return e.add(r)
}

// addHandlerV2: addHandler through watermill-amqp v2 (wamqp2).
func addHandlerV2(e *wuEnv, cfg amqpretry.Config) string {
	r, err := wamqp2.New(wamqpv2.NewDurableQueueConfig(e.subConfig().Connection.AmqpURI), cfg)
	if err != nil {
		return e.shown(err)
	}
	return e.add(r)
}

// add adds r's handler on e.Queue to a router it does not run: what AddHandler
// returns, or "".
func (e *wuEnv) add(r interface {
	AddHandler(*message.Router, string, string, message.NoPublishHandlerFunc) (*message.Handler, error)
	Close() error
}) string {
	defer r.Close()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		e.t.Fatal(err)
	}
	defer router.Close()
	_, err = r.AddHandler(router, "wrong-usage", e.Queue, func(*message.Message) error { return errors.New("boom") })
	return e.shown(err)
}

// run runs r's handler on e.Queue in a router: what AddHandler or Run returns, or ""
// when the router runs.
func (e *wuEnv) run(r interface {
	AddHandler(*message.Router, string, string, message.NoPublishHandlerFunc) (*message.Handler, error)
	Close() error
}) string {
	defer r.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		e.t.Fatal(err)
	}
	if _, err := r.AddHandler(router, "wrong-usage", e.Queue, func(*message.Message) error { return errors.New("boom") }); err != nil {
		return e.shown(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case err := <-done:
		return e.shown(err)
	case <-router.Running():
		_ = router.Close()
		<-done
		return ""
	case <-ctx.Done():
		e.t.Fatal("the router neither ran nor failed within 30s")
	}
	return ""
}

// shown records err and returns its text, or "".
func (e *wuEnv) shown(err error) string {
	e.Err = err
	if err == nil {
		return ""
	}
	return err.Error()
}

func (e *wuEnv) subConfig() wamqpv3.Config {
	uri := "amqp://guest:guest@127.0.0.1:1/"
	if e.conn != nil {
		uri = brokertest.URI()
	}
	return wamqpv3.NewDurableQueueConfig(uri)
}

// declareClassic declares e.Queue as a classic queue, as watermill-amqp's durable
// config does without arguments, deleted when the test ends.
func (e *wuEnv) declareClassic() { e.declareQueue(nil) }

// declareQuorum declares e.Queue as a quorum queue, as delayed-retry's subscriber
// config did, deleted when the test ends.
func (e *wuEnv) declareQuorum() { e.declareQueue(amqp.Table{"x-queue-type": "quorum"}) }

// declareQueue declares e.Queue, durable, with args, deleted when the test ends.
func (e *wuEnv) declareQueue(args amqp.Table) {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	brokertest.Cleanup(e.t, []string{e.Queue}, nil)
	if _, err := ch.QueueDeclare(e.Queue, true, false, false, false, args); err != nil {
		e.t.Fatal(err)
	}
}

// apply declares what cfg's plan needs besides the work queues (the poison queue, the
// backend's topology), as an administrator would for topology mode verify, deleted
// when the test ends.
func (e *wuEnv) apply(cfg amqpretry.Config) {
	e.t.Helper()
	plan, err := cfg.Plan()
	if err != nil {
		e.t.Fatal(err)
	}
	brokertest.CleanupTopology(e.t, plan)
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	if err := plan.Apply(ch, topology.ModeDeclare); err != nil {
		e.t.Fatal(err)
	}
}

// cleanup deletes what cfg declares (its plan, the poison queue) when the test ends.
func (e *wuEnv) cleanup(cfg amqpretry.Config) {
	if plan, err := cfg.Plan(); err == nil {
		brokertest.CleanupTopology(e.t, plan)
	}
}

// classicUnderDelayedRetry is a delayed-retry config for e in topology mode m.
func classicUnderDelayedRetry(m topology.Mode) func(e *wuEnv) amqpretry.Config {
	return func(e *wuEnv) amqpretry.Config {
		return amqpretry.Config{Backend: delay.DelayedRetry(0), Prefix: e.Prefix, Topology: m, Logger: logger{e.Logs}}
	}
}

// classicUnderDelayedRetryAtAddHandler is the case of a user moving an existing
// classic work queue to delayed-retry in topology mode m, through add (one
// watermill-amqp major's New and AddHandler, the router not run): AddHandler refuses.
func classicUnderDelayedRetryAtAddHandler(m topology.Mode, major string, add func(*wuEnv, amqpretry.Config) string) wrongUsage {
	return wrongUsage{
		name:   fmt.Sprintf("classic work queue under delayed-retry, topology mode %s, AddHandler, %s", m, major),
		broker: broker43,
		cfg:    classicUnderDelayedRetry(m),
		setup:  func(e *wuEnv) { e.declareClassic() },
		do: func(e *wuEnv, cfg amqpretry.Config) string {
			if m == topology.ModeVerify {
				e.apply(cfg)
			} else {
				e.cleanup(cfg)
			}
			return add(e, cfg)
		},
		want: append([]string{`handler "wrong-usage": `}, classicFix("<queue>")...),
		is:   topology.ErrMismatch,
	}
}

// quorumBack is the case of a user back from delayed-retry, which made the work queue
// a quorum queue, on ttl-tiers with a subscriber config without its queue arguments
// (the README's), through run (one watermill-amqp major).
func quorumBack(major string, run func(*wuEnv, amqpretry.Config) string) wrongUsage {
	return wrongUsage{
		name:   "quorum work queue back on ttl-tiers, " + major,
		broker: brokerAny,
		cfg:    func(e *wuEnv) amqpretry.Config { return amqpretry.Config{Prefix: e.Prefix} },
		setup:  func(e *wuEnv) { e.declareQuorum() },
		do: func(e *wuEnv, cfg amqpretry.Config) string {
			e.cleanup(cfg)
			return run(e, cfg)
		},
		want: quorumBackFix,
		is:   topology.ErrMismatch,
	}
}

// quorumBackFix is the fix the refusal of a quorum work queue declared without
// arguments names: the queue, what it has and what the config asks, the fixes, the doc.
var quorumBackFix = []string{
	`work queue "<queue>": declared with different arguments: it has x-queue-type quorum, the subscriber config asks for `, // none on 3.10, classic on 4.x
	"an existing queue's arguments cannot change",
	`give the subscriber config's Queue.Arguments x-queue-type: "quorum" (the queue's own)`,
	"or set Config.Topology to topology.ModeVerify so that the queue is checked, not declared",
	"see docs/switching-backends.md",
}

// classicFix is the fix every refusal of a classic work queue under delayed retries
// names.
func classicFix(queue string) []string {
	return []string{
		fmt.Sprintf("work queue %q is a classic queue, and delayed retries (Backend delayed-retry or delay.HeldRetries) need a quorum queue", queue),
		"a queue's type cannot change, not even by a policy",
		"move to a new quorum queue", "move the messages to it",
		"or keep it as it is and use a copying Backend (ttl-tiers or binary-levels) without delay.HeldRetries",
	}
}

func TestWrongUsage(t *testing.T) {
	memory := func(p amqpretry.Policy) func(*wuEnv) amqpretry.Config {
		return func(*wuEnv) amqpretry.Config {
			return amqpretry.Config{Backend: delay.Memory(discard{}), Policy: p}
		}
	}
	cases := []wrongUsage{
		{
			name: "Backend setting out of range",
			cfg:  func(*wuEnv) amqpretry.Config { return amqpretry.Config{Backend: delay.BinaryLevels(30)} },
			want: []string{"Levels: 30 is outside 1 to 29"},
		},
		{
			name: "negative MaxAttempts",
			cfg:  memory(amqpretry.Policy{MaxAttempts: -1}),
			want: []string{"Policy.MaxAttempts: -1, must be at least 1 (0 means the default, 5)"},
		},
		{
			name: "every line names its field",
			cfg:  memory(amqpretry.Policy{Jitter: 1.5, Immediate: -1}),
			want: []string{"Policy.Jitter: 1.5, must be below 1 (a fraction of the delay, either way): set it below 1, 0 for the default 0.2, or -1 for no jitter\nPolicy.Immediate: -1, must not be negative: set it to 0 (none) or more"},
		},
		{
			name: "binary-levels limit checked against the schedule, not its longest entry",
			cfg: func(*wuEnv) amqpretry.Config {
				return amqpretry.Config{Backend: delay.BinaryLevels(5), Policy: amqpretry.Policy{MaxAttempts: 3}}
			},
		},
		{
			name: "binary-levels schedule past its limit",
			cfg: func(*wuEnv) amqpretry.Config {
				return amqpretry.Config{Backend: delay.BinaryLevels(5), Policy: amqpretry.Policy{MaxAttempts: 10}}
			},
			want: []string{"Policy.Delays: delay too long", "set Policy.Delays to a schedule of at most 31s (Exponential(time.Second, 2, 31s)), or lower Policy.MaxAttempts, or raise Levels"},
			is:   delay.ErrDelayTooLong,
		},
		{
			name: "delayed-retry with the defaults left zero",
			cfg: func(*wuEnv) amqpretry.Config {
				return amqpretry.Config{Backend: delay.DelayedRetry(0), Policy: amqpretry.Policy{MaxAttempts: 3}}
			},
		},
		{
			name: "delayed-retry with a copying backend's default schedule",
			cfg: func(*wuEnv) amqpretry.Config {
				return amqpretry.Config{Backend: delay.DelayedRetry(0), Policy: amqpretry.Policy{Delays: amqpretry.Exponential(time.Second, 2, 4*time.Second)}}
			},
			want: []string{"Policy.Delays: [1s 2s 4s], the delayed-retry backend holds every retry of a work queue for one constant delay, every 1s (its delay), and cannot grow it: leave Policy.Delays empty and set its delay, or use a copying Backend"},
		},
		{
			name: "delayed-retry with a schedule it cannot keep",
			cfg: func(*wuEnv) amqpretry.Config {
				return amqpretry.Config{Backend: delay.DelayedRetry(0), Policy: amqpretry.Policy{Delays: []time.Duration{5 * time.Second}}}
			},
			want: []string{"Policy.Delays: [5s], the delayed-retry backend holds every retry of a work queue for one constant delay, every 1s (its delay): set its delay to 5s instead"},
		},
		{
			name: "MaxAttempts 0 is logged as what it means",
			cfg: func(e *wuEnv) amqpretry.Config {
				return amqpretry.Config{Backend: delay.Memory(discard{}), Logger: logger{e.Logs}}
			},
			do: func(e *wuEnv, cfg amqpretry.Config) string {
				r, err := wamqp3.New(wamqpv3.Config{}, cfg)
				if err != nil {
					return e.shown(err)
				}
				_ = r.Close()
				return strings.Join(e.Logs.matching("Broker-side retry ready"), "\n")
			},
			want: []string{"max_attempts=5", "schedule=1s, ×2 per retry up to 10m0s, jitter ±20%", "backend_limits=any delay, kept in this process"},
		},
		{
			name: "delivery-time on the 0-9-1 transport",
			cfg:  func(*wuEnv) amqpretry.Config { return amqpretry.Config{Backend: delay.DeliveryTime()} },
			do:   newRetry,
			want: []string{"Backend: delivery-time is not supported on the AMQP 0-9-1 transport (watermill-amqp)",
				"use the AMQP 1.0 transport, package github.com/amqpretry/amqpretry/amqp1, or another Backend (ttl-tiers, binary-levels, delayed-retry)"},
			is: delay.ErrUnsupported,
		},
		{
			// Held retries in front of a backend that holds every retry already.
			name: "HeldRetries in front of delayed-retry",
			cfg: func(*wuEnv) amqpretry.Config {
				return amqpretry.Config{Backend: delay.HeldRetries(2, 3*time.Second, delay.DelayedRetry(0))}
			},
			want: []string{"delay.HeldRetries(then): retries held in the work queue (RabbitMQ 4.3) cannot stand in front of the delayed-retry backend: give a copying backend, delay.TTLTiers() or delay.BinaryLevels(0)"},
		},
		{
			name: "negative delay of HeldRetries",
			cfg: func(*wuEnv) amqpretry.Config {
				return amqpretry.Config{Backend: delay.HeldRetries(1, -time.Second, nil)}
			},
			want: []string{"delay.HeldRetries(delay): -1s must be a whole number of milliseconds, at least 1ms"},
		},
		{
			// The user is on ttl-tiers already: the field that asked for 4.3 is HeldRetries.
			name:   "HeldRetries before RabbitMQ 4.3",
			broker: brokerBefore43,
			cfg: func(e *wuEnv) amqpretry.Config {
				return amqpretry.Config{Prefix: e.Prefix, Backend: delay.HeldRetries(2, 0, delay.TTLTiers(time.Second))}
			},
			do:   newRetry,
			want: []string{"delay.HeldRetries(n): 2: delayed-retry is not supported by this broker", "retries held in the work queue need RabbitMQ 4.3 or later", "on this broker drop delay.HeldRetries (Backend ttl-tiers then takes every retry), or move to RabbitMQ 4.3 or later"},
			not:  []string{"set Backend", "use ttl-tiers or binary-levels there"},
			is:   delay.ErrUnsupported,
		},
		{
			name:   "Backend delayed-retry before RabbitMQ 4.3",
			broker: brokerBefore43,
			cfg: func(e *wuEnv) amqpretry.Config {
				return amqpretry.Config{Prefix: e.Prefix, Backend: delay.DelayedRetry(0)}
			},
			do:   newRetry,
			want: []string{"Backend: delayed-retry is not supported by this broker", "(the copying backends, ttl-tiers and binary-levels, run on any broker)", "on this broker set Backend to a copying backend, or move to RabbitMQ 4.3 or later"},
			not:  []string{"HeldRetries"},
			is:   delay.ErrUnsupported,
		},
		quorumBack("watermill-amqp v3", runRouter),
		quorumBack("watermill-amqp v2", runRouterV2),
		// Issue 43 §5: moving to delayed-retry by configuration is refused by
		// AddHandler, which knows the work queue, not only when the router runs.
		classicUnderDelayedRetryAtAddHandler(topology.ModeDeclare, "watermill-amqp v3", addHandler),
		classicUnderDelayedRetryAtAddHandler(topology.ModeDeclare, "watermill-amqp v2", addHandlerV2),
		classicUnderDelayedRetryAtAddHandler(topology.ModeVerify, "watermill-amqp v3", addHandler),
		{
			// A work queue that does not exist yet is fine: the subscriber declares it.
			name:   "missing work queue under delayed-retry, AddHandler",
			broker: broker43,
			cfg:    classicUnderDelayedRetry(topology.ModeDeclare),
			do: func(e *wuEnv, cfg amqpretry.Config) string {
				e.cleanup(cfg)
				brokertest.Cleanup(e.t, []string{e.Queue}, nil)
				return runRouter(e, cfg)
			},
		},
		{
			// Topology mode none checks nothing: the engine notices when the message
			// comes back at once a second time in a row (one early return may be a nack
			// lost with its connection), the message is poisoned after the two retries
			// it got, and the log names fixes that can work on a classic queue.
			name:   "classic work queue under delayed-retry, topology mode none",
			broker: broker43,
			cfg:    classicUnderDelayedRetry(topology.ModeNone),
			setup:  func(e *wuEnv) { e.declareClassic() },
			do:     classicAtRuntime,
			want: []string{
				"poisoned at attempt 3 (handoff-failed), stats retries 2 poisoned 1",
				"a classic queue cannot hold delayed retries (`amqpretry topology verify` tells its type): move to a new quorum queue, or use a copying Backend",
			},
		},
		{
			// The handler's Permanent error cannot be poisoned: the poison queue is gone
			// and topology mode verify does not declare it. The message is set aside, only
			// its poisoning retried, and the ERROR names the command that creates it.
			name:   "poison queue deleted, topology mode verify",
			broker: brokerAny,
			cfg:    poisonGoneConfig(topology.ModeVerify),
			do:     poisonGone,
			want: []string{
				`poison queue "<prefix>.poison" does not exist (topology mode verify does not declare it): create it with ` + "`amqpretry topology apply --backend ttl-tiers --prefix <prefix>",
				"until then the message stays in its work queue and only its poisoning is retried",
				"handler ran 1 time, poison pending 1",
			},
		},
		{
			// In topology mode declare the library declares the poison queue again:
			// the message is poisoned, nothing to fix.
			name:   "poison queue deleted, topology mode declare",
			broker: brokerAny,
			cfg:    poisonGoneConfig(topology.ModeDeclare),
			do:     poisonGone,
		},
		{
			name:   "Close before the router",
			broker: brokerAny,
			cfg:    poisonGoneConfig(topology.ModeDeclare),
			do:     closeBeforeRouter,
			want: []string{
				"the Retry was closed before the router stopped, so nothing is handed off; the message is nacked for redelivery: close the router first, then the Retry",
				"handed off 0, poisoned 0",
			},
			is: amqpretry.ErrHandoff,
		},
		{
			name:   "Close twice",
			broker: brokerAny,
			cfg:    poisonGoneConfig(topology.ModeDeclare),
			do: func(e *wuEnv, cfg amqpretry.Config) string {
				e.cleanup(cfg)
				r, err := wamqp3.New(e.subConfig(), cfg)
				if err != nil {
					return e.shown(err)
				}
				if err := r.Close(); err != nil {
					return e.shown(err)
				}
				if err := r.Close(); err != nil {
					return e.shown(err)
				}
				if n := len(e.Logs.matching("Broker-side retry closed")); n != 1 {
					return fmt.Sprintf("closed logged %d times, want once", n)
				}
				return ""
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := &wuEnv{t: t, Logs: &logged{}}
			if tc.broker != "" {
				e.conn = brokertest.Dial(t)
				v, _ := e.conn.Properties["version"].(string)
				if tc.broker == broker43 && !version.DelayedRetry(v) {
					t.Skipf("RabbitMQ %s: the case needs 4.3 or later (scripts/test.sh runs it there)", v)
				}
				if tc.broker == brokerBefore43 && version.DelayedRetry(v) {
					t.Skipf("RabbitMQ %s: the case needs a broker older than 4.3 (scripts/test.sh runs it on 3.10 and 4.0)", v)
				}
				e.Prefix = brokertest.Prefix(t)
				e.Queue = e.Prefix + ".work"
			}
			if tc.setup != nil {
				tc.setup(e)
			}
			do := tc.do
			if do == nil {
				do = validate
			}
			got := do(e, tc.cfg(e))
			if tc.want == nil {
				if got != "" {
					t.Fatalf("shown %q, want nothing refused", got)
				}
				return
			}
			if got == "" {
				t.Fatal("nothing shown, want the fix named")
			}
			for _, w := range tc.want {
				w = strings.ReplaceAll(w, `"<queue>"`, fmt.Sprintf("%q", e.Queue))
				if w = strings.ReplaceAll(w, "<prefix>", e.Prefix); !strings.Contains(got, w) {
					t.Errorf("shown:\n%s\ndoes not say:\n%s", got, w)
				}
			}
			for _, n := range tc.not {
				if strings.Contains(got, n) {
					t.Errorf("shown:\n%s\nsays %q, a fix that does not apply", got, n)
				}
			}
			if tc.is != nil && !errors.Is(e.Err, tc.is) {
				t.Errorf("error %v does not wrap %v", e.Err, tc.is)
			}
			if strings.Contains(got, "err=<nil>") {
				t.Errorf("shown %q: a log line with err=<nil>", got)
			}
		})
	}
}

// classicAtRuntime runs the router on e.Queue, a classic queue, with nothing checked
// (topology mode none), publishes one message its handler always fails, and reports
// how it was poisoned, the Stats, and the ERROR logged.
func classicAtRuntime(e *wuEnv, cfg amqpretry.Config) string {
	e.apply(cfg)
	r, err := wamqp3.New(e.subConfig(), cfg)
	if err != nil {
		return e.shown(err)
	}
	defer r.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		e.t.Fatal(err)
	}
	if _, err := r.AddHandler(router, "wrong-usage", e.Queue, func(*message.Message) error { return errors.New("boom") }); err != nil {
		return e.shown(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Publish("", e.Queue, false, false, amqp.Publishing{MessageId: "m1", Body: []byte("x"), Headers: amqp.Table{"_watermill_message_uuid": "m1"}}); err != nil {
		e.t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	var poisoned []*message.Message
	for len(poisoned) == 0 {
		if time.Now().After(deadline) {
			e.t.Fatalf("nothing poisoned within 30s; stats %+v", r.Stats())
		}
		poisoned = brokertest.Drain(e.t, cfg.WithDefaults().PoisonQueue)
		if len(poisoned) == 0 {
			time.Sleep(50 * time.Millisecond)
		}
	}
	env := middleware.ReadEnvelope(poisoned[0].Metadata)
	st := r.Stats()
	return fmt.Sprintf("poisoned at attempt %d (%s), stats retries %d poisoned %d\n%s", env.Attempt, env.Reason, st.Retries, st.Poisoned, strings.Join(e.Logs.matching("ERROR"), "\n"))
}

// poisonGoneConfig is a ttl-tiers config for e in topology mode m, with a short tier.
func poisonGoneConfig(m topology.Mode) func(e *wuEnv) amqpretry.Config {
	return func(e *wuEnv) amqpretry.Config {
		return amqpretry.Config{Prefix: e.Prefix, Topology: m, Backend: delay.TTLTiers(200 * time.Millisecond), Logger: logger{e.Logs}}
	}
}

// runFailing declares what cfg needs and e.Queue, builds the Retry and runs a router on
// e.Queue whose handler fails every message with a Permanent error, counting its runs.
// stop stops the router (Close is the caller's).
func runFailing(e *wuEnv, cfg amqpretry.Config) (r *wamqp3.Retry, runs *atomic.Int64, stop func()) {
	e.t.Helper()
	e.apply(cfg)
	e.declareClassic() // the work queue, as an administrator made it (topology mode verify)
	r, err := wamqp3.New(e.subConfig(), cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		e.t.Fatal(err)
	}
	runs = &atomic.Int64{}
	if _, err := r.AddHandler(router, "wrong-usage", e.Queue, func(*message.Message) error {
		runs.Add(1)
		return amqpretry.Permanent(errors.New("malformed order"))
	}); err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-done:
		cancel()
		e.t.Fatalf("the router stopped: %v", err)
	case <-time.After(30 * time.Second):
		cancel()
		e.t.Fatal("the router did not run within 30s")
	}
	return r, runs, func() { _ = router.Close(); cancel() }
}

// publishTo publishes one message, m1, to e.Queue.
func (e *wuEnv) publishTo() {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Publish("", e.Queue, false, false, amqp.Publishing{MessageId: "m1", Body: []byte("x"), Headers: amqp.Table{"_watermill_message_uuid": "m1"}}); err != nil {
		e.t.Fatal(err)
	}
}

// waitUntil polls cond every 20ms until it is true, failing the test after 30s.
func (e *wuEnv) waitUntil(what string, cond func() bool) {
	e.t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			e.t.Fatalf("not within 30s: %s", what)
		}
	}
}

// poisonGone deletes the poison queue under a running router and fails one message for
// good. Where the queue is declared again (topology mode declare) the message must be
// poisoned, and nothing is shown; otherwise it shows the ERROR of the failed poisoning,
// once the poisoning failed twice, with how often the handler ran and the Stats.
func poisonGone(e *wuEnv, cfg amqpretry.Config) string {
	r, runs, stop := runFailing(e, cfg)
	defer r.Close()
	defer stop()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	poison := cfg.WithDefaults().PoisonQueue
	if _, err := ch.QueueDelete(poison, false, false, false); err != nil {
		e.t.Fatal(err)
	}
	e.publishTo()
	if cfg.Topology == topology.ModeDeclare {
		e.waitUntil("the message poisoned", func() bool { return r.Stats().Poisoned == 1 })
		if n := brokertest.QueueLength(e.t, poison); n != 1 || runs.Load() != 1 {
			return fmt.Sprintf("poison queue has %d, handler ran %d times: want 1 and 1", n, runs.Load())
		}
		return ""
	}
	e.waitUntil("two failed poisonings", func() bool { return r.Stats().HandoffFailures >= 2 })
	return fmt.Sprintf("%s\nhandler ran %d time, poison pending %d", strings.Join(e.Logs.matching("Could not poison message"), "\n"), runs.Load(), r.Stats().PoisonPending)
}

// closeBeforeRouter closes the Retry while its router runs (the wrong order), then
// fails one message: it must be nacked for redelivery, nothing handed off, and the
// first such message names the order to close in.
func closeBeforeRouter(e *wuEnv, cfg amqpretry.Config) string {
	r, _, stop := runFailing(e, cfg)
	defer stop()
	if err := r.Close(); err != nil {
		return e.shown(err)
	}
	e.publishTo()
	var lines []string
	e.waitUntil("the WARN of a message failed after Close", func() bool {
		lines = e.Logs.matching("Message failed after Close")
		return len(lines) > 0
	})
	e.Err = amqpretry.ErrHandoff
	if !strings.Contains(lines[0], amqpretry.ErrHandoff.Error()) {
		e.Err = nil
	}
	st := r.Stats()
	return fmt.Sprintf("%s\nhanded off %d, poisoned %d", strings.Join(lines, "\n"), st.Retries, st.Poisoned)
}
