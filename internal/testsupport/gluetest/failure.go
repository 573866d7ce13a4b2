package gluetest

// Tests of the library's own failure modes on the real broker: mis-wiring fails loudly,
// every failure path has an exit (no hot loop, a canary behind a bad message flows),
// and a bad message ends in exactly one place.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

// handoffAttempts is how many hand-offs may fail in a row before a message is poisoned.
const handoffAttempts = backend.HandoffAttempts

// RouterWideMiddlewaresOfTwoGroupsEachRetryTheirOwn: two subscriber groups on one
// fanout topic, each with its own Retry (sharing a prefix), both middlewares added
// router-wide in either order, or each group wired by AddHandler. Every group sees each
// event on attempts 1 and 2 only: no retry goes to the other group's queue.
func RouterWideMiddlewaresOfTwoGroupsEachRetryTheirOwn(t *testing.T, m Major) {
	for _, wiring := range []string{"router-wide billing first", "router-wide shipping first", "AddHandler"} {
		t.Run(wiring, func(t *testing.T) {
			brokertest.Dial(t)
			prefix := brokertest.Prefix(t)
			topic := prefix + ".events"
			groups := []string{"billing", "shipping"}
			if wiring == "router-wide shipping first" {
				groups = []string{"shipping", "billing"}
			}
			retries := map[string]Retry{}
			recs := map[string]*recorder{}
			for _, group := range groups {
				retries[group] = newRetry(t, m, Sub{URI: brokertest.URI(), Group: group},
					amqpretry.Config{Prefix: prefix, Backend: delay.TTLTiers(500 * time.Millisecond), Policy: amqpretry.Policy{Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}, Logger: Logger()})
				recs[group] = newRecorder(failFirst(1))
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
					router.AddConsumerHandler(group, topic, m.Subscriber(t, r), recs[group].handle)
					routerWide = append(routerWide, r.Middleware)
				}
				router.AddMiddleware(routerWide...)
			})

			pub := m.Publisher(t, Sub{URI: brokertest.URI(), Group: "publisher"})
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

// SubscriberNotBuiltFromSubscriberConfigIsPoisonedAtOnce: a subscriber built from the
// application's own watermill-amqp config, not SubscriberConfig(), under the Retry's
// router-level middleware (issue 51). The retry cannot be routed back, at this
// delivery as at any other, so the message is poisoned at its first failure, reason
// handoff-failed, its envelope naming ErrNotWired's fix: the handler runs once, and
// one line is logged at ERROR (the router's logger shares the Retry's: no "Handler
// returned error" either). A canary behind it is handled.
func SubscriberNotBuiltFromSubscriberConfigIsPoisonedAtOnce(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	logs := &logCapture{}
	s.cfg.Logger = logs
	r := newRetry(t, m, s.sub, s.cfg)
	sub := m.PlainSubscriber(t, s.sub) // reads dead-lettered messages, but is not the Retry's
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "canary" {
			return nil
		}
		return errFlaky
	})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logs)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(r.Middleware)
	router.AddConsumerHandler("orders", s.topic, sub, rec.handle)
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() { _ = router.Close() })
	publish(t, m, s.topic, "misrouted")
	publish(t, m, s.topic, "canary")

	msg := poisoned(t, s.prefix+".poison", 30*time.Second)
	env := middleware.ReadEnvelope(msg.Metadata)
	if msg.UUID != "misrouted" || env.Reason != amqpretry.ReasonHandoffFailed || env.Attempt != 1 {
		t.Errorf("poisoned %s with reason %q at attempt %d, want misrouted, handoff-failed, 1", msg.UUID, env.Reason, env.Attempt)
	}
	for _, want := range []string{amqpretry.ErrNotWired.Error(), "SubscriberConfig()", "AddHandler", errFlaky.Error()} {
		if !strings.Contains(env.Error, want) {
			t.Errorf("poisoned error %q does not say %s", env.Error, want)
		}
	}
	rec.waitCalls(t, 2, 10*time.Second)
	got := attemptsByUUID(rec.snapshot())
	if n := len(got["misrouted"]); n != 1 {
		t.Errorf("handler ran %d times for the misrouted message, want once", n)
	}
	if n := len(got["canary"]); n != 1 {
		t.Errorf("canary handled %d times, want 1", n)
	}
	errs := logs.at(watermill.ErrorLogLevel)
	if len(errs) != 1 || !errors.Is(errs[0].Err, amqpretry.ErrNotWired) || !errors.Is(errs[0].Err, errFlaky) {
		t.Errorf("%d ERROR lines, want one with ErrNotWired and the handler's error: %+v", len(errs), errs)
	}
	if st := r.Stats(); st.Poisoned != 1 || st.Retries != 0 {
		t.Errorf("stats %+v, want 1 poisoned, no retry", st)
	}
	for _, q := range []string{s.prefix + ".parking", s.prefix + ".delay.500ms", s.topic} {
		if n := brokertest.QueueLength(t, q); n != 0 {
			t.Errorf("%d messages left in %s", n, q)
		}
	}
}

