// Package gluetest is the test suite of the transport packages (wamqp2, wamqp3): every
// test runs against the real broker at AMQP_URI through a Major, the few operations
// that differ between watermill-amqp majors. Each transport package runs the whole
// suite with `gluetest.Run(t, major{})` in its tests, so both majors pass the same
// tests.
package gluetest

import (
	"context"
	"errors"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/hooks"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

// Sub describes the application's watermill-amqp subscriber config: a durable queue
// config, or, with Group set, a durable pub/sub config whose queue is
// "<topic>_<Group>".
type Sub struct {
	URI             string
	Group           string
	QueueArgs       amqp.Table
	NoRequeueOnNack bool
	// Prefetch, if set, is the consumer's prefetch count (watermill-amqp's default
	// is 1).
	Prefetch int
	// Connection, if set, is the subscriber's amqp091-go config (its
	// connection_name, say).
	Connection *amqp.Config
}

// Retry is what both transport packages' Retry offer.
type Retry interface {
	Middleware(h message.HandlerFunc) message.HandlerFunc
	AddHandler(router *message.Router, handlerName, topic string, handler message.NoPublishHandlerFunc) (*message.Handler, error)
	Stats() middleware.Stats
	Close() error
}

// Major is what differs between watermill-amqp majors.
type Major interface {
	// Name is the major: "2" or "3".
	Name() string
	// New is wamqpN.New with the config sub describes.
	New(sub Sub, cfg amqpretry.Config) (Retry, error)
	// Subscriber builds a subscriber from r's SubscriberConfig().
	Subscriber(t testing.TB, r Retry) message.Subscriber
	// PlainSubscriber builds a subscriber from the config sub describes, with
	// xdeath.Marshaler, not through any Retry.
	PlainSubscriber(t testing.TB, sub Sub) message.Subscriber
	// Publisher builds a publisher of the config sub describes.
	Publisher(t testing.TB, sub Sub) message.Publisher
	// SubscriberFor builds a subscriber from r's SubscriberConfigFor, as o says.
	SubscriberFor(t testing.TB, r Retry, o For) (message.Subscriber, error)
	// PoisonSubscriber builds a subscriber from r's PoisonSubscriberConfig().
	PoisonSubscriber(t testing.TB, r Retry) message.Subscriber
}

// Run runs every test of the suite with m; with -short, the quick ones only.
func Run(t *testing.T, m Major) {
	for _, tc := range []struct {
		name  string
		test  func(*testing.T, Major)
		quick bool // runs in the quick loop (go test -short)
	}{
		{"ScenarioFailThreeTimesThenSucceed", ScenarioFailThreeTimesThenSucceed, true},
		{"PoisonAfterMaxAttemptsWithEnvelope", PoisonAfterMaxAttemptsWithEnvelope, false},
		{"PermanentErrorPoisonsOnFirstFailure", PermanentErrorPoisonsOnFirstFailure, true},
		{"RetryAfterIsHonoured", RetryAfterIsHonoured, false},
		{"FanoutRetryReachesOnlyTheFailingQueue", FanoutRetryReachesOnlyTheFailingQueue, false},
		{"RouterWideMiddlewaresOfTwoGroupsEachRetryTheirOwn", RouterWideMiddlewaresOfTwoGroupsEachRetryTheirOwn, false},
		{"SubscriberNotBuiltFromSubscriberConfigIsPoisonedAtOnce", SubscriberNotBuiltFromSubscriberConfigIsPoisonedAtOnce, true},
		{"SubscriberWithoutTheMiddlewareIsRefusedNotLooped", SubscriberWithoutTheMiddlewareIsRefusedNotLooped, true},
		{"DeletedDelayExchangeIsDeclaredAgainAtTheFirstHandoff", DeletedDelayExchangeIsDeclaredAgainAtTheFirstHandoff, false},
		{"DeletedPoisonQueueIsDeclaredAgain", DeletedPoisonQueueIsDeclaredAgain, false},
		{"HandoffThatKeepsFailingBacksOffThenPoisons", HandoffThatKeepsFailingBacksOffThenPoisons, false},
		{"UndecodableHeadersReachTheHandlerAndSurviveEveryHop", UndecodableHeadersReachTheHandlerAndSurviveEveryHop, false},
		{"UnreadableHeadersEndInThePoisonQueue", UnreadableHeadersEndInThePoisonQueue, false},
		{"HeadersNearFrameMaxArePoisonedWithTheHeadersThatFit", HeadersNearFrameMaxArePoisonedWithTheHeadersThatFit, false},
		{"PoisoningIsLoggedAtError", PoisoningIsLoggedAtError, false},
		{"WorkPerCopyIsEncodeOnReceipt", WorkPerCopyIsEncodeOnReceipt, false},
		{"TraceContextSurvivesRetryAndPoison", TraceContextSurvivesRetryAndPoison, false},
		{"SchedulerParksAMessageFromOtherCode", SchedulerParksAMessageFromOtherCode, false},
		{"TopologyClashNamesQueueAndArgument", TopologyClashNamesQueueAndArgument, false},
		{"CredentialsNeverInErrors", CredentialsNeverInErrors, true},
		{"InvalidConfigNamesTheField", InvalidConfigNamesTheField, true},
		{"InvalidConfigTouchesNothingOnTheBroker", InvalidConfigTouchesNothingOnTheBroker, false},
		{"LowDeliveryLimitOnQuorumWorkQueueIsWarned", LowDeliveryLimitOnQuorumWorkQueueIsWarned, false},
		{"QuorumWorkQueueWithoutDeadLetterIsWarned", QuorumWorkQueueWithoutDeadLetterIsWarned, false},
		{"LeastPrivilegeAfterTopologyApply", LeastPrivilegeAfterTopologyApply, false},
		{"DelayedRetry", DelayedRetry, true},
		{"HeldRetriesThenCopies", HeldRetriesThenCopies, false},
		{"DelayedRetryOnAQueueWithoutItFallsBackLoudly", DelayedRetryOnAQueueWithoutItFallsBackLoudly, false},
		{"CopyingBackendOnADelayedRetryQueueKeepsIt", CopyingBackendOnADelayedRetryQueueKeepsIt, false},
		{"DelayedRetryRefusedBefore43", DelayedRetryRefusedBefore43, false},
		{"DelayedRetryWaitsThroughFaults", DelayedRetryWaitsThroughFaults, false},
		{"AddHandlersSubscriberClosesWhenRunsContextEnds", AddHandlersSubscriberClosesWhenRunsContextEnds, false},
		{"PoisonQueueGoneNeverRerunsTheHandler", PoisonQueueGoneNeverRerunsTheHandler, false},
		{"CloseBeforeTheRouterHandsNothingOff", CloseBeforeTheRouterHandsNothingOff, false},
		{"ForgottenCloseIsWarnedAndClosed", ForgottenCloseIsWarnedAndClosed, false},
		{"RetryAfterIsNeverUndercutOnDelayedRetry", RetryAfterIsNeverUndercutOnDelayedRetry, false},
		{"RetryAfterIsNeverUndercutOnTTLTiers", RetryAfterIsNeverUndercutOnTTLTiers, false},
		{"PolicyDelayPastTheLongestTierIsNeverEarly", PolicyDelayPastTheLongestTierIsNeverEarly, false},
		{"PanicUnderRecovererIsRetriedThenPoisonedWithItsStack", PanicUnderRecovererIsRetriedThenPoisonedWithItsStack, true},
		{"CQRSEventsUndecodableAtOnceAttemptFromContext", CQRSEventsUndecodableAtOnceAttemptFromContext, true},
		{"CQRSHandlersShareOneRetry", CQRSHandlersShareOneRetry, false},
		{"CQRSWarmingHandlerNeverStallsItsQueue", CQRSWarmingHandlerNeverStallsItsQueue, false},
		{"MiswiredSubscriberIsRefusedAtSubscribe", MiswiredSubscriberIsRefusedAtSubscribe, true},
		{"PoisonQueueNamedLikeTheWorkQueue", PoisonQueueNamedLikeTheWorkQueue, true},
		{"HeldRetriesStartWithNoError", HeldRetriesStartWithNoError, true},
		{"PoisonQueueReadFromGo", PoisonQueueReadFromGo, true},
		{"OutageIsNotAPoison", OutageIsNotAPoison, false},
		{"OutageBeginsAtOnceOnUnavailableAndAnOpenBreaker", OutageBeginsAtOnceOnUnavailableAndAnOpenBreaker, false},
		{"CloseDuringAnOutageLosesNothing", CloseDuringAnOutageLosesNothing, false},
		{"OrderKeepsEachKeysOrder", OrderKeepsEachKeysOrder, true},
		{"OrderOtherKeysFlow", OrderOtherKeysFlow, false},
		{"OrderPoisonedHead", OrderPoisonedHead, false},
		{"OrderNeedsOneActiveConsumer", OrderNeedsOneActiveConsumer, true},
		{"DedupDropsDuplicatesNeverRetries", DedupDropsDuplicatesNeverRetries, false},
		{"MiddlewareMatrix", MiddlewareMatrix, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if testing.Short() && !tc.quick {
				t.Skip("not in the quick loop (go test -short); the test script runs it")
			}
			tc.test(t, m)
		})
	}
}

