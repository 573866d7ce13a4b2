package amqpretry_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
)

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

func testLogger() watermill.LoggerAdapter {
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
// of them has then been handed off (and counted in Retry.Stats), so no sleep is needed
// to know that nothing more is on its way.
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

// wantStats fails unless r handed off exactly retries retries and poisoned exactly
// poisoned messages, with no failed hand-off: any further delivery of the message would
// need one of them.
func wantStats(t *testing.T, r *amqpretry.Retry, retries, poisoned int64) {
	t.Helper()
	if st := r.Stats(); st.Retries != retries || st.Poisoned != poisoned || st.HandoffFailure != 0 {
		t.Errorf("stats %+v, want %d retries, %d poisoned, no failed hand-off", st, retries, poisoned)
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

// setup is one test's broker-side world: a unique prefix, topic and Config.
type setup struct {
	prefix string
	topic  string
	cfg    amqpretry.Config
}

func newSetup(t *testing.T, backend string) setup {
	t.Helper()
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	s := setup{prefix: prefix, topic: prefix + ".work"}
	s.cfg = amqpretry.Config{
		Subscriber: wamqp.NewDurableQueueConfig(brokertest.URI()),
		Delay: delay.Config{
			Backend: backend,
			Prefix:  prefix,
			Tiers:   []time.Duration{500 * time.Millisecond, 2 * time.Second, 4 * time.Second},
			Memory:  newQueuePublisher(t),
		},
		Logger: testLogger(),
	}
	brokertest.Cleanup(t, []string{s.topic, prefix + ".poison"}, nil)
	return s
}

func newQueuePublisher(t *testing.T) message.Publisher {
	t.Helper()
	pub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(brokertest.URI()), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// newRetry builds the Retry, skipping a backend this broker cannot run.
func newRetry(t *testing.T, cfg amqpretry.Config) *amqpretry.Retry {
	t.Helper()
	r, err := amqpretry.New(cfg)
	if err != nil {
		if errors.Is(err, delay.ErrPluginMissing) {
			t.Skipf("backend %s cannot run on this broker: %v", cfg.Delay.Backend, err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	brokertest.CleanupTopology(t, r.Backend().Topology())
	return r
}

// runRecorded is run with rec's handler, and rec's settle middleware outside r's.
func runRecorded(t *testing.T, r *amqpretry.Retry, topic string, rec *recorder) {
	t.Helper()
	runWith(t, r, topic, rec.handle, rec.settle)
}

// run starts a router with one consumer handler on topic, retried by r.
func run(t *testing.T, r *amqpretry.Retry, topic string, h message.NoPublishHandlerFunc) {
	t.Helper()
	runWith(t, r, topic, h)
}

// runWith is run with extra handler middlewares outside r's.
func runWith(t *testing.T, r *amqpretry.Retry, topic string, h message.NoPublishHandlerFunc, outer ...message.HandlerMiddleware) {
	t.Helper()
	sub, err := wamqp.NewSubscriber(r.SubscriberConfig(), testLogger())
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("handler-"+topic, topic, sub, h).AddMiddleware(append(outer, r.Middleware)...)
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() {
		_ = router.Close()
		_ = sub.Close()
	})
}

func publish(t *testing.T, topic string, uuid string) {
	t.Helper()
	pub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(brokertest.URI()), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Publish(topic, message.NewMessage(uuid, []byte("payload of "+uuid))); err != nil {
		t.Fatal(err)
	}
}

var errFlaky = errors.New("flaky downstream")

// TestScenarioFailThreeTimesThenSucceed is the retry scenario every backend must pass,
// changing only the backend name.
func TestScenarioFailThreeTimesThenSucceed(t *testing.T) {
	policyDelays := []time.Duration{300 * time.Millisecond, 1500 * time.Millisecond, 3 * time.Second}
	const precision = 1500 * time.Millisecond
	for _, backend := range delay.Backends() {
		t.Run(backend, func(t *testing.T) {
			s := newSetup(t, backend)
			s.cfg.Policy = middleware.Policy{MaxAttempts: 5, Delays: policyDelays}
			r := newRetry(t, s.cfg)
			rec := newRecorder(func(msg *message.Message) error {
				if middleware.Attempt(msg) <= 3 {
					return errFlaky
				}
				return nil
			})
			runRecorded(t, r, s.topic, rec)
			publish(t, s.topic, "m1")

			rec.waitSettled(t, 4, 30*time.Second)
			wantStats(t, r, 3, 0) // so no fifth delivery can come
			calls := rec.snapshot()
			if len(calls) != 4 {
				t.Fatalf("handled %d times, want 4", len(calls))
			}
			for i, c := range calls {
				if got := middleware.Attempt(c.msg); got != i+1 {
					t.Errorf("call %d saw attempt %d", i+1, got)
				}
				if c.msg.UUID != "m1" || string(c.msg.Payload) != "payload of m1" {
					t.Errorf("call %d got message %s %q", i+1, c.msg.UUID, c.msg.Payload)
				}
			}
			for i := 1; i < len(calls); i++ {
				want, err := r.Backend().Effective(policyDelays[i-1])
				if err != nil {
					t.Fatal(err)
				}
				md := calls[i].msg.Metadata
				if got := md.Get(middleware.EffectiveDelayKey); got != want.String() {
					t.Errorf("retry %d: effective delay %s, want %s (policy %s after snapping)", i, got, want, policyDelays[i-1])
				}
				gap := calls[i].at.Sub(calls[i-1].at)
				if gap < want-50*time.Millisecond || gap > want+precision {
					t.Errorf("retry %d came %s after the failure, want %s (+ up to %s)", i, gap, want, precision)
				}
			}
			if backend == delay.BackendTTLTiers {
				// The retries were dead-lettered by the broker (x-death is an array):
				// the subscriber consumed them instead of nacking them forever.
				info, err := xdeath.FromMetadata(calls[1].msg.Metadata)
				if err != nil {
					t.Fatal(err)
				}
				if len(info.Deaths) == 0 || info.Deaths[0].Reason != "expired" {
					t.Errorf("retry carries no expired x-death entry: %+v", info)
				}
			}
		})
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
// may not exist yet (a test deleted it for the library to declare again).
func poisonedDelivery(t *testing.T, queue string, timeout time.Duration) amqp.Delivery {
	t.Helper()
	conn := brokertest.Dial(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ch.Close() }()
	deadline := time.Now().Add(timeout)
	for {
		d, ok, err := ch.Get(queue, true)
		var amqpErr *amqp.Error
		if errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound && time.Now().Before(deadline) {
			if ch, err = conn.Channel(); err != nil { // the 404 closed the channel
				t.Fatal(err)
			}
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

func TestPoisonAfterMaxAttemptsWithEnvelope(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	s.cfg.Policy = middleware.Policy{MaxAttempts: 3, Delays: []time.Duration{500 * time.Millisecond}}
	r := newRetry(t, s.cfg)
	rec := newRecorder(func(*message.Message) error { return fmt.Errorf("charge card: %w", errFlaky) })
	run(t, r, s.topic, rec.handle)
	publish(t, s.topic, "doomed")

	msg := poisoned(t, s.prefix+".poison", 30*time.Second)
	if n := len(rec.snapshot()); n != 3 {
		t.Errorf("handled %d times before poisoning, want 3", n)
	}
	md := msg.Metadata
	for k, want := range map[string]string{
		middleware.PoisonReasonKey:       middleware.PoisonMaxAttempts,
		middleware.AttemptKey:            "3",
		middleware.MaxAttemptsKey:        "3",
		middleware.ErrorKey:              "charge card: flaky downstream",
		middleware.ErrorTypesKey:         "*fmt.wrapError > *errors.errorString",
		middleware.HandlerKey:            "handler-" + s.topic,
		middleware.TopicKey:              s.topic,
		middleware.QueueKey:              s.topic,
		middleware.OriginalExchangeKey:   "",
		middleware.OriginalRoutingKeyKey: s.topic,
	} {
		if got := md.Get(k); got != want {
			t.Errorf("envelope %s = %q, want %q", k, got, want)
		}
	}
	first, err1 := time.Parse(time.RFC3339Nano, md.Get(middleware.FirstFailureKey))
	last, err2 := time.Parse(time.RFC3339Nano, md.Get(middleware.LastFailureKey))
	if err := errors.Join(err1, err2); err != nil || !last.After(first) {
		t.Errorf("first/last failure %v / %v (%v)", first, last, err)
	}
	if msg.UUID != "doomed" || string(msg.Payload) != "payload of doomed" {
		t.Errorf("poisoned message is %s %q", msg.UUID, msg.Payload)
	}
	// Nothing of the last retry hop is left on it.
	for _, k := range []string{delay.TierHeader, middleware.DueKey, middleware.RequestedDelayKey, middleware.EffectiveDelayKey, wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
		if v, ok := md[k]; ok {
			t.Errorf("poisoned copy keeps %s = %q from its last retry", k, v)
		}
	}
}

func TestPermanentErrorPoisonsOnFirstFailure(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	r := newRetry(t, s.cfg)
	rec := newRecorder(func(*message.Message) error { return middleware.Permanent(errors.New("malformed order")) })
	runRecorded(t, r, s.topic, rec)
	publish(t, s.topic, "bad")

	msg := poisoned(t, s.prefix+".poison", 30*time.Second)
	if got := msg.Metadata.Get(middleware.PoisonReasonKey); got != middleware.PoisonPermanent {
		t.Errorf("reason %q, want permanent", got)
	}
	rec.waitSettled(t, 1, 10*time.Second)
	wantStats(t, r, 0, 1)
	if n := len(rec.snapshot()); n != 1 {
		t.Errorf("handled %d times, want 1", n)
	}
}

func TestRetryAfterIsHonoured(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	s.cfg.Policy = middleware.Policy{Delays: []time.Duration{time.Millisecond}}
	r := newRetry(t, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if middleware.Attempt(msg) == 1 {
			return middleware.RetryAfter(errors.New("429 too many requests"), 1800*time.Millisecond)
		}
		return nil
	})
	run(t, r, s.topic, rec.handle)
	publish(t, s.topic, "throttled")

	calls := rec.waitCalls(t, 2, 30*time.Second)
	md := calls[1].msg.Metadata
	if md.Get(middleware.RequestedDelayKey) != "1.8s" || md.Get(middleware.EffectiveDelayKey) != "2s" {
		t.Errorf("requested/effective = %s/%s, want 1.8s/2s", md.Get(middleware.RequestedDelayKey), md.Get(middleware.EffectiveDelayKey))
	}
	if gap := calls[1].at.Sub(calls[0].at); gap < 2*time.Second-50*time.Millisecond {
		t.Errorf("retry came back after %s, before the Retry-After", gap)
	}
}

// TestFanoutRetryReachesOnlyTheFailingQueue: a pub/sub topic with two subscriber
// queues; only one handler fails, and only its queue sees the retry.
func TestFanoutRetryReachesOnlyTheFailingQueue(t *testing.T) {
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	topic := prefix + ".events"
	recs := map[string]*recorder{}
	retries := map[string]*amqpretry.Retry{}
	for _, group := range []string{"billing", "shipping"} {
		sub := wamqp.NewDurablePubSubConfig(brokertest.URI(), wamqp.GenerateQueueNameTopicNameWithSuffix(group))
		r := newRetry(t, amqpretry.Config{
			Subscriber: sub,
			Delay:      delay.Config{Prefix: prefix, Tiers: []time.Duration{500 * time.Millisecond}},
			Logger:     testLogger(),
		})
		fails := group == "billing"
		recs[group] = newRecorder(func(msg *message.Message) error {
			if fails && middleware.Attempt(msg) == 1 {
				return errFlaky
			}
			return nil
		})
		retries[group] = r
		runRecorded(t, r, topic, recs[group])
		brokertest.Cleanup(t, []string{topic + "_" + group}, nil)
	}
	brokertest.Cleanup(t, []string{prefix + ".poison"}, []string{topic})

	pub, err := wamqp.NewPublisher(wamqp.NewDurablePubSubConfig(brokertest.URI(), nil), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Publish(topic, message.NewMessage("evt", nil)); err != nil {
		t.Fatal(err)
	}
	recs["billing"].waitSettled(t, 2, 30*time.Second)
	recs["shipping"].waitSettled(t, 1, 30*time.Second)
	wantStats(t, retries["billing"], 1, 0)
	wantStats(t, retries["shipping"], 0, 0)
	if n := brokertest.QueueLength(t, prefix+".delay.500ms"); n != 0 {
		t.Errorf("%d retries still waiting", n)
	}
	if n := len(recs["billing"].snapshot()); n != 2 {
		t.Errorf("billing handled %d times, want 2", n)
	}
	if n := len(recs["shipping"].snapshot()); n != 1 {
		t.Errorf("shipping handled %d times, want 1: a retry leaked to another subscriber group", n)
	}
}

// TestDeletedDelayExchangeIsDeclaredAgainAtTheFirstHandoff removes the delay exchange
// under a running router: the first hand-off finds it gone (404), declares the
// backend's topology again and goes through, so the message is retried once, as if
// nothing had happened, and nothing is parked.
func TestDeletedDelayExchangeIsDeclaredAgainAtTheFirstHandoff(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	s.cfg.Policy = middleware.Policy{Delays: []time.Duration{500 * time.Millisecond}}
	r := newRetry(t, s.cfg)

	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDelete(s.prefix+".delay", false, false); err != nil {
		t.Fatal(err)
	}

	rec := newRecorder(func(msg *message.Message) error {
		if middleware.Attempt(msg) == 1 {
			return errFlaky
		}
		return nil
	})
	run(t, r, s.topic, rec.handle)
	publish(t, s.topic, "survivor")

	calls := rec.waitCalls(t, 2, 30*time.Second)
	for i, c := range calls {
		if got := middleware.Attempt(c.msg); got != i+1 {
			t.Errorf("call %d saw attempt %d, want %d", i+1, got, i+1)
		}
	}
	if err := ch.ExchangeDeclarePassive(s.prefix+".delay", amqp.ExchangeHeaders, true, false, false, false, nil); err != nil {
		t.Errorf("delay exchange not declared again: %v", err)
	}
	if n := brokertest.QueueLength(t, s.prefix+".parking"); n != 0 {
		t.Errorf("%d messages parked", n)
	}
}

func TestTopologyClashNamesQueueAndArgument(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	clash := s.prefix + ".delay.500ms"
	if _, err := ch.QueueDeclare(clash, true, false, false, false, amqp.Table{"x-message-ttl": int32(1234)}); err != nil {
		t.Fatal(err)
	}
	brokertest.Cleanup(t, []string{clash, s.prefix + ".parking"}, []string{s.prefix + ".delay", s.prefix + ".deliver", s.prefix + ".parking"})
	_, err = amqpretry.New(s.cfg)
	if !errors.Is(err, topology.ErrMismatch) {
		t.Fatalf("New = %v, want ErrMismatch", err)
	}
	for _, want := range []string{clash, "x-message-ttl"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
}

func TestCredentialsNeverInErrors(t *testing.T) {
	for _, uri := range []string{
		"amqp://guest:s3cr3t@127.0.0.1:1/",        // nothing listens
		"amqp://guest:s3cr3t@127.0.0.1:notaport/", // unparseable
		"amqp//guest:s3cr3t@127.0.0.1/",           // no scheme: url.Parse takes it for a path
	} {
		_, err := amqpretry.New(amqpretry.Config{Subscriber: wamqp.NewDurableQueueConfig(uri)})
		if err == nil {
			t.Fatalf("New(%s) succeeded", uri)
		}
		if strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("error leaks the password: %v", err)
		}
	}
}

func TestInvalidConfigNamesTheField(t *testing.T) {
	uri := "amqp://guest:guest@127.0.0.1:1/" // validation fails before any dial
	queueCfg := wamqp.NewDurableQueueConfig(uri)
	noRequeue := queueCfg
	noRequeue.Consume.NoRequeueOnNack = true
	tests := []struct {
		name  string
		cfg   amqpretry.Config
		field string
	}{
		{"no broker", amqpretry.Config{}, "Subscriber.Connection.AmqpURI"},
		{"no requeue", amqpretry.Config{Subscriber: noRequeue}, "Subscriber.Consume.NoRequeueOnNack"},
		{"bad policy", amqpretry.Config{Subscriber: queueCfg, Policy: middleware.Policy{MaxAttempts: -1}}, "MaxAttempts"},
		{"unknown backend", amqpretry.Config{Subscriber: queueCfg, Delay: delay.Config{Backend: "carrier-pigeon"}}, "Backend"},
		{"duplicate tier", amqpretry.Config{Subscriber: queueCfg, Delay: delay.Config{Tiers: []time.Duration{time.Second, time.Second}}}, "Tiers[1]"},
		{"empty tiers", amqpretry.Config{Subscriber: queueCfg, Delay: delay.Config{Tiers: []time.Duration{}}}, "Tiers: empty"},
		{"prefix too long", amqpretry.Config{Subscriber: queueCfg, Delay: delay.Config{Prefix: strings.Repeat("p", 250)}}, "Prefix"},
		{"poison queue too long", amqpretry.Config{Subscriber: queueCfg, PoisonQueue: strings.Repeat("q", 256)}, "PoisonQueue"},
		{"policy past the backend", amqpretry.Config{Subscriber: queueCfg, Delay: delay.Config{Backend: delay.BackendBinaryLevels, Levels: 3}}, "Policy: longest delay"},
		{"memory without publisher", amqpretry.Config{Delay: delay.Config{Backend: delay.BackendMemory}}, "Memory"},
		{"negative confirm timeout", amqpretry.Config{Subscriber: queueCfg, ConfirmTimeout: -time.Second}, "ConfirmTimeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := amqpretry.New(tt.cfg)
			if err == nil || !strings.Contains(err.Error(), "invalid config") || !strings.Contains(err.Error(), tt.field) {
				t.Fatalf("New = %v, want an invalid config error naming %s", err, tt.field)
			}
		})
	}
}

// TestInvalidConfigTouchesNothingOnTheBroker: a policy the backend cannot hold is
// refused before New connects, so no queue or exchange is declared.
func TestInvalidConfigTouchesNothingOnTheBroker(t *testing.T) {
	s := newSetup(t, delay.BackendBinaryLevels)
	s.cfg.Delay.Levels = 4 // holds up to 15 s
	s.cfg.Policy = middleware.Policy{Delays: []time.Duration{time.Second, 20 * time.Second}}
	_, err := amqpretry.New(s.cfg)
	if !errors.Is(err, delay.ErrDelayTooLong) || !strings.Contains(err.Error(), "invalid config: Policy") || !strings.Contains(err.Error(), "20s") {
		t.Fatalf("New = %v, want an invalid config error naming Policy and the 20s delay", err)
	}
	conn := brokertest.Dial(t)
	for _, q := range []string{s.prefix + ".poison", s.prefix + ".parking", s.prefix + ".level.0", s.prefix + ".level.3"} {
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDeclarePassive(q, true, false, false, false, nil); err == nil {
			t.Errorf("queue %s was declared by an invalid config", q)
			brokertest.Cleanup(t, []string{q}, nil)
		}
	}
}

func TestLowDeliveryLimitOnQuorumWorkQueueIsWarned(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	logs := &logCapture{}
	s.cfg.Logger = logs
	s.cfg.Subscriber.Queue.Arguments = amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(2)}
	newRetry(t, s.cfg)
	for _, m := range logs.at(watermill.ErrorLogLevel) {
		if m.Msg == "Work queues may lose retries" && strings.Contains(m.Err.Error(), "x-delivery-limit 2") {
			return
		}
	}
	t.Fatalf("no warning about x-delivery-limit 2 below 5 attempts; error logs: %+v", logs.at(watermill.ErrorLogLevel))
}
