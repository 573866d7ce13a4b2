package amqpretry_test

// Tests of the library's own failure modes on the real broker: mis-wiring fails loudly,
// every failure path has an exit (no hot loop, a canary behind a bad message flows),
// and a bad message ends in exactly one place.

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
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
	"github.com/amqpretry/amqpretry/xdeath"
)

// newRouter starts a router with the given router-wide middlewares once setup has
// added its handlers.
func newRouter(t *testing.T, setup func(*message.Router), middlewares ...message.HandlerMiddleware) {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(middlewares...)
	setup(router)
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() { _ = router.Close() })
}

// attemptsByUUID lists the attempts each message was handled with.
func attemptsByUUID(calls []delivery) map[string][]int {
	out := map[string][]int{}
	for _, c := range calls {
		out[c.msg.UUID] = append(out[c.msg.UUID], middleware.Attempt(c.msg))
	}
	return out
}

// TestRouterWideMiddlewaresOfTwoGroupsEachRetryTheirOwn: two subscriber groups on one
// fanout topic, each with its own Retry (sharing a prefix), both middlewares added
// router-wide in either order, or each group wired by AddHandler. Every group sees each
// event on attempts 1 and 2 only: no retry goes to the other group's queue.
func TestRouterWideMiddlewaresOfTwoGroupsEachRetryTheirOwn(t *testing.T) {
	for _, wiring := range []string{"router-wide billing first", "router-wide shipping first", "AddHandler"} {
		t.Run(wiring, func(t *testing.T) {
			brokertest.Dial(t)
			prefix := brokertest.Prefix(t)
			topic := prefix + ".events"
			groups := []string{"billing", "shipping"}
			if wiring == "router-wide shipping first" {
				groups = []string{"shipping", "billing"}
			}
			retries := map[string]*amqpretry.Retry{}
			recs := map[string]*recorder{}
			for _, group := range groups {
				retries[group] = newRetry(t, amqpretry.Config{
					Subscriber: wamqp.NewDurablePubSubConfig(brokertest.URI(), wamqp.GenerateQueueNameTopicNameWithSuffix(group)),
					Delay:      delay.Config{Prefix: prefix, Tiers: []time.Duration{500 * time.Millisecond}},
					Logger:     testLogger(),
				})
				recs[group] = newRecorder(func(msg *message.Message) error {
					if middleware.Attempt(msg) == 1 {
						return errFlaky
					}
					return nil
				})
				brokertest.Cleanup(t, []string{topic + "_" + group}, nil)
			}
			brokertest.Cleanup(t, []string{prefix + ".poison"}, []string{topic})

			// Outermost, each group's recorder learns when a delivery is handled to the end.
			routerWide := []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					return recs[message.HandlerNameFromCtx(msg.Context())].settle(h)(msg)
				}
			}}
			newRouter(t, func(router *message.Router) {
				for _, group := range groups {
					r := retries[group]
					if wiring == "AddHandler" {
						if _, err := r.AddHandler(router, group, topic, recs[group].handle); err != nil {
							t.Fatal(err)
						}
						continue
					}
					sub, err := wamqp.NewSubscriber(r.SubscriberConfig(), testLogger())
					if err != nil {
						t.Fatal(err)
					}
					router.AddConsumerHandler(group, topic, sub, recs[group].handle)
					routerWide = append(routerWide, r.Middleware)
				}
				router.AddMiddleware(routerWide...)
			})

			pub, err := wamqp.NewPublisher(wamqp.NewDurablePubSubConfig(brokertest.URI(), nil), watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			defer pub.Close()
			const events = 5
			for i := range events {
				if err := pub.Publish(topic, message.NewMessage(fmt.Sprintf("order-%d", i), nil)); err != nil {
					t.Fatal(err)
				}
			}
			for _, group := range groups {
				recs[group].waitSettled(t, 2*events, 30*time.Second)
				wantStats(t, retries[group], events, 0) // so no third delivery can come
			}
			for _, group := range groups {
				got := attemptsByUUID(recs[group].snapshot())
				if len(got) != events {
					t.Errorf("%s handled %d distinct events, want %d", group, len(got), events)
				}
				for uuid, attempts := range got {
					if !slices.Equal(attempts, []int{1, 2}) {
						t.Errorf("%s handled %s on attempts %v, want [1 2]", group, uuid, attempts)
					}
				}
			}
			if n := brokertest.QueueLength(t, prefix+".parking"); n != 0 {
				t.Errorf("%d retries parked", n)
			}
		})
	}
}