// logCapture is a logger that keeps every line, safe to read while the router logs
// (watermill's CaptureLoggerAdapter hands out its map unguarded).
type logCapture struct {
	mu    sync.Mutex
	lines []watermill.CapturedMessage
}

func (c *logCapture) capture(level watermill.LogLevel, msg string, err error, fields watermill.LogFields) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lines = append(c.lines, watermill.CapturedMessage{Level: level, Msg: msg, Err: err, Fields: fields.Copy()})
}

func (c *logCapture) Error(msg string, err error, f watermill.LogFields) {
	c.capture(watermill.ErrorLogLevel, msg, err, f)
}
func (c *logCapture) Info(msg string, f watermill.LogFields) {
	c.capture(watermill.InfoLogLevel, msg, nil, f)
}
func (c *logCapture) Debug(msg string, f watermill.LogFields) {
	c.capture(watermill.DebugLogLevel, msg, nil, f)
}
func (c *logCapture) Trace(msg string, f watermill.LogFields) {
	c.capture(watermill.TraceLogLevel, msg, nil, f)
}
func (c *logCapture) With(watermill.LogFields) watermill.LoggerAdapter { return c }

// at returns a copy of the lines logged at level.
func (c *logCapture) at(level watermill.LogLevel) []watermill.CapturedMessage {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []watermill.CapturedMessage
	for _, l := range c.lines {
		if l.Level == level {
			out = append(out, l)
		}
	}
	return out
}

