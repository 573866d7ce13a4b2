package middleware

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

var errFlaky = errors.New("flaky")

func TestRetrySchedulesNextAttemptWithoutTouchingTheOriginal(t *testing.T) {
	b := &fakeBackend{effective: func(d time.Duration) (time.Duration, error) { return 2 * d, nil }}
	var events []amqpretry.Event
	e, poison := newEngine(t, amqpretry.Config{
		Policy:  amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{time.Second, 5 * time.Second}, Jitter: -1},
		Observe: func(ev amqpretry.Event) { events = append(events, ev) },
	}, b)
	msg := message.NewMessage("uuid-1", []byte("payload"))
	msg.Metadata.Set("user", "kept")
	msg.Metadata.Set(keys.DeliveryExchange, "shop")
	msg.Metadata.Set(keys.DeliveryRoutingKey, "order.created")
	before := maps.Clone(msg.Metadata)

	start := time.Now()
	if _, err := e.Middleware(failing(errors.New("boom")))(msg); err != nil {
		t.Fatalf("a confirmed hand-off must let the router ack, got %v", err)
	}
	if !maps.Equal(msg.Metadata, before) {
		t.Errorf("incoming metadata changed: %v -> %v", before, msg.Metadata)
	}
	if len(b.parked) != 1 || len(poison.got()) != 0 {
		t.Fatalf("parked %d, poisoned %d; want 1 and 0", len(b.parked), len(poison.got()))
	}
	p := b.parked[0]
	if p.queue != "work" || p.effective != 2*time.Second {
		t.Errorf("parked for %q after %s, want the failing queue after the backend's 2s", p.queue, p.effective)
	}
	cp := p.msg
	if cp.UUID != msg.UUID || string(cp.Payload) != "payload" || cp.Metadata.Get("user") != "kept" {
		t.Errorf("copy lost the message: %+v", cp)
	}
	env := ReadEnvelope(cp.Metadata)
	if env.Attempt != 2 || env.RequestedDelay != time.Second || env.EffectiveDelay != 2*time.Second {
		t.Errorf("copy: attempt %d, requested %s, effective %s; want 2, 1s, 2s", env.Attempt, env.RequestedDelay, env.EffectiveDelay)
	}
	if env.Error != "boom" || env.FirstFailure.IsZero() || !env.FirstFailure.Equal(env.LastFailure) || env.Queue != "work" {
		t.Errorf("copy misses the failure record: %+v", env)
	}
	if env.OriginalExchange != "shop" || env.OriginalRoutingKey != "order.created" {
		t.Errorf("original exchange, key = %q, %q", env.OriginalExchange, env.OriginalRoutingKey)
	}
	if env.Due.Before(start.Add(2*time.Second)) || env.Reason != "" || env.MaxAttempts != 0 {
		t.Errorf("copy: due %s (start %s), reason %q, max attempts %d", env.Due, start, env.Reason, env.MaxAttempts)
	}
	for _, k := range []string{wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
		if v, ok := cp.Metadata[k]; ok {
			t.Errorf("copy carries Watermill's delay key %s = %q", k, v)
		}
	}
	kinds := []amqpretry.EventKind{}
	for _, ev := range events {
		kinds = append(kinds, ev.Kind)
	}
	if want := []amqpretry.EventKind{amqpretry.EventDelivered, amqpretry.EventRetryScheduled}; !slices.Equal(kinds, want) {
		t.Fatalf("events %v, want %v", kinds, want)
	}
	if ev := events[1]; ev.Attempt != 1 || ev.Requested != time.Second || ev.Effective != 2*time.Second || ev.Backend != "fake" || ev.Queue != "work" {
		t.Errorf("retry event %+v", ev)
	}
	if st := e.Stats(); st != (Stats{Retries: 1}) {
		t.Errorf("stats %+v", st)
	}
}