// TestSubscriberNotBuiltFromSubscriberConfigFailsLoudly: a subscriber built from the
// application's own watermill-amqp config, not SubscriberConfig(). The retry cannot be
// routed back, so it is not parked: each failure is logged at ERROR with ErrNotWired
// and the fix, the message is nacked with a growing pause, and after HandoffAttempts it
// is poisoned with that error. A canary behind it is handled meanwhile.
func TestSubscriberNotBuiltFromSubscriberConfigFailsLoudly(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	logs := &logCapture{}
	s.cfg.Logger = logs
	r := newRetry(t, s.cfg)

	own := wamqp.NewDurableQueueConfig(brokertest.URI())
	own.Marshaler = xdeath.Marshaler{} // reads dead-lettered messages, but is not the Retry's
	sub, err := wamqp.NewSubscriber(own, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "canary" {
			return nil
		}
		return errFlaky
	})
	newRouter(t, func(router *message.Router) {
		router.AddConsumerHandler("orders", s.topic, sub, rec.handle)
	}, r.Middleware)
	publish(t, s.topic, "misrouted")
	publish(t, s.topic, "canary")

	d := poisonedDelivery(t, s.prefix+".poison", 30*time.Second)
	msg, err := xdeath.Marshaler{}.Unmarshal(d)
	if err != nil {
		t.Fatal(err)
	}
	if msg.UUID != "misrouted" || msg.Metadata.Get(middleware.PoisonReasonKey) != middleware.PoisonHandoffFailed {
		t.Errorf("poisoned %s with reason %q, want misrouted, handoff-failed", msg.UUID, msg.Metadata.Get(middleware.PoisonReasonKey))
	}
	if e := msg.Metadata.Get(middleware.ErrorKey); !strings.Contains(e, "SubscriberConfig()") || !strings.Contains(e, "AddHandler") {
		t.Errorf("poisoned error %q does not name the fix", e)
	}
	got := attemptsByUUID(rec.snapshot())
	if n := len(got["misrouted"]); n != middleware.DefaultHandoffAttempts {
		t.Errorf("handler ran %d times for the misrouted message, want %d", n, middleware.DefaultHandoffAttempts)
	}
	if n := len(got["canary"]); n != 1 {
		t.Errorf("canary handled %d times, want 1", n)
	}
	notWired := 0
	for _, l := range logs.at(watermill.ErrorLogLevel) {
		if errors.Is(l.Err, middleware.ErrNotWired) {
			notWired++
		}
	}
	if notWired != middleware.DefaultHandoffAttempts {
		t.Errorf("%d ERROR lines with ErrNotWired, want %d", notWired, middleware.DefaultHandoffAttempts)
	}
	for _, q := range []string{s.prefix + ".parking", s.prefix + ".delay.500ms", s.topic} {
		if n := brokertest.QueueLength(t, q); n != 0 {
			t.Errorf("%d messages left in %s", n, q)
		}
	}
}

// TestDeletedPoisonQueueIsDeclaredAgain: the poison queue is deleted while the router
// runs. The first poisoning is returned unroutable, declares the queue again and goes
// through: the handler runs once, no hot loop, and a canary flows.
func TestDeletedPoisonQueueIsDeclaredAgain(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	r := newRetry(t, s.cfg)
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDelete(r.PoisonQueue(), false, false, false); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "canary" {
			return nil
		}
		return middleware.Permanent(errors.New("malformed order"))
	})
	run(t, r, s.topic, rec.handle)
	publish(t, s.topic, "bad")
	publish(t, s.topic, "canary")

	msg := poisoned(t, r.PoisonQueue(), 30*time.Second)
	if msg.UUID != "bad" {
		t.Errorf("poisoned %s, want bad", msg.UUID)
	}
	rec.waitCalls(t, 2, 10*time.Second)
	if got := attemptsByUUID(rec.snapshot()); len(got["bad"]) != 1 || len(got["canary"]) != 1 {
		t.Errorf("handled %v, want bad and canary once each", got)
	}
}