// Logger is the tests' logger: silent unless AMQPRETRY_TEST_LOG is set.
func Logger() watermill.LoggerAdapter {
	if os.Getenv("AMQPRETRY_TEST_LOG") != "" {
		return watermill.NewStdLogger(true, false)
	}
	return watermill.NopLogger{}
}

// delivery is one call of a handler.
type delivery struct {
	at  time.Time
	msg *message.Message
}

// recorder is a handler that records every call and fails as fail says. Its settle
// middleware, put outside the retry middleware, counts the deliveries whose whole
// handling (hand-off or poisoning included) is over.
type recorder struct {
	mu      sync.Mutex
	calls   []delivery
	fail    func(msg *message.Message) error
	seen    chan struct{}
	settled chan struct{}
}

func newRecorder(fail func(msg *message.Message) error) *recorder {
	return &recorder{fail: fail, seen: make(chan struct{}, 10_000), settled: make(chan struct{}, 10_000)}
}

// settle is a middleware that reports each delivery once everything inside it returned.
func (r *recorder) settle(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		defer func() { r.settled <- struct{}{} }()
		return h(msg)
	}
}

// waitSettled waits until n deliveries were handled to the end. A retry or poisoning
// of them has then been handed off (and counted in Stats), so no sleep is needed to
// know that nothing more is on its way.
func (r *recorder) waitSettled(t *testing.T, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for i := range n {
		select {
		case <-r.settled:
		case <-deadline:
			t.Fatalf("%d of %d deliveries settled within %s", i, n, timeout)
		}
	}
}