// TestEnvelopeKeepsTheFirstFailure: a retry that fails again keeps when and where it
// first failed, and records the latest failure.
func TestEnvelopeKeepsTheFirstFailure(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{time.Second}, Jitter: -1}}, b)
	first := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	msg := message.NewMessage("m", nil)
	Envelope{Attempt: 2, FirstFailure: first, LastFailure: first, Error: "a", ErrorTypes: []string{"x"},
		OriginalExchange: "orders", OriginalRoutingKey: "created", RequestedDelay: time.Second, Due: first}.Write(msg.Metadata)
	msg.Metadata.Set(keys.DeliveryExchange, "amqpretry.deliver")
	msg.Metadata.Set(keys.DeliveryRoutingKey, "work")
	if _, err := e.Middleware(failing(errors.New("b")))(msg); err != nil {
		t.Fatal(err)
	}
	env := ReadEnvelope(b.msgs()[0].Metadata)
	if !env.FirstFailure.Equal(first) || !env.LastFailure.After(first) {
		t.Errorf("first %s, last %s; want the first kept and the latest after it", env.FirstFailure, env.LastFailure)
	}
	if env.OriginalExchange != "orders" || env.OriginalRoutingKey != "created" {
		t.Errorf("original exchange/key = %q/%q, want orders/created", env.OriginalExchange, env.OriginalRoutingKey)
	}
	if env.Error != "b" || !slices.Equal(env.ErrorTypes, []string{"*errors.errorString"}) || env.Attempt != 3 {
		t.Errorf("envelope %+v, want the latest error and attempt 3", env)
	}
}

// TestEnvelopeOfARedrivenPoisonedMessage: a poisoned message redriven to its queue that
// fails again is retried with what it carries from before (first failure, original
// route, redrives, dropped headers) and nothing of the poisoning (reason, limit) or of
// its earlier delays: the envelope is built from those parts, not copied and cleared.
func TestEnvelopeOfARedrivenPoisonedMessage(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{time.Second}, Jitter: -1}}, b)
	first := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	msg := message.NewMessage("m", nil)
	Envelope{Attempt: 1, MaxAttempts: 5, Reason: amqpretry.ReasonPermanent, Error: "a", ErrorTypes: []string{"x"},
		FirstFailure: first, LastFailure: first, Handler: "old", Topic: "old", Queue: "work",
		OriginalExchange: "orders", OriginalRoutingKey: "created", RequestedDelay: 7 * time.Second, EffectiveDelay: 8 * time.Second, Due: first,
		DroppedHeaders: "big (9000 bytes)", RedrivenAt: first, Redriven: 1, RedrivenFrom: "poison"}.Write(msg.Metadata)
	if _, err := e.Middleware(failing(errors.New("b")))(msg); err != nil {
		t.Fatal(err)
	}
	env := ReadEnvelope(b.msgs()[0].Metadata)
	if env.Reason != "" || env.MaxAttempts != 0 {
		t.Errorf("reason %q, max attempts %d on a retry; want none", env.Reason, env.MaxAttempts)
	}
	if env.RequestedDelay != time.Second || env.EffectiveDelay != time.Second || !env.Due.After(first) {
		t.Errorf("delays %s/%s due %s; want this retry's (1s) and a new due time", env.RequestedDelay, env.EffectiveDelay, env.Due)
	}
	if !env.FirstFailure.Equal(first) || env.OriginalExchange != "orders" || env.OriginalRoutingKey != "created" {
		t.Errorf("first failure %s, route %q/%q; want them kept", env.FirstFailure, env.OriginalExchange, env.OriginalRoutingKey)
	}
	if env.Redriven != 1 || env.RedrivenFrom != "poison" || !env.RedrivenAt.Equal(first) || env.DroppedHeaders != "big (9000 bytes)" {
		t.Errorf("redrives %d from %q at %s, dropped %q; want them kept", env.Redriven, env.RedrivenFrom, env.RedrivenAt, env.DroppedHeaders)
	}
	if env.Error != "b" || env.Attempt != 2 {
		t.Errorf("error %q, attempt %d; want this failure's and attempt 2", env.Error, env.Attempt)
	}
}