// TestHandoffThatKeepsFailingBacksOffThenPoisons: a broker policy makes the tier queue
// reject publishes while it holds a message (max-length 0, reject-publish), and a
// message waits there, so each hand-off is nacked. The failing message is not
// redelivered at wire speed: it runs HandoffAttempts times with growing pauses, then
// lands in the poison queue, once, while a canary is handled.
func TestHandoffThatKeepsFailingBacksOffThenPoisons(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	s.cfg.Delay.Tiers = []time.Duration{10 * time.Second}
	s.cfg.Policy = middleware.Policy{Delays: []time.Duration{10 * time.Second}}
	r := newRetry(t, s.cfg)
	ctx := context.Background()
	if out, err := brokertest.Ctl(ctx, "-q", "status"); err != nil {
		if brokertest.CI() {
			t.Fatalf("rabbitmqctl is needed to set a policy: %v\n%s", err, out)
		}
		t.Skipf("rabbitmqctl is needed to set a policy: %v", err)
	}
	policy := strings.ReplaceAll(s.prefix, ".", "-") + "-full"
	pattern := "^" + strings.ReplaceAll(s.prefix, ".", `\.`) + `\.delay\.10s$`
	if out, err := brokertest.Ctl(ctx, "set_policy", "--apply-to", "queues", policy, pattern, `{"max-length":0,"overflow":"reject-publish"}`); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Cleanup(func() { _, _ = brokertest.Ctl(ctx, "clear_policy", policy) })
	brokertest.Cleanup(t, []string{s.prefix + ".parking"}, nil)
	// One message in the tier puts it over its limit of 0 for 10 s (it is parked
	// after). The policy applies asynchronously: publish until the tier refuses one.
	for i := 0; ; i++ {
		blocker := message.NewMessage(fmt.Sprintf("blocker-%d", i), nil)
		wdelay.Message(blocker, wdelay.For(10*time.Second))
		if err := r.Backend().Publish(s.prefix+".nowhere", blocker); err != nil {
			break // refused: the tier is full
		}
		if i == 50 {
			t.Fatal("the tier queue still takes publishes 10 s after its max-length 0 policy")
		}
		time.Sleep(200 * time.Millisecond)
	}

	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "canary" {
			return nil
		}
		return errFlaky
	})
	runRecorded(t, r, s.topic, rec)
	start := time.Now()
	publish(t, s.topic, "stuck")
	publish(t, s.topic, "canary")

	msg := poisoned(t, r.PoisonQueue(), 30*time.Second)
	took := time.Since(start)
	if msg.UUID != "stuck" || msg.Metadata.Get(middleware.PoisonReasonKey) != middleware.PoisonHandoffFailed {
		t.Errorf("poisoned %s (%s), want stuck (handoff-failed)", msg.UUID, msg.Metadata.Get(middleware.PoisonReasonKey))
	}
	if e := msg.Metadata.Get(middleware.ErrorKey); !strings.Contains(e, "not confirmed") || !strings.Contains(e, errFlaky.Error()) {
		t.Errorf("poisoned error %q lacks the hand-off and handler errors", e)
	}
	got := attemptsByUUID(rec.snapshot())
	if n := len(got["stuck"]); n != middleware.DefaultHandoffAttempts {
		t.Errorf("handler ran %d times for the stuck message, want %d", n, middleware.DefaultHandoffAttempts)
	}
	if n := len(got["canary"]); n != 1 {
		t.Errorf("canary handled %d times, want 1", n)
	}
	// The pauses between attempts add up to 100+200+400+800 ms: no wire-speed loop.
	if took < 1500*time.Millisecond {
		t.Errorf("poisoned after %s: the failed hand-offs did not pause", took)
	}
	// Five deliveries of the stuck message and the canary's, handled to the end: one
	// poisoning, five failed hand-offs, no retry, so nothing more can come.
	rec.waitSettled(t, middleware.DefaultHandoffAttempts+1, 10*time.Second)
	if st := r.Stats(); st.Poisoned != 1 || st.HandoffFailure != middleware.DefaultHandoffAttempts || st.Retries != 0 {
		t.Errorf("stats %+v, want 1 poisoned after %d failed hand-offs", st, middleware.DefaultHandoffAttempts)
	}
	if n := brokertest.QueueLength(t, r.PoisonQueue()); n != 0 {
		t.Errorf("%d more messages in the poison queue, want the one taken", n)
	}
}

