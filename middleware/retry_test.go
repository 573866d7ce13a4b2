package middleware

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/delay"
)

// recorder is a message.Publisher that keeps what it is given, or fails.
type recorder struct {
	topics []string
	msgs   []*message.Message
	err    error
}

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	if r.err != nil {
		return r.err
	}
	for _, m := range msgs {
		r.topics = append(r.topics, topic)
		r.msgs = append(r.msgs, m)
	}
	return nil
}
func (r *recorder) Close() error { return nil }

// Effective applies every delay as asked.
func (r *recorder) Effective(d time.Duration) (time.Duration, error) { return d, nil }

func newTestRetry(t *testing.T, policy Policy) (*Retry, *recorder, *recorder) {
	t.Helper()
	delayPub, poisonPub := &recorder{}, &recorder{}
	r, err := NewRetry(RetryConfig{
		Policy: policy, Delay: delayPub, Poison: poisonPub, PoisonTopic: "poison",
		Queue: func(string) string { return "work" },
	})
	if err != nil {
		t.Fatal(err)
	}
	return r, delayPub, poisonPub
}

func failing(err error) message.HandlerFunc {
	return func(*message.Message) ([]*message.Message, error) { return nil, err }
}

func TestRetrySchedulesNextAttemptWithoutTouchingTheOriginal(t *testing.T) {
	r, delayPub, poisonPub := newTestRetry(t, Policy{MaxAttempts: 3, Delays: []time.Duration{time.Second, 5 * time.Second}})
	msg := message.NewMessage("uuid-1", []byte("payload"))
	msg.Metadata.Set("user", "kept")
	before := maps.Clone(msg.Metadata)

	if _, err := r.Middleware(failing(errors.New("boom")))(msg); err != nil {
		t.Fatalf("a confirmed hand-off must let the router ack, got %v", err)
	}
	if !maps.Equal(msg.Metadata, before) {
		t.Errorf("incoming metadata changed: %v -> %v", before, msg.Metadata)
	}
	if len(delayPub.msgs) != 1 || len(poisonPub.msgs) != 0 {
		t.Fatalf("delay got %d, poison got %d; want 1 and 0", len(delayPub.msgs), len(poisonPub.msgs))
	}
	cp := delayPub.msgs[0]
	if delayPub.topics[0] != "work" {
		t.Errorf("retry went to %q, want the failing queue", delayPub.topics[0])
	}
	if cp.UUID != msg.UUID || string(cp.Payload) != "payload" || cp.Metadata.Get("user") != "kept" {
		t.Errorf("copy lost the message: %+v", cp)
	}
	if got := Attempt(cp); got != 2 {
		t.Errorf("copy attempt = %d, want 2", got)
	}
	if got := cp.Metadata.Get(wdelay.DelayedForKey); got != "1s" {
		t.Errorf("requested delay %q, want 1s", got)
	}
	if cp.Metadata.Get(ErrorKey) != "boom" || cp.Metadata.Get(FirstFailureKey) == "" {
		t.Errorf("copy misses the failure record: %v", cp.Metadata)
	}
}

func TestRetryPoisonsAfterLastAttempt(t *testing.T) {
	r, delayPub, poisonPub := newTestRetry(t, Policy{MaxAttempts: 3})
	msg := message.NewMessage("uuid-2", nil)
	msg.Metadata.Set(AttemptKey, "3")
	if _, err := r.Middleware(failing(errors.New("still broken")))(msg); err != nil {
		t.Fatal(err)
	}
	if len(delayPub.msgs) != 0 || len(poisonPub.msgs) != 1 || poisonPub.topics[0] != "poison" {
		t.Fatalf("want exactly one poisoned message, got delay=%d poison=%v", len(delayPub.msgs), poisonPub.topics)
	}
	md := poisonPub.msgs[0].Metadata
	for k, want := range map[string]string{
		PoisonReasonKey: PoisonMaxAttempts, AttemptKey: "3", MaxAttemptsKey: "3",
		ErrorKey: "still broken", ErrorTypesKey: "*errors.errorString", QueueKey: "work",
	} {
		if md.Get(k) != want {
			t.Errorf("%s = %q, want %q", k, md.Get(k), want)
		}
	}
	if msg.Metadata.Get(PoisonReasonKey) != "" {
		t.Error("the incoming message was modified")
	}
}