// SubscriberWithoutTheMiddlewareIsRefusedNotLooped: a subscriber built from
// SubscriberConfig() whose handler has no middleware of the Retry anywhere (issue 51:
// its failing handler ran 8,189 times in 3 s). Nothing can tell at subscribe: the
// handler fails once, and its redelivery is refused by the subscriber's marshaler,
// paced, again and again (each refusal counted as a failed hand-off), never reaching
// the handler; the first refusal is logged once at ERROR with ErrNotWired and the fix.
// The refused message stays in its queue, at its head: a canary published behind it
// is handled because the prefetch lets it through.
func SubscriberWithoutTheMiddlewareIsRefusedNotLooped(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	logs := &logCapture{}
	s.cfg.Logger = logs
	s.sub.Prefetch = 10
	r := newRetry(t, m, s.sub, s.cfg)
	var badRuns atomic.Int64
	rec := newRecorder(func(msg *message.Message) error {
		// Past 10 runs it stops failing, so that code that loops stops loading the
		// shared broker (the runs are counted below).
		if msg.UUID == "bad" && badRuns.Add(1) <= 10 {
			return errFlaky
		}
		return nil
	})
	sub := m.Subscriber(t, r)
	newRouter(t, func(router *message.Router) {
		router.AddConsumerHandler("no-middleware", s.topic, sub, rec.handle) // no r.Middleware
	})
	publish(t, m, s.topic, "bad")
	publish(t, m, s.topic, "canary")

	const refusals = 3
	waitFor(t, 30*time.Second, "3 refusals of the redelivered message", func() bool { return r.Stats().HandoffFailures >= refusals })
	got := attemptsByUUID(rec.waitCalls(t, 2, 10*time.Second))
	if n := len(got["bad"]); n != 1 {
		t.Errorf("the failing message ran %d times, want once", n)
	}
	if n := len(got["canary"]); n != 1 {
		t.Errorf("canary handled %d times, want once", n)
	}
	var refused []watermill.CapturedMessage
	for _, l := range logs.at(watermill.ErrorLogLevel) {
		if strings.HasPrefix(l.Msg, "Message redelivered after its handler failed without the retry middleware") {
			refused = append(refused, l)
		}
	}
	if len(refused) != 1 {
		t.Fatalf("%d ERROR lines for the refusals, want one: %+v", len(refused), logs.at(watermill.ErrorLogLevel))
	}
	if !errors.Is(refused[0].Err, amqpretry.ErrNotWired) {
		t.Errorf("refusal logged with %v, want ErrNotWired", refused[0].Err)
	}
	for _, want := range []string{"Retry.AddHandler", "Retry.Middleware", "router.AddMiddleware"} {
		if !strings.Contains(refused[0].Err.Error(), want) {
			t.Errorf("refusal %q does not name %s", refused[0].Err, want)
		}
	}
	if st := r.Stats(); st.Retries != 0 || st.Poisoned != 0 {
		t.Errorf("stats %+v: something was handed off", st)
	}
}