func TestRetryPoisonsAfterLastAttempt(t *testing.T) {
	b := &fakeBackend{}
	var events []amqpretry.Event
	e, poison := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 3},
		Observe: func(ev amqpretry.Event) { events = append(events, ev) }}, b)
	msg := message.NewMessage("uuid-2", nil)
	msg.Metadata.Set(keys.Attempt, "3")
	Envelope{Attempt: 3, RequestedDelay: time.Second, EffectiveDelay: time.Second, Due: time.Now()}.Write(msg.Metadata)
	before := maps.Clone(msg.Metadata)
	if _, err := e.Middleware(failing(errors.New("still broken")))(msg); err != nil {
		t.Fatal(err)
	}
	if len(b.parked) != 0 || len(poison.got()) != 1 {
		t.Fatalf("want exactly one poisoned message, got parked=%d poisoned=%d", len(b.parked), len(poison.got()))
	}
	md := poison.got()[0].Metadata
	for k, want := range map[string]string{
		keys.PoisonReason: "max-attempts", keys.Attempt: "3", keys.MaxAttempts: "3",
		keys.Error: "still broken", keys.ErrorTypes: "*errors.errorString", keys.Queue: "work",
	} {
		if md.Get(k) != want {
			t.Errorf("%s = %q, want %q", k, md.Get(k), want)
		}
	}
	for _, k := range []string{keys.RequestedDelay, keys.EffectiveDelay, keys.Due} {
		if v, ok := md[k]; ok {
			t.Errorf("poisoned copy keeps its last retry hop: %s = %q", k, v)
		}
	}
	if !maps.Equal(msg.Metadata, before) {
		t.Error("the incoming message was modified")
	}
	if last := events[len(events)-1]; last.Kind != amqpretry.EventPoisoned || last.Reason != amqpretry.ReasonMaxAttempts || last.Attempt != 3 {
		t.Errorf("last event %+v", last)
	}
	if st := e.Stats(); st != (Stats{Poisoned: 1}) {
		t.Errorf("stats %+v", st)
	}
}

func TestRetryPermanentPoisonsAtOnce(t *testing.T) {
	b := &fakeBackend{}
	e, poison := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 10}}, b)
	if _, err := e.Middleware(failing(fmt.Errorf("ctx: %w", amqpretry.Permanent(errors.New("invalid")))))(message.NewMessage("u", nil)); err != nil {
		t.Fatal(err)
	}
	if len(b.parked) != 0 || len(poison.got()) != 1 {
		t.Fatalf("parked=%d poisoned=%d, want 0 and 1", len(b.parked), len(poison.got()))
	}
	md := poison.got()[0].Metadata
	if md.Get(keys.PoisonReason) != "permanent" || md.Get(keys.Attempt) != "1" || md.Get(keys.ErrorTypes) != "*fmt.wrapError > *amqpretry.permanentError > *errors.errorString" {
		t.Errorf("poisoned %v", md)
	}
}

func TestRetryAfterAndClassifyOverride(t *testing.T) {
	b := &fakeBackend{}
	var seen []amqpretry.ClassifyParams
	e, poison := newEngine(t, amqpretry.Config{
		Classify: func(p amqpretry.ClassifyParams) amqpretry.Decision {
			seen = append(seen, p)
			switch {
			case strings.Contains(p.Err.Error(), "fatal"):
				return amqpretry.Decision{Permanent: true}
			case strings.Contains(p.Err.Error(), "slow"):
				return amqpretry.Decision{Delay: 7 * time.Second}
			}
			return p.Default
		},
	}, b)
	msg := message.NewMessage("a", nil)
	if _, err := e.Middleware(failing(amqpretry.RetryAfter(errors.New("429"), 42*time.Second)))(msg); err != nil {
		t.Fatal(err)
	}
	if got := ReadEnvelope(b.msgs()[0].Metadata).RequestedDelay; got != 42*time.Second {
		t.Errorf("RetryAfter delay %s, want 42s", got)
	}
	if len(seen) != 1 || seen[0].Attempt != 1 || seen[0].Default != (amqpretry.Decision{Delay: 42 * time.Second}) || seen[0].Message.UUID != "a" {
		t.Errorf("classifier params %+v", seen)
	}
	if _, err := e.Middleware(failing(errors.New("slow")))(message.NewMessage("s", nil)); err != nil {
		t.Fatal(err)
	}
	if got := ReadEnvelope(b.msgs()[1].Metadata).RequestedDelay; got != 7*time.Second {
		t.Errorf("classified delay %s, want 7s", got)
	}
	if _, err := e.Middleware(failing(errors.New("fatal")))(message.NewMessage("b", nil)); err != nil {
		t.Fatal(err)
	}
	if len(poison.got()) != 1 || poison.got()[0].Metadata.Get(keys.PoisonReason) != "permanent" {
		t.Errorf("classifier's Permanent decision was not honoured")
	}
}