// publishRaw publishes a message with the given headers straight through amqp091-go,
// as a producer outside Watermill would.
func publishRaw(t *testing.T, queue, uuid string, headers amqp.Table) {
	t.Helper()
	brokertest.QueueLength(t, queue) // fails if the subscriber has not declared it
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	h := amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: uuid}
	for k, v := range headers {
		h[k] = v
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", queue, true, false,
		amqp.Publishing{Headers: h, Body: []byte("payload of " + uuid), DeliveryMode: amqp.Persistent})
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := dc.WaitContext(context.Background()); !ok || err != nil {
		t.Fatalf("publish of %s not confirmed: %v", uuid, err)
	}
}

// nestedTable returns v inside n tables.
func nestedTable(n int, v interface{}) interface{} {
	for range n {
		v = amqp.Table{"k": v}
	}
	return v
}

// TestUndecodableHeadersReachTheHandlerAndSurviveEveryHop: headers the typed encoding
// cannot carry (a non-UTF-8 name with a non-string value, nesting deeper than 64) no
// longer make Unmarshal fail, which watermill-amqp answered with an endless nack. The
// message reaches the handler, is retried, and its poisoned copy carries the headers
// exactly as they were published. A canary behind it flows.
func TestUndecodableHeadersReachTheHandlerAndSurviveEveryHop(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	s.cfg.Policy = middleware.Policy{MaxAttempts: 2, Delays: []time.Duration{500 * time.Millisecond}}
	r := newRetry(t, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "canary" {
			return nil
		}
		return errFlaky
	})
	run(t, r, s.topic, rec.handle)
	odd := amqp.Table{"\xff\xfe": int64(7), "deep": nestedTable(70, int32(1)), "plain": "kept"}
	publishRaw(t, s.topic, "odd", odd)
	publishRaw(t, s.topic, "canary", nil)

	d := poisonedDelivery(t, r.PoisonQueue(), 30*time.Second)
	for k, want := range odd {
		if got := d.Headers[k]; !reflect.DeepEqual(got, want) {
			t.Errorf("poisoned header %q = %#v, want %#v", k, got, want)
		}
	}
	got := attemptsByUUID(rec.snapshot())
	if !slices.Equal(got["odd"], []int{1, 2}) || len(got["canary"]) != 1 {
		t.Errorf("handled %v, want odd on attempts [1 2] and canary once", got)
	}
	for _, c := range rec.snapshot() {
		if c.msg.UUID == "odd" && c.msg.Metadata.Get(xdeath.RawHeadersKey) == "" {
			t.Errorf("attempt %d reached the handler without its raw headers", middleware.Attempt(c.msg))
		}
	}
}

// TestHeadersNearFrameMaxArePoisonedWithTheHeadersThatFit: a message whose header is
// just under frame_max is accepted from its producer, but its retry copy, with the
// failure envelope, would not fit in one frame: the broker would close the hand-off
// connection shared by every hand-off. The copy is never sent: the envelope is
// trimmed, then the message is poisoned without the oversized header, which is named.
// Other hand-offs keep working: a canary fails once and is retried.
func TestHeadersNearFrameMaxArePoisonedWithTheHeadersThatFit(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	s.cfg.Policy = middleware.Policy{Delays: []time.Duration{500 * time.Millisecond}}
	r := newRetry(t, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "canary" && middleware.Attempt(msg) > 1 {
			return nil
		}
		return errFlaky
	})
	run(t, r, s.topic, rec.handle)
	big := strings.Repeat("b", 130_900) // frame_max 131,072: fits alone, not with an envelope
	publishRaw(t, s.topic, "huge", amqp.Table{"big": big, "small": "kept"})
	publishRaw(t, s.topic, "canary", nil)

	msg := poisoned(t, r.PoisonQueue(), 30*time.Second)
	md := msg.Metadata
	if msg.UUID != "huge" || md.Get(middleware.PoisonReasonKey) != middleware.PoisonTooLarge {
		t.Fatalf("poisoned %s (%s), want huge (too-large)", msg.UUID, md.Get(middleware.PoisonReasonKey))
	}
	if _, ok := md["big"]; ok {
		t.Error("the oversized header was kept")
	}
	if got := md.Get(middleware.DroppedHeadersKey); got != "big (130903 bytes)" {
		t.Errorf("%s = %q", middleware.DroppedHeadersKey, got)
	}
	if md.Get("small") != "kept" || !strings.Contains(md.Get(middleware.ErrorKey), "frame_max") {
		t.Errorf("poisoned copy lost a header that fits or the reason: %v", md)
	}
	calls := rec.waitCalls(t, 3, 30*time.Second)
	if got := attemptsByUUID(calls); len(got["huge"]) != 1 || !slices.Equal(got["canary"], []int{1, 2}) {
		t.Errorf("handled %v, want huge once and canary on attempts [1 2]", got)
	}
}