func (r *recorder) handle(msg *message.Message) error {
	r.mu.Lock()
	r.calls = append(r.calls, delivery{at: time.Now(), msg: msg.Copy()})
	r.mu.Unlock()
	r.seen <- struct{}{}
	if r.fail != nil {
		return r.fail(msg)
	}
	return nil
}

func (r *recorder) snapshot() []delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// waitCalls waits for n calls in all.
func (r *recorder) waitCalls(t *testing.T, n int, timeout time.Duration) []delivery {
	t.Helper()
	deadline := time.After(timeout)
	for len(r.snapshot()) < n {
		select {
		case <-r.seen:
		case <-deadline:
			t.Fatalf("handler ran %d times within %s, want %d", len(r.snapshot()), timeout, n)
		}
	}
	return r.snapshot()
}

// wantStats fails unless r handed off exactly retries retries and poisoned exactly
// poisoned messages, with no failed hand-off: any further delivery of the message
// would need one of them.
func wantStats(t *testing.T, r Retry, retries, poisoned int64) {
	t.Helper()
	if st := r.Stats(); st.Retries != retries || st.Poisoned != poisoned || st.HandoffFailures != 0 {
		t.Errorf("stats %+v, want %d retries, %d poisoned, no failed hand-off", st, retries, poisoned)
	}
}

// attemptsByUUID lists the attempts each message was handled with.
func attemptsByUUID(calls []delivery) map[string][]int {
	out := map[string][]int{}
	for _, c := range calls {
		out[c.msg.UUID] = append(out[c.msg.UUID], amqpretry.Attempt(c.msg))
	}
	return out
}

// setup is one test's broker-side world: a unique prefix, topic and Config.
type setup struct {
	prefix string
	topic  string
	sub    Sub
	cfg    amqpretry.Config
}

func newSetup(t *testing.T, m Major, backend delay.Backend) setup {
	t.Helper()
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	s := setup{prefix: prefix, topic: prefix + ".work", sub: Sub{URI: brokertest.URI()}}
	if backend.Name() == (delay.Memory(nil)).Name() { // the scenarios give it no publisher
		backend = delay.Memory(m.Publisher(t, s.sub))
	}
	s.cfg = amqpretry.Config{
		Backend: withTiers(backend, 500*time.Millisecond, 2*time.Second, 4*time.Second),
		Prefix:  prefix,
		Logger:  Logger(),
	}
	brokertest.Cleanup(t, []string{s.topic, prefix + ".poison"}, nil)
	return s
}

// withTiers returns b with the given tiers if it is ttl-tiers, else b: the other
// backends have no tiers.
func withTiers(b delay.Backend, tiers ...time.Duration) delay.Backend {
	if b.Name() == (delay.TTLTiers()).Name() {
		return delay.TTLTiers(tiers...)
	}
	return b
}