func TestRetryHandoffFailureFailsTheHandler(t *testing.T) {
	b := &fakeBackend{park: func(*message.Message) error { return errors.New("channel closed") }}
	e, poison := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 2}}, b)
	poison.publish = func(*message.Message) error { return errors.New("channel closed") }
	handlerErr := errors.New("boom")

	msg := hurried("a")
	before := maps.Clone(msg.Metadata)
	_, err := e.Middleware(failing(handlerErr))(msg)
	if !errors.Is(err, amqpretry.ErrHandoff) || !errors.Is(err, handlerErr) || !strings.Contains(err.Error(), `queue "work"`) {
		t.Fatalf("retry hand-off failure: got %v, want ErrHandoff joined with the handler error, naming the queue", err)
	}
	if !maps.Equal(msg.Metadata, before) {
		t.Error("a failed hand-off modified the message the router nacks")
	}
	last := hurried("b")
	last.Metadata.Set(keys.Attempt, "2")
	_, err = e.Middleware(failing(handlerErr))(last)
	if !errors.Is(err, amqpretry.ErrHandoff) || !errors.Is(err, handlerErr) || !strings.Contains(err.Error(), `poison queue "poison"`) {
		t.Fatalf("poison hand-off failure: got %v, want ErrHandoff naming the poison queue", err)
	}
	if st := e.Stats(); st != (Stats{HandoffFailures: 2, PoisonPending: 1}) {
		t.Errorf("stats %+v", st)
	}
	// A Retry nearer the handler dealt with it: passed through as is.
	inner := fmt.Errorf("inner: %w", amqpretry.ErrHandoff)
	if _, err := e.Middleware(failing(inner))(hurried("c")); err != inner {
		t.Errorf("a hand-off error from an inner Retry: %v, want it as is", err)
	}
}

// TestHandoffOutlivesTheDeliveryContext: the router cancels the deliveries' context
// when it closes, while handlers still run; a hand-off then under way is not canceled
// with it (the hand-off bounds it with its confirm timeout): the retry is parked, or the
// message poisoned, and the router acks, instead of failed hand-offs that would poison
// a message the closing subscriber keeps redelivering.
func TestHandoffOutlivesTheDeliveryContext(t *testing.T) {
	b := &fakeBackend{}
	e, poison := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{time.Second}}}, b)
	msg := hurried("closing")
	if _, err := e.Middleware(failing(errors.New("boom")))(msg); err != nil {
		t.Fatalf("hand-off while the router closes: %v, want the retry parked", err)
	}
	if len(b.parked) != 1 || b.parked[0].ctxErr != nil {
		t.Fatalf("parked %+v, want one, with a live context", b.parked)
	}
	last := hurried("closing")
	Envelope{Attempt: 2}.Write(last.Metadata)
	if _, err := e.Middleware(failing(errors.New("boom")))(last); err != nil || len(poison.got()) != 1 {
		t.Fatalf("last attempt while the router closes: %v, %d poisoned; want it poisoned", err, len(poison.got()))
	}
}

func TestRetryWithoutSubscribedTopic(t *testing.T) {
	b := &fakeBackend{}
	e, poison := newEngine(t, amqpretry.Config{}, b)
	e.wiring.Queue = func(topic string) string { return topic } // no router: no topic
	_, err := e.Middleware(failing(errFlaky))(message.NewMessage("m", nil))
	if !errors.Is(err, amqpretry.ErrHandoff) || !errors.Is(err, errFlaky) || !strings.Contains(err.Error(), "no subscribed topic") {
		t.Errorf("no topic: %v", err)
	}
	if len(b.parked)+len(poison.got()) != 0 {
		t.Error("handed off a message with nowhere to come back to")
	}
}

func TestRetrySuccessPassesThrough(t *testing.T) {
	b := &fakeBackend{}
	var events []amqpretry.Event
	e, _ := newEngine(t, amqpretry.Config{Observe: func(ev amqpretry.Event) { events = append(events, ev) }}, b)
	out := []*message.Message{message.NewMessage("out", nil)}
	in := message.NewMessage("in", nil)
	before := maps.Clone(in.Metadata)
	got, err := e.Middleware(func(*message.Message) ([]*message.Message, error) { return out, nil })(in)
	if err != nil || len(got) != 1 || got[0] != out[0] || len(b.parked) != 0 || !maps.Equal(in.Metadata, before) {
		t.Fatalf("success path changed: %v %v", got, err)
	}
	if len(events) != 2 || events[1].Kind != amqpretry.EventSucceeded || events[1].Attempt != 1 {
		t.Errorf("events %+v", events)
	}
}