// DeletedPoisonQueueIsDeclaredAgain: the poison queue is deleted while the router
// runs. The first poisoning is returned unroutable, declares the queue again and goes
// through: the handler runs once, no hot loop, and a canary flows.
func DeletedPoisonQueueIsDeclaredAgain(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	r := newRetry(t, m, s.sub, s.cfg)
	poison := s.prefix + ".poison"
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDelete(poison, false, false, false); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "canary" {
			return nil
		}
		return amqpretry.Permanent(errors.New("malformed order"))
	})
	run(t, m, r, s.topic, rec.handle)
	publish(t, m, s.topic, "bad")
	publish(t, m, s.topic, "canary")

	if msg := poisoned(t, poison, 30*time.Second); msg.UUID != "bad" {
		t.Errorf("poisoned %s, want bad", msg.UUID)
	}
	rec.waitCalls(t, 2, 10*time.Second)
	if got := attemptsByUUID(rec.snapshot()); len(got["bad"]) != 1 || len(got["canary"]) != 1 {
		t.Errorf("handled %v, want bad and canary once each", got)
	}
}

// HandoffThatKeepsFailingBacksOffThenPoisons: a broker policy makes the tier queue
// reject publishes while it has a message (max-length 0, reject-publish), and a
// message waits there, so each hand-off is nacked. The failing message is not
// redelivered at wire speed: it runs backend.HandoffAttempts times with growing pauses, then
// lands in the poison queue, once, while a canary is handled.
func HandoffThatKeepsFailingBacksOffThenPoisons(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Backend = delay.TTLTiers(10 * time.Second)
	s.cfg.Policy = amqpretry.Policy{Delays: []time.Duration{10 * time.Second}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)
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
	// One message in the tier puts it over its limit of 0 for 10 s (it is parked
	// after). The policy applies asynchronously: publish until the tier refuses one.
	for i := 0; ; i++ {
		blocker := message.NewMessage(fmt.Sprintf("blocker-%d", i), nil)
		wdelay.Message(blocker, wdelay.For(10*time.Second))
		if err := scheduler(r).Publish(s.prefix+".nowhere", blocker); err != nil {
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
	run(t, m, r, s.topic, rec.handle, rec.settle)
	start := time.Now()
	publish(t, m, s.topic, "stuck")
	publish(t, m, s.topic, "canary")

	msg := poisoned(t, s.prefix+".poison", 30*time.Second)
	took := time.Since(start)
	env := middleware.ReadEnvelope(msg.Metadata)
	if msg.UUID != "stuck" || env.Reason != amqpretry.ReasonHandoffFailed {
		t.Errorf("poisoned %s (%s), want stuck (handoff-failed)", msg.UUID, env.Reason)
	}
	if !strings.Contains(env.Error, "not confirmed") || !strings.Contains(env.Error, errFlaky.Error()) {
		t.Errorf("poisoned error %q lacks the hand-off and handler errors", env.Error)
	}
	// The pauses between attempts add up to 100+200+400+800 ms: no wire-speed loop.
	if took < 1500*time.Millisecond {
		t.Errorf("poisoned after %s: the failed hand-offs did not pause", took)
	}
	// Five deliveries of the stuck message and the canary's, handled to the end: one
	// poisoning, five failed hand-offs, no retry, so nothing more can come.
	rec.waitSettled(t, handoffAttempts+1, 10*time.Second)
	got := attemptsByUUID(rec.snapshot())
	if n := len(got["stuck"]); n != handoffAttempts {
		t.Errorf("handler ran %d times for the stuck message, want %d", n, handoffAttempts)
	}
	if n := len(got["canary"]); n != 1 {
		t.Errorf("canary handled %d times, want 1", n)
	}
	if st := r.Stats(); st.Poisoned != 1 || st.HandoffFailures != handoffAttempts || st.Retries != 0 {
		t.Errorf("stats %+v, want 1 poisoned after %d failed hand-offs", st, handoffAttempts)
	}
	if n := brokertest.QueueLength(t, s.prefix+".poison"); n != 0 {
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
	h := amqp.Table{marshal.DefaultUUIDKey: uuid}
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

// UndecodableHeadersReachTheHandlerAndSurviveEveryHop: headers the typed encoding
// cannot carry (a non-UTF-8 name with a non-string value, nesting deeper than 64) no
// longer make Unmarshal fail, which watermill-amqp answered with an endless nack. The
// message reaches the handler, is retried, and its poisoned copy carries the headers
// exactly as they were published. A canary behind it flows. The nesting is left out
// where the amqp091-go under test cannot read it at all (v1.16.0 and later: 32 deep at
// most): UnreadableHeadersEndInThePoisonQueue covers that message.
func UndecodableHeadersReachTheHandlerAndSurviveEveryHop(t *testing.T, m Major) {
	odd := amqp.Table{"\xff\xfe": int64(7), "plain": "kept"}
	if deep := nestedTable(70, int32(1)); brokertest.ClientReads(t, amqp.Table{"deep": deep}) {
		odd["deep"] = deep
	} else {
		t.Log("this amqp091-go cannot read a header nested 70 deep: tested without it")
	}
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "canary" {
			return nil
		}
		return errFlaky
	})
	run(t, m, r, s.topic, rec.handle)
	publishRaw(t, s.topic, "odd", odd)
	publishRaw(t, s.topic, "canary", nil)

	d := poisonedDelivery(t, s.prefix+".poison", 30*time.Second)
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
		if c.msg.UUID == "odd" && c.msg.Metadata.Get(keys.RawHeaders) == "" {
			t.Errorf("attempt %d reached the handler without its raw headers", amqpretry.Attempt(c.msg))
		}
	}
}

// UnreadableHeadersEndInThePoisonQueue: RabbitMQ accepts from any producer a header
// nested 40 deep, which amqp091-go v1.16.0 and later cannot read: at the delivery it
// closes its whole connection, the broker requeues the message at the head of the
// queue, and watermill-amqp reconnects at once, to be given it again. On a quorum
// work queue with x-delivery-limit and the poison queue as its dead-letter target
// (docs/troubleshooting.md), the broker counts each of those lost deliveries and past
// the limit dead-letters the message to the poison queue (x-death reason
// delivery_limit): it never stops the queue, and a canary published behind it is
// handled. A client that reads the header hands the message to the handler, which
// refuses it as permanent: the library poisons it. Either way it ends in the poison
// queue with its reason, on every broker (a quorum work queue on RabbitMQ 3.10 too: a
// classic queue has no delivery limit and would give it back forever).
func UnreadableHeadersEndInThePoisonQueue(t *testing.T, m Major) {
	headers := amqp.Table{"deep": nestedTable(40, int32(1)), "plain": "kept"}
	readable := brokertest.ClientReads(t, headers)
	if !readable && raceEnabled {
		t.Skip("this amqp091-go cannot read the header, so watermill-amqp reconnects, which races with itself (ConnectionWrapper, v2.1.3 and v3.0.2): run without -race (scripts/newest.sh does)")
	}
	const limit = 3
	s := newSetup(t, m, delay.TTLTiers())
	s.sub.QueueArgs = quorumToPoison(s)
	s.sub.QueueArgs["x-delivery-limit"] = int32(limit)
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: limit}
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "canary" {
			return nil
		}
		return amqpretry.Permanent(errors.New("a header nested 40 deep is of no use here"))
	})
	run(t, m, r, s.topic, rec.handle)
	start := time.Now()
	publishRaw(t, s.topic, "deep", headers)
	publishRaw(t, s.topic, "canary", nil)

	// Read as any amqp091-go can: the nesting past 32 as its bytes.
	d := poisonedFrom(t, brokertest.DialFlattening, s.prefix+".poison", 60*time.Second)
	took := time.Since(start)
	if d.Headers[marshal.DefaultUUIDKey] != "deep" || d.Headers["plain"] != "kept" || d.Headers["deep"] == nil {
		t.Fatalf("poisoned %v, want the message deep with its headers", d.Headers)
	}
	calls := rec.waitCalls(t, map[bool]int{true: 2, false: 1}[readable], 30*time.Second)
	got := attemptsByUUID(calls)
	info, err := xdeath.Parse(d.Headers)
	if err != nil {
		t.Fatal(err)
	}
	reason := middleware.ReadEnvelope(poisonedMetadata(t, d)).Reason
	if readable {
		if reason != amqpretry.ReasonPermanent || len(info.Deaths) != 0 || !slices.Equal(got["deep"], []int{1}) {
			t.Errorf("read by the client: reason %q, x-death %+v, handled %v; want permanent, no x-death, deep handled once", reason, info.Deaths, got)
		}
	} else {
		if reason != "" || len(info.Deaths) != 1 || info.Deaths[0].Reason != "delivery_limit" || info.Deaths[0].Queue != s.topic || len(got["deep"]) != 0 {
			t.Errorf("unreadable: envelope reason %q, x-death %+v, handled %v; want no envelope, dead-lettered once from %s for delivery_limit, deep never handled", reason, info.Deaths, got, s.topic)
		}
		t.Logf("unreadable: dead-lettered for delivery_limit %s after its publish (x-delivery-limit %d)", took.Round(time.Millisecond), limit)
	}
	if len(got["canary"]) != 1 {
		t.Errorf("handled %v, want the canary once", got)
	}
}