func TestRetryPermanentPoisonsAtOnce(t *testing.T) {
	r, delayPub, poisonPub := newTestRetry(t, Policy{MaxAttempts: 10})
	if _, err := r.Middleware(failing(Permanent(errors.New("invalid"))))(message.NewMessage("u", nil)); err != nil {
		t.Fatal(err)
	}
	if len(delayPub.msgs) != 0 || len(poisonPub.msgs) != 1 {
		t.Fatalf("delay=%d poison=%d, want 0 and 1", len(delayPub.msgs), len(poisonPub.msgs))
	}
	if got := poisonPub.msgs[0].Metadata.Get(PoisonReasonKey); got != PoisonPermanent {
		t.Errorf("reason %q, want %q", got, PoisonPermanent)
	}
}

func TestRetryAfterAndClassifyOverride(t *testing.T) {
	delayPub, poisonPub := &recorder{}, &recorder{}
	var seen ClassifyParams
	r, err := NewRetry(RetryConfig{
		Delay: delayPub, Poison: poisonPub, PoisonTopic: "p", Queue: func(string) string { return "q" },
		Classify: func(p ClassifyParams) Decision {
			seen = p
			if strings.Contains(p.Err.Error(), "fatal") {
				return Decision{Permanent: true}
			}
			return p.Default
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Middleware(failing(RetryAfter(errors.New("429"), 42*time.Second)))(message.NewMessage("a", nil)); err != nil {
		t.Fatal(err)
	}
	if got := delayPub.msgs[0].Metadata.Get(wdelay.DelayedForKey); got != "42s" {
		t.Errorf("RetryAfter delay %q, want 42s", got)
	}
	if seen.Attempt != 1 || seen.Default.Delay != 42*time.Second {
		t.Errorf("classifier params %+v", seen)
	}
	if _, err := r.Middleware(failing(errors.New("fatal")))(message.NewMessage("b", nil)); err != nil {
		t.Fatal(err)
	}
	if len(poisonPub.msgs) != 1 {
		t.Errorf("classifier's Permanent decision was not honoured")
	}
}

func TestRetryHandoffFailureFailsTheHandler(t *testing.T) {
	r, delayPub, poisonPub := newTestRetry(t, Policy{MaxAttempts: 2})
	delayPub.err = errors.New("channel closed")
	poisonPub.err = errors.New("channel closed")
	handlerErr := errors.New("boom")

	_, err := r.Middleware(failing(handlerErr))(message.NewMessage("a", nil))
	if !errors.Is(err, ErrHandoff) || !errors.Is(err, handlerErr) {
		t.Fatalf("retry hand-off failure: got %v, want ErrHandoff joined with the handler error", err)
	}
	last := message.NewMessage("b", nil)
	last.Metadata.Set(AttemptKey, "2")
	_, err = r.Middleware(failing(handlerErr))(last)
	if !errors.Is(err, ErrHandoff) || !strings.Contains(err.Error(), `"poison"`) {
		t.Fatalf("poison hand-off failure: got %v, want ErrHandoff naming the poison topic", err)
	}
}

func TestRetrySuccessPassesThrough(t *testing.T) {
	r, delayPub, _ := newTestRetry(t, Policy{})
	out := []*message.Message{message.NewMessage("out", nil)}
	got, err := r.Middleware(func(*message.Message) ([]*message.Message, error) { return out, nil })(message.NewMessage("in", nil))
	if err != nil || len(got) != 1 || got[0] != out[0] || len(delayPub.msgs) != 0 {
		t.Fatalf("success path changed: %v %v", got, err)
	}
}

func TestRetryConfigValidateNamesTheField(t *testing.T) {
	_, err := NewRetry(RetryConfig{Policy: Policy{MaxAttempts: -2}})
	for _, field := range []string{"invalid config", "Policy", "MaxAttempts", "Delay", "Poison", "PoisonTopic"} {
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("NewRetry error %v does not name %s", err, field)
		}
	}
}

func TestAttempt(t *testing.T) {
	for _, tt := range []struct {
		value string
		want  int
	}{{"", 1}, {"1", 1}, {"4", 4}, {"0", 1}, {"-3", 1}, {"x", 1}} {
		msg := message.NewMessage("u", nil)
		if tt.value != "" {
			msg.Metadata.Set(AttemptKey, tt.value)
		}
		if got := Attempt(msg); got != tt.want {
			t.Errorf("Attempt(%q) = %d, want %d", tt.value, got, tt.want)
		}
	}
}

// tooLong is a delay publisher that refuses every delay, as a backend does past its
// maximum.
type tooLong struct{ recorder }

func (p *tooLong) Effective(d time.Duration) (time.Duration, error) {
	return 0, fmt.Errorf("%s: %w", d, delay.ErrDelayTooLong)
}

func TestRetryPoisonsADelayTheBackendRefuses(t *testing.T) {
	poisonPub := &recorder{}
	r, err := NewRetry(RetryConfig{
		Delay: &tooLong{}, Poison: poisonPub, PoisonTopic: "poison", Queue: func(string) string { return "work" },
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Middleware(failing(RetryAfter(errors.New("429"), 100*365*24*time.Hour)))(message.NewMessage("a", nil)); err != nil {
		t.Fatalf("a refused delay must not loop through nack-requeue: %v", err)
	}
	if len(poisonPub.msgs) != 1 || poisonPub.msgs[0].Metadata.Get(PoisonReasonKey) != PoisonDelayTooLong {
		t.Fatalf("want one message poisoned as %s, got %v", PoisonDelayTooLong, poisonPub.msgs)
	}
	if md := poisonPub.msgs[0].Metadata; md.Get(wdelay.DelayedForKey) != "" || md.Get(AttemptKey) != "1" {
		t.Errorf("poisoned copy keeps the refused delay or a wrong attempt: %v", md)
	}
	if got := poisonPub.msgs[0].Metadata.Get(ErrorKey); !strings.Contains(got, "delay too long") || !strings.Contains(got, "429") {
		t.Errorf("envelope error %q should say both why the delay was refused and the handler's error", got)
	}
}

// refusesLarge is a publisher that refuses, as the hand-off does past frame_max, any
// message with a metadata entry longer than limit bytes, and keeps the others.
type refusesLarge struct {
	recorder
	limit int
}

func (p *refusesLarge) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		for k, v := range m.Metadata {
			if len(k)+len(v) > p.limit {
				return fmt.Errorf("publish: %w: %s", delay.ErrTooLarge, k)
			}
		}
	}
	return p.recorder.Publish(topic, msgs...)
}

func TestCopyTooLargeIsPoisonedWithTheHeadersThatFit(t *testing.T) {
	delayPub, poisonPub := &refusesLarge{limit: 1000}, &refusesLarge{limit: 1000}
	r, err := NewRetry(RetryConfig{Delay: delayPub, Poison: poisonPub, PoisonTopic: "poison", Queue: func(string) string { return "work" }})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("big", nil)
	msg.Metadata.Set("huge", strings.Repeat("h", 5000))
	msg.Metadata.Set("small", "kept")
	before := maps.Clone(msg.Metadata)
	if _, err := r.Middleware(failing(errors.New(strings.Repeat("e", 1500))))(msg); err != nil {
		t.Fatalf("a poisoned copy lets the router ack, got %v", err)
	}
	if !maps.Equal(msg.Metadata, before) {
		t.Error("incoming metadata changed")
	}
	if len(delayPub.msgs) != 0 || len(poisonPub.msgs) != 1 {
		t.Fatalf("delay got %d, poison got %d; want 0 and 1", len(delayPub.msgs), len(poisonPub.msgs))
	}
	md := poisonPub.msgs[0].Metadata
	for k, want := range map[string]string{
		PoisonReasonKey:   PoisonTooLarge,
		DroppedHeadersKey: "huge (5004 bytes)",
		"small":           "kept",
	} {
		if got := md.Get(k); got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
	if len(md.Get(ErrorKey)) > trimmedErrorBytes || !strings.Contains(md.Get(ErrorKey), "frame_max") {
		t.Errorf("error not trimmed or reason lost: %q", md.Get(ErrorKey))
	}
}

func TestHandoffFailingForOneMessagePausesThenPoisons(t *testing.T) {
	delayPub, poisonPub := &recorder{err: errors.New("nacked")}, &recorder{}
	r, err := NewRetry(RetryConfig{Delay: delayPub, Poison: poisonPub, PoisonTopic: "poison", Queue: func(string) string { return "work" }, HandoffAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("stuck", nil)
	h := r.Middleware(failing(errFlakyUnit))
	var pauses []time.Duration
	for i := range 2 {
		start := time.Now()
		_, err := h(msg)
		pauses = append(pauses, time.Since(start))
		if !errors.Is(err, ErrHandoff) || !errors.Is(err, errFlakyUnit) {
			t.Fatalf("failure %d: %v, want ErrHandoff joined with the handler's error", i+1, err)
		}
	}
	if pauses[0] < 100*time.Millisecond || pauses[1] < 200*time.Millisecond {
		t.Errorf("pauses %v, want at least 100ms then 200ms", pauses)
	}
	if _, err := h(msg); err != nil {
		t.Fatalf("third failure: %v, want the message poisoned and acked", err)
	}
	if len(poisonPub.msgs) != 1 || poisonPub.msgs[0].Metadata.Get(PoisonReasonKey) != PoisonHandoffFailed {
		t.Fatalf("poisoned %d, want 1 with reason handoff-failed", len(poisonPub.msgs))
	}
	if e := poisonPub.msgs[0].Metadata.Get(ErrorKey); !strings.Contains(e, "3 hand-offs failed") || !strings.Contains(e, "nacked") {
		t.Errorf("poison error %q", e)
	}
}

var errFlakyUnit = errors.New("flaky")

// stamped returns a message delivered by the subscriber of the Retry named owner.
func stamped(owner string) *message.Message {
	msg := message.NewMessage("m-"+owner, nil)
	if owner != "" {
		msg.Metadata.Set("test-owner", owner)
	}
	return msg
}

func TestEachRetryActsOnlyOnItsOwnSubscribersMessages(t *testing.T) {
	pubs := map[string]*recorder{}
	retries := map[string]*Retry{}
	for _, id := range []string{"billing", "shipping"} {
		pubs[id] = &recorder{}
		r, err := NewRetry(RetryConfig{Delay: pubs[id], Poison: &recorder{}, PoisonTopic: "poison", Subscriber: id,
			Owner: func(m *message.Message) string { return m.Metadata.Get("test-owner") },
			Queue: func(string) string { return "q-" + id }})
		if err != nil {
			t.Fatal(err)
		}
		retries[id] = r
	}
	for _, order := range [][]string{{"billing", "shipping"}, {"shipping", "billing"}} {
		h := message.HandlerFunc(failing(errFlakyUnit))
		for _, id := range slices.Backward(order) { // order[0] outermost
			h = retries[id].Middleware(h)
		}
		for _, owner := range []string{"billing", "shipping"} {
			pubs["billing"].msgs, pubs["shipping"].msgs = nil, nil
			if _, err := h(stamped(owner)); err != nil {
				t.Fatalf("order %v, owner %s: %v", order, owner, err)
			}
			for id, p := range pubs {
				if want := map[bool]int{true: 1, false: 0}[id == owner]; len(p.msgs) != want {
					t.Errorf("order %v, owner %s: %s's Retry handed off %d, want %d", order, owner, id, len(p.msgs), want)
				}
			}
		}
	}

	// A message of a subscriber whose Retry is not on the handler, or of no Retry's
	// subscriber, is nobody's to route: it fails loudly, once, naming the fix.
	h := retries["billing"].Middleware(retries["shipping"].Middleware(failing(errFlakyUnit)))
	for _, owner := range []string{"elsewhere", ""} {
		_, err := h(stamped(owner))
		if !errors.Is(err, ErrNotWired) || !errors.Is(err, errFlakyUnit) || strings.Count(err.Error(), ErrNotWired.Error()) != 1 {
			t.Errorf("owner %q: %v, want one ErrNotWired joined with the handler's error", owner, err)
		}
		if !strings.Contains(err.Error(), "AddHandler") {
			t.Errorf("owner %q: %v does not name the fix", owner, err)
		}
	}
}

func TestRetryLogSampling(t *testing.T) {
	for _, tt := range []struct {
		every  int
		logged int // of 10 retries
	}{{0, 10}, {1, 10}, {3, 4}, {10, 1}, {-1, 0}} {
		logs := watermill.NewCaptureLogger()
		r, err := NewRetry(RetryConfig{Delay: &recorder{}, Poison: &recorder{}, PoisonTopic: "p", RetryLogEvery: tt.every, Logger: logs,
			Policy: Policy{MaxAttempts: 100}, Queue: func(string) string { return "work" }})
		if err != nil {
			t.Fatal(err)
		}
		for i := range 10 {
			if _, err := r.Middleware(failing(errFlakyUnit))(message.NewMessage(fmt.Sprint(i), nil)); err != nil {
				t.Fatal(err)
			}
		}
		if n := len(logs.Captured()[watermill.InfoLogLevel]); n != tt.logged {
			t.Errorf("RetryLogEvery %d: %d lines for 10 retries, want %d", tt.every, n, tt.logged)
		}
		if st := r.Stats(); st.Retries != 10 {
			t.Errorf("Stats().Retries = %d, want 10", st.Retries)
		}
	}
}