func TestRetryPoisonsADelayTheBackendRefuses(t *testing.T) {
	b := &fakeBackend{effective: func(d time.Duration) (time.Duration, error) {
		return 0, fmt.Errorf("%s: %w", d, delay.ErrDelayTooLong)
	}}
	e, poison := newEngine(t, amqpretry.Config{}, b)
	if _, err := e.Middleware(failing(amqpretry.RetryAfter(errors.New("429"), 100*365*24*time.Hour)))(message.NewMessage("a", nil)); err != nil {
		t.Fatalf("a refused delay must not loop through nack-requeue: %v", err)
	}
	if len(poison.got()) != 1 || poison.got()[0].Metadata.Get(keys.PoisonReason) != "delay-too-long" {
		t.Fatalf("want one message poisoned as delay-too-long, got %v", poison.got())
	}
	md := poison.got()[0].Metadata
	if md.Get(keys.RequestedDelay) != "" || md.Get(keys.Attempt) != "1" {
		t.Errorf("poisoned copy keeps the refused delay or a wrong attempt: %v", md)
	}
	if got := md.Get(keys.Error); !strings.Contains(got, "delay too long") || !strings.Contains(got, "429") {
		t.Errorf("envelope error %q should say both why the delay was refused and the handler's error", got)
	}
}