// newRetry builds the Retry, skipping a backend this broker cannot run, and removes
// what it declared when the test ends.
func newRetry(t *testing.T, m Major, sub Sub, cfg amqpretry.Config) Retry {
	t.Helper()
	r, err := m.New(sub, cfg)
	if err != nil {
		if errors.Is(err, delay.ErrPluginMissing) || errors.Is(err, delay.ErrUnsupported) {
			t.Skipf("backend %s cannot run on this broker: %v", cfg.Backend, err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	if plan, err := cfg.Plan(); err == nil {
		brokertest.CleanupTopology(t, plan)
	}
	return r
}

// newRouter starts a router with the given router-wide middlewares once add has added
// its handlers.
func newRouter(t *testing.T, add func(*message.Router), middlewares ...message.HandlerMiddleware) {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, Logger())
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(middlewares...)
	add(router)
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() { _ = router.Close() })
}

// run starts a router with one handler on topic, retried by r, with extra handler
// middlewares outside r's.
func run(t *testing.T, m Major, r Retry, topic string, h message.NoPublishHandlerFunc, outer ...message.HandlerMiddleware) {
	t.Helper()
	sub := m.Subscriber(t, r)
	newRouter(t, func(router *message.Router) {
		router.AddConsumerHandler("handler-"+topic, topic, sub, h).AddMiddleware(append(outer, r.Middleware)...)
	})
}

func publish(t *testing.T, m Major, topic string, uuid string) {
	t.Helper()
	pub := m.Publisher(t, Sub{URI: brokertest.URI()})
	if err := pub.Publish(topic, message.NewMessage(uuid, []byte("payload of "+uuid))); err != nil {
		t.Fatal(err)
	}
}

var errFlaky = errors.New("flaky downstream")

// failFirst fails the first n attempts of every message.
func failFirst(n int) func(*message.Message) error {
	return func(msg *message.Message) error {
		if amqpretry.Attempt(msg) <= n {
			return errFlaky
		}
		return nil
	}
}

func poisoned(t *testing.T, queue string, timeout time.Duration) *message.Message {
	t.Helper()
	msg, err := xdeath.Marshaler{}.Unmarshal(poisonedDelivery(t, queue, timeout))
	if err != nil {
		t.Fatal(err)
	}
	return msg
}

// poisonedDelivery takes the next message from queue, as it is on the wire. The queue
// may not exist yet, or not be running yet (a test deleted it for the library to
// declare again).
func poisonedDelivery(t *testing.T, queue string, timeout time.Duration) amqp.Delivery {
	t.Helper()
	return poisonedFrom(t, brokertest.Dial, queue, timeout)
}

// poisonedFrom is poisonedDelivery through connections from dial.
func poisonedFrom(t *testing.T, dial func(testing.TB) *amqp.Connection, queue string, timeout time.Duration) amqp.Delivery {
	t.Helper()
	conn := dial(t)
	var ch *amqp.Channel
	defer func() {
		if ch != nil {
			_ = ch.Close()
		}
	}()
	deadline := time.Now().Add(timeout)
	for {
		var err error
		if ch == nil || ch.IsClosed() {
			if ch, err = conn.Channel(); err != nil {
				// The connection is closed, or about to be: a new one.
				conn = dial(t)
				if ch, err = conn.Channel(); err != nil {
					t.Fatal(err)
				}
			}
		}
		d, ok, err := ch.Get(queue, true)
		var amqpErr *amqp.Error
		// 404 (it closes the channel): not declared again yet. 541 noproc (it closes
		// the connection): declared again a moment ago, its quorum queue process not
		// started yet (RabbitMQ 3.10).
		notYet := errors.As(err, &amqpErr) && (amqpErr.Code == amqp.NotFound || amqpErr.Code == amqp.InternalError && strings.Contains(amqpErr.Reason, "noproc"))
		if notYet && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing in poison queue %s within %s", queue, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// brokerVersion is the version of the broker at AMQP_URI.
func brokerVersion(t *testing.T) string {
	t.Helper()
	v, _ := brokertest.Dial(t).Properties["version"].(string)
	return v
}

// hasLine tells whether logs has a line at level whose message and error contain the
// given texts.
func hasLine(logs *logCapture, level watermill.LogLevel, msg, errText string) bool {
	for _, l := range logs.at(level) {
		if strings.Contains(l.Msg, msg) && (errText == "" || l.Err != nil && strings.Contains(l.Err.Error(), errText)) {
			return true
		}
	}
	return false
}

// scheduler is the Retry's scheduler (internal/hooks): a publisher that parks a message
// in its backend until the delay its metadata asks. r is a transport package's Retry,
// which embeds the *middleware.Retry.
func scheduler(r Retry) message.Publisher {
	return hooks.Scheduler(reflect.ValueOf(r).Elem().FieldByName("Retry").Interface())
}