// TestPoisoningIsLoggedAtError: watermill.LoggerAdapter has no WARN level, so a
// poisoning is logged at ERROR (alerting on errors sees it; a logger with a Warn
// method gets it at WARN), and Close logs what the Retry did.
func TestPoisoningIsLoggedAtError(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	logs := &logCapture{}
	s.cfg.Logger = logs
	r := newRetry(t, s.cfg)
	run(t, r, s.topic, func(*message.Message) error { return middleware.Permanent(errors.New("malformed")) })
	publish(t, s.topic, "bad")
	poisoned(t, r.PoisonQueue(), 30*time.Second)
	// The broker may deliver the poisoned copy before the middleware has read its
	// confirm and logged.
	found := false
	for deadline := time.Now().Add(5 * time.Second); !found && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		for _, l := range logs.at(watermill.ErrorLogLevel) {
			found = found || l.Msg == "Message poisoned" && l.Fields["poison_reason"] == middleware.PoisonPermanent
		}
	}
	if !found {
		t.Errorf("no ERROR line for the poisoning: %+v", logs.at(watermill.ErrorLogLevel))
	}
	// Close sums up.
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	for _, l := range logs.at(watermill.InfoLogLevel) {
		if l.Msg == "Broker-side retry closed" {
			if l.Fields["poisoned"] != int64(1) || l.Fields["retries"] != int64(0) || l.Fields["handoff_failures"] != int64(0) {
				t.Errorf("summary %v, want 1 poisoned and nothing else", l.Fields)
			}
			return
		}
	}
	t.Error("no summary line at Close")
}

// TestTraceContextSurvivesRetryAndPoison: W3C trace context in the metadata travels
// with every retry and with the poisoned copy, so a trace spans the whole story.
func TestTraceContextSurvivesRetryAndPoison(t *testing.T) {
	s := newSetup(t, delay.BackendTTLTiers)
	s.cfg.Policy = middleware.Policy{MaxAttempts: 2, Delays: []time.Duration{500 * time.Millisecond}}
	r := newRetry(t, s.cfg)
	rec := newRecorder(func(*message.Message) error { return errFlaky })
	run(t, r, s.topic, rec.handle)
	const traceparent, tracestate = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "vendor=opaque"
	pub := newQueuePublisher(t)
	msg := message.NewMessage("traced", nil)
	msg.Metadata.Set("traceparent", traceparent)
	msg.Metadata.Set("tracestate", tracestate)
	if err := pub.Publish(s.topic, msg); err != nil {
		t.Fatal(err)
	}
	poisonedMsg := poisoned(t, r.PoisonQueue(), 30*time.Second)
	calls := rec.waitCalls(t, 2, 10*time.Second)
	for i, m := range []*message.Message{calls[0].msg, calls[1].msg, poisonedMsg} {
		if m.Metadata.Get("traceparent") != traceparent || m.Metadata.Get("tracestate") != tracestate {
			t.Errorf("hop %d lost the trace context: %q %q", i, m.Metadata.Get("traceparent"), m.Metadata.Get("tracestate"))
		}
	}
}