func TestCopyTooLargeIsTrimmedThenPoisonedWithTheHeadersThatFit(t *testing.T) {
	// The error alone is too large: the trimmed envelope fits, and the retry goes.
	b := &fakeBackend{park: tooLarge(1000)}
	e, poison := newEngine(t, amqpretry.Config{}, b)
	if _, err := e.Middleware(failing(errors.New(strings.Repeat("é", 1000))))(message.NewMessage("long-error", nil)); err != nil {
		t.Fatal(err)
	}
	if len(b.parked) != 1 || len(poison.got()) != 0 {
		t.Fatalf("parked %d, poisoned %d; want the trimmed retry parked", len(b.parked), len(poison.got()))
	}
	env := ReadEnvelope(b.msgs()[0].Metadata)
	if len(env.Error) > trimmedErrorBytes || !strings.HasSuffix(env.Error, "…") || !utf8.ValidString(env.Error) || env.ErrorTypes != nil {
		t.Errorf("trimmed envelope: error %d bytes %q, types %v", len(env.Error), env.Error, env.ErrorTypes)
	}

	// A header of the message's own is too large: poisoned without it.
	b = &fakeBackend{park: tooLarge(1000)}
	e, poison = newEngine(t, amqpretry.Config{}, b)
	poison.publish = tooLarge(1000)
	var events []amqpretry.Event
	e.cfg.Observe = func(ev amqpretry.Event) { events = append(events, ev) }
	msg := message.NewMessage("big", nil)
	msg.Metadata.Set("huge", strings.Repeat("h", 5000))
	msg.Metadata.Set("large", strings.Repeat("l", 3000))
	msg.Metadata.Set("small", "kept")
	before := maps.Clone(msg.Metadata)
	if _, err := e.Middleware(failing(errors.New(strings.Repeat("e", 1500))))(msg); err != nil {
		t.Fatalf("a poisoned copy lets the router ack, got %v", err)
	}
	if !maps.Equal(msg.Metadata, before) {
		t.Error("incoming metadata changed")
	}
	if len(b.parked) != 0 || len(poison.got()) != 1 {
		t.Fatalf("parked %d, poisoned %d; want 0 and 1", len(b.parked), len(poison.got()))
	}
	md := poison.got()[0].Metadata
	for k, want := range map[string]string{
		keys.PoisonReason:   "too-large",
		keys.DroppedHeaders: "huge (5004 bytes), large (3005 bytes)",
		"small":             "kept",
	} {
		if got := md.Get(k); got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
	if len(md.Get(keys.Error)) > trimmedErrorBytes || !strings.Contains(md.Get(keys.Error), "frame_max") {
		t.Errorf("error not trimmed or reason lost: %q", md.Get(keys.Error))
	}
	if len(events) != 2 || events[1].Kind != amqpretry.EventPoisoned || events[1].Reason != amqpretry.ReasonTooLarge {
		t.Errorf("events %+v", events)
	}

	// Nothing left to drop: the hand-off error stands.
	b = &fakeBackend{park: tooLarge(10)}
	e, poison = newEngine(t, amqpretry.Config{}, b)
	e.handoffLimit = 100
	poison.publish = tooLarge(10)
	_, err := e.Middleware(failing(errFlaky))(hurried("tiny-limit"))
	if !errors.Is(err, amqpretry.ErrHandoff) || len(poison.got()) != 0 {
		t.Errorf("nothing fits: %v, %d poisoned", err, len(poison.got()))
	}
}

func TestHandoffBackoff(t *testing.T) {
	ms := time.Millisecond
	for n, want := range map[int]time.Duration{0: 100 * ms, 1: 100 * ms, 2: 200 * ms, 3: 400 * ms, 4: 800 * ms, 5: 1600 * ms, 6: 3200 * ms, 7: 5 * time.Second, 100: 5 * time.Second} {
		if got := backend.HandoffPause(n); got != want {
			t.Errorf("backend.HandoffPause(%d) = %s, want %s", n, got, want)
		}
	}
}

func TestHandoffFailingForOneMessagePausesThenPoisons(t *testing.T) {
	b := &fakeBackend{park: func(*message.Message) error { return errors.New("nacked") }}
	var events []amqpretry.Event
	e, poison := newEngine(t, amqpretry.Config{Observe: func(ev amqpretry.Event) { events = append(events, ev) }}, b)
	e.handoffLimit = 3 // shorter than backend.HandoffAttempts
	h := e.Middleware(failing(errFlaky))

	// The first failure pauses backend.HandoffPause(1) before the router nacks: a timer never
	// fires early, so this is a lower bound, not a timing threshold.
	start := time.Now()
	_, err := h(message.NewMessage("stuck", nil))
	if took := time.Since(start); took < backend.HandoffPause(1) {
		t.Errorf("returned after %s, want a pause of at least %s", took, backend.HandoffPause(1))
	}
	if !errors.Is(err, amqpretry.ErrHandoff) || !errors.Is(err, errFlaky) {
		t.Fatalf("failure 1: %v, want ErrHandoff joined with the handler's error", err)
	}
	// The pause ends with the message's context.
	if _, err := h(hurried("stuck")); !errors.Is(err, amqpretry.ErrHandoff) {
		t.Fatalf("failure 2: %v", err)
	}
	if _, err := h(hurried("stuck")); err != nil {
		t.Fatalf("third failure: %v, want the message poisoned and acked", err)
	}
	if len(poison.got()) != 1 || poison.got()[0].Metadata.Get(keys.PoisonReason) != "handoff-failed" {
		t.Fatalf("poisoned %d, want 1 with reason handoff-failed", len(poison.got()))
	}
	if e := poison.got()[0].Metadata.Get(keys.Error); !strings.Contains(e, "3 hand-offs failed") || !strings.Contains(e, "nacked") || !strings.Contains(e, "flaky") {
		t.Errorf("poison error %q", e)
	}
	var causes []string
	for _, ev := range events {
		if ev.Kind == amqpretry.EventHandoffFailed {
			causes = append(causes, ev.Cause)
		}
	}
	if !slices.Equal(causes, []string{"other", "other", "other"}) {
		t.Errorf("hand-off failure causes %v", causes)
	}
	// Another message starts its own count, and a success forgets it.
	if _, err := h(hurried("other")); !errors.Is(err, amqpretry.ErrHandoff) {
		t.Errorf("another message: %v, want a hand-off error, not poisoned", err)
	}
	if n := e.failures.add("other"); n != 2 {
		t.Errorf("failures of other: %d, want 2", n)
	}
	if _, err := e.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(message.NewMessage("other", nil)); err != nil {
		t.Fatal(err)
	}
	if n := e.failures.add("other"); n != 1 {
		t.Errorf("failures of other after a success: %d, want 1", n)
	}
}

func TestErrorTypes(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want []string
	}{
		{"plain", errors.New("x"), []string{"*errors.errorString"}},
		{"wrapped", fmt.Errorf("a: %w", customError{}), []string{"*fmt.wrapError", "middleware.customError"}},
		{"joined", errors.Join(customError{}, errors.New("y")), []string{"*errors.joinError", "middleware.customError", "*errors.errorString"}},
		{"marked", amqpretry.Permanent(customError{}), []string{"*amqpretry.permanentError", "middleware.customError"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := (&engine{}).envelope(delivery{}, tt.err).ErrorTypes; !slices.Equal(got, tt.want) {
				t.Errorf("errorTypes = %q, want %q", got, tt.want)
			}
		})
	}
	deep := error(customError{})
	for range 40 {
		deep = fmt.Errorf("layer: %w", deep)
	}
	if got := (&engine{}).envelope(delivery{}, deep).ErrorTypes; len(got) != 16 {
		t.Errorf("errorTypes of a chain of 41: %d types, want 16", len(got))
	}
}