// poisonedMetadata is d as the library's marshaler reads it.
func poisonedMetadata(t *testing.T, d amqp.Delivery) message.Metadata {
	t.Helper()
	msg, err := xdeath.Marshaler{}.Unmarshal(d)
	if err != nil {
		t.Fatal(err)
	}
	return msg.Metadata
}

// HeadersNearFrameMaxArePoisonedWithTheHeadersThatFit: a message whose header is
// just under frame_max is accepted from its producer, but its retry copy, with the
// failure envelope, would not fit in one frame: the broker would close the hand-off
// connection shared by every hand-off. The copy is never sent: the envelope is
// trimmed, then the message is poisoned without the oversized header, which is named.
// Other hand-offs keep working: a canary fails once and is retried.
func HeadersNearFrameMaxArePoisonedWithTheHeadersThatFit(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Policy = amqpretry.Policy{Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "canary" && amqpretry.Attempt(msg) > 1 {
			return nil
		}
		return errFlaky
	})
	run(t, m, r, s.topic, rec.handle)
	big := strings.Repeat("b", 130_900) // frame_max 131,072: fits alone, not with an envelope
	publishRaw(t, s.topic, "huge", amqp.Table{"big": big, "small": "kept"})
	publishRaw(t, s.topic, "canary", nil)

	msg := poisoned(t, s.prefix+".poison", 30*time.Second)
	env := middleware.ReadEnvelope(msg.Metadata)
	if msg.UUID != "huge" || env.Reason != amqpretry.ReasonTooLarge {
		t.Fatalf("poisoned %s (%s), want huge (too-large)", msg.UUID, env.Reason)
	}
	if _, ok := msg.Metadata["big"]; ok {
		t.Error("the oversized header was kept")
	}
	if env.DroppedHeaders != "big (130903 bytes)" {
		t.Errorf("dropped headers = %q", env.DroppedHeaders)
	}
	if msg.Metadata.Get("small") != "kept" || !strings.Contains(env.Error, "frame_max") {
		t.Errorf("poisoned copy lost a header that fits or the reason: %v", msg.Metadata)
	}
	calls := rec.waitCalls(t, 3, 30*time.Second)
	if got := attemptsByUUID(calls); len(got["huge"]) != 1 || !slices.Equal(got["canary"], []int{1, 2}) {
		t.Errorf("handled %v, want huge once and canary on attempts [1 2]", got)
	}
}