type customError struct{}

func (customError) Error() string { return "custom" }

// TestEnvelopeIsBounded: a huge error with a deep chain and a huge handler name give a
// poisoned copy whose envelope stays a few KiB.
func TestEnvelopeIsBounded(t *testing.T) {
	err := amqpretry.Permanent(errors.New(strings.Repeat("é", 10_000)))
	for range 100 {
		err = fmt.Errorf("layer: %w", err)
	}
	b := &fakeBackend{}
	e, poison := newEngine(t, amqpretry.Config{}, b)
	e.wiring.Queue = func(string) string { return strings.Repeat("q", 5000) }
	if _, err := e.Middleware(failing(err))(message.NewMessage("m", nil)); err != nil {
		t.Fatal(err)
	}
	md := poison.got()[0].Metadata
	total := 0
	for k, v := range md {
		total += len(k) + len(v)
		if !utf8.ValidString(v) {
			t.Errorf("%s is not valid UTF-8 after truncation", k)
		}
	}
	if len(md[keys.Error]) > 2048 || len(md[keys.Queue]) > 256 {
		t.Errorf("error %d bytes, queue %d bytes", len(md[keys.Error]), len(md[keys.Queue]))
	}
	if n := strings.Count(md[keys.ErrorTypes], " > ") + 1; n != 16 {
		t.Errorf("%s lists %d types, want the cap 16", keys.ErrorTypes, n)
	}
	if total > 8*1024 {
		t.Errorf("envelope is %d bytes, want it far below frame_max", total)
	}
}

// TestRetriesLoggedAtDebug: a scheduled retry is logged at DEBUG, never above, so that
// a storm of retries stays out of an INFO log; a poisoning is logged at ERROR where the
// logger has no WARN.
func TestRetriesLoggedAtDebug(t *testing.T) {
	logs := watermill.NewCaptureLogger()
	e, _ := newEngine(t, amqpretry.Config{Logger: logs, Policy: amqpretry.Policy{MaxAttempts: 100}}, &fakeBackend{})
	for i := range 10 {
		if _, err := e.Middleware(failing(errFlaky))(message.NewMessage(fmt.Sprint(i), nil)); err != nil {
			t.Fatal(err)
		}
	}
	c := logs.Captured()
	if n, info := len(c[watermill.DebugLogLevel]), len(c[watermill.InfoLogLevel]); n != 10 || info != 0 {
		t.Errorf("10 retries: %d DEBUG lines, %d INFO lines; want 10 and 0", n, info)
	}
	if st := e.Stats(); st.Retries != 10 {
		t.Errorf("Stats().Retries = %d, want 10", st.Retries)
	}
	logs = watermill.NewCaptureLogger()
	e, _ = newEngine(t, amqpretry.Config{Logger: logs}, &fakeBackend{})
	if _, err := e.Middleware(failing(amqpretry.Permanent(errFlaky)))(message.NewMessage("p", nil)); err != nil {
		t.Fatal(err)
	}
	if errs := logs.Captured()[watermill.ErrorLogLevel]; len(errs) != 1 || errs[0].Msg != "Message poisoned" {
		t.Errorf("poisoning logged as %v", errs)
	}
}

func TestDelayOf(t *testing.T) {
	p := amqpretry.Config{Policy: amqpretry.Policy{Jitter: -1}}.WithDefaults().Policy
	for n, want := range map[int]time.Duration{-1: time.Second, 0: time.Second, 1: time.Second, 2: 2 * time.Second, 10: 512 * time.Second, 11: 10 * time.Minute, 100: 10 * time.Minute} {
		if got := delayOf(p, n); got != want {
			t.Errorf("delayOf(%d) = %s, want %s", n, got, want)
		}
	}
	p.Delays = []time.Duration{time.Second, time.Minute}
	for n, want := range map[int]time.Duration{0: time.Second, 1: time.Second, 2: time.Minute, 3: time.Minute} {
		if got := delayOf(p, n); got != want {
			t.Errorf("delays: delayOf(%d) = %s, want %s", n, got, want)
		}
	}
}