// PoisoningIsLoggedAtError: watermill.LoggerAdapter has no WARN level, so a poisoning
// is logged at ERROR (alerting on errors sees it; a logger with a Warn method gets it at
// WARN), and Close logs what the Retry did.
func PoisoningIsLoggedAtError(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	logs := &logCapture{}
	s.cfg.Logger = logs
	r := newRetry(t, m, s.sub, s.cfg)
	run(t, m, r, s.topic, func(*message.Message) error { return amqpretry.Permanent(errors.New("malformed")) })
	publish(t, m, s.topic, "bad")
	poisoned(t, s.prefix+".poison", 30*time.Second)
	// The broker may deliver the poisoned copy before the middleware has read its
	// confirm and logged.
	found := false
	for deadline := time.Now().Add(5 * time.Second); !found && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		for _, l := range logs.at(watermill.ErrorLogLevel) {
			found = found || l.Msg == "Message poisoned" && l.Fields["poison_reason"] == string(amqpretry.ReasonPermanent)
		}
	}
	if !found {
		t.Errorf("no ERROR line for the poisoning: %+v", logs.at(watermill.ErrorLogLevel))
	}
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

// TraceContextSurvivesRetryAndPoison: W3C trace context in the metadata travels with
// every retry and with the poisoned copy, so a trace spans the whole story.
func TraceContextSurvivesRetryAndPoison(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(*message.Message) error { return errFlaky })
	run(t, m, r, s.topic, rec.handle)
	const traceparent, tracestate = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "vendor=opaque"
	msg := message.NewMessage("traced", nil)
	msg.Metadata.Set("traceparent", traceparent)
	msg.Metadata.Set("tracestate", tracestate)
	if err := m.Publisher(t, s.sub).Publish(s.topic, msg); err != nil {
		t.Fatal(err)
	}
	poisonedMsg := poisoned(t, s.prefix+".poison", 30*time.Second)
	calls := rec.waitCalls(t, 2, 10*time.Second)
	for i, m := range []*message.Message{calls[0].msg, calls[1].msg, poisonedMsg} {
		if m.Metadata.Get("traceparent") != traceparent || m.Metadata.Get("tracestate") != tracestate {
			t.Errorf("hop %d lost the trace context: %q %q", i, m.Metadata.Get("traceparent"), m.Metadata.Get("tracestate"))
		}
	}
}

// WorkPerCopyIsEncodeOnReceipt pins the failure path's header work: a message with
// three headers of AMQP types other than string, retried once on ttl-tiers, has each
// of them encoded once per receipt (Watermill metadata has strings only) and never
// decoded: its one copy is published from the values read on receipt (read once,
// write once), and the middleware decides, stamps and hands off without reading them
// back; the broker's x-death on the retry is not encoded at all (the retry subscriber
// leaves it out). The headers reach the second attempt as they reached the first.
func WorkPerCopyIsEncodeOnReceipt(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(failFirst(1))
	run(t, m, r, s.topic, rec.handle, rec.settle)
	typed := amqp.Table{"tenant": int32(7), "ctx": amqp.Table{"region": "eu", "shard": int64(3)}, "sent": time.Unix(1_700_000_000, 0)}
	headers := amqp.Table{"plain": "kept"}
	maps.Copy(headers, typed)
	enc0, dec0 := marshal.WorkDone()
	publishRaw(t, s.topic, "typed", headers)
	rec.waitSettled(t, 2, 30*time.Second) // the failure handed off, then the retry handled
	enc, dec := marshal.WorkDone()
	if k := int64(len(typed)); enc-enc0 != 2*k || dec-dec0 != 0 {
		t.Errorf("%d encodings and %d decodings for %d typed headers, one failure and one retry; want %d (one per header per receipt) and none",
			enc-enc0, dec-dec0, k, 2*k)
	}
	calls := rec.snapshot()
	if len(calls) != 2 {
		t.Fatalf("handled %d times, want 2", len(calls))
	}
	for k := range headers {
		if first, retry := calls[0].msg.Metadata[k], calls[1].msg.Metadata[k]; first == "" || first != retry {
			t.Errorf("header %q reached attempt 1 as %q and attempt 2 as %q, want the same", k, first, retry)
		}
	}
	if _, ok := calls[1].msg.Metadata[keys.XDeath]; ok {
		t.Errorf("the retry subscriber kept x-death in the metadata")
	}
}
