package middleware

import (
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

func TestWorkQueueWarning(t *testing.T) {
	quorum := func(kv ...any) amqp.Table {
		args := amqp.Table{"x-queue-type": "quorum"}
		for i := 0; i < len(kv); i += 2 {
			args[kv[i].(string)] = kv[i+1]
		}
		return args
	}
	for _, tt := range []struct {
		name        string
		version     string
		args        amqp.Table
		maxAttempts int
		want        string // substring; "" for no warning
	}{
		{"classic queue", "4.1.0", nil, 5, ""},
		{"explicit classic", "4.1.0", amqp.Table{"x-queue-type": "classic"}, 5, ""},
		{"quorum 3.13 without limit", "3.13.7", quorum(), 5, ""},
		{"quorum 4.0 without limit", "4.0.0", quorum(), 5, "applies a limit of 20"},
		{"quorum 4.1 without limit", "4.1.2", quorum(), 5, "-1 for no limit"},
		{"quorum unknown version without limit", "", quorum(), 5, "x-delivery-limit"},
		{"quorum 4.3 without limit", "4.3.6", quorum(), 5, ""},
		{"limit disabled", "4.0.0", quorum("x-delivery-limit", int64(-1)), 5, ""},
		{"limit high", "4.0.0", quorum("x-delivery-limit", int32(50)), 5, ""},
		{"limit equals attempts", "4.0.0", quorum("x-delivery-limit", 5), 5, ""},
		{"limit below attempts", "4.0.0", quorum("x-delivery-limit", int16(3)), 5, "below the policy's 5 attempts"},
		{"limit zero", "3.13.7", quorum("x-delivery-limit", int64(0)), 1, "x-delivery-limit 0"},
		{"limit low on 3.x", "3.12.0", quorum("x-delivery-limit", int64(2)), 10, "at least 10"},
		{"limit not an integer", "4.0.0", quorum("x-delivery-limit", "20"), 5, "expects an integer"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := workQueueWarning(tt.version, tt.args, tt.maxAttempts)
			if tt.want == "" && got != "" || tt.want != "" && !strings.Contains(got, tt.want) {
				t.Errorf("workQueueWarning = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestDeadLetterWarning(t *testing.T) {
	quorum := func(kv ...any) amqp.Table {
		args := amqp.Table{"x-queue-type": "quorum"}
		for i := 0; i < len(kv); i += 2 {
			args[kv[i].(string)] = kv[i+1]
		}
		return args
	}
	for _, tt := range []struct {
		name    string
		version string
		args    amqp.Table
		want    string // substring; "" for no warning
	}{
		{"classic queue", "4.3.6", nil, ""},
		{"quorum 3.10 without limit", "3.10.8", quorum(), ""},
		{"quorum 3.10 with a limit", "3.10.8", quorum("x-delivery-limit", int32(5)), `past its x-delivery-limit (5) the broker drops`},
		{"quorum 4.3 without limit", "4.3.6", quorum(), "past the default delivery limit of RabbitMQ 4.0 and later (20)"},
		{"quorum 4.0, unknown version", "", quorum(), "(20) the broker drops"},
		{"the fix names the poison queue", "4.3.6", quorum(), `x-dead-letter-exchange "" and x-dead-letter-routing-key "shop.poison"`},
		{"limit disabled", "4.3.6", quorum("x-delivery-limit", int64(-1)), ""},
		{"dead-lettered", "4.3.6", quorum("x-dead-letter-exchange", ""), ""},
		{"dead-lettered elsewhere", "4.3.6", quorum("x-delivery-limit", 3, "x-dead-letter-exchange", "dlx"), ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := deadLetterWarning(tt.version, tt.args, "shop.poison")
			if tt.want == "" && got != "" || tt.want != "" && !strings.Contains(got, tt.want) {
				t.Errorf("deadLetterWarning = %q, want %q", got, tt.want)
			}
		})
	}
}

// TestStartInProcess: without a URI the Retry runs in this process on the memory
// backend: retries come back to the topic after their delay, poisoned messages go to
// the poison queue's topic.
func TestStartInProcess(t *testing.T) {
	rec := brokertest.NewRecorder(10)
	cfg := amqpretry.Config{Backend: delay.Memory(rec), Policy: amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{time.Millisecond}}}
	retry, err := New(cfg, Transport{})
	if err != nil {
		t.Fatal(err)
	}
	defer retry.Close()
	r := retry.r
	if r.handoff != nil || r.id != "" || r.scheduler() == nil || r.cfg.PoisonQueue != "amqpretry.poison" {
		t.Errorf("in-process Retry: hand-off %v, id %q, config %+v", r.handoff, r.id, r.cfg)
	}
	r.engine.wiring.Queue = func(string) string { return "work" } // no router: no topic in the context
	h := retry.Middleware(failing(errFlaky))
	if _, err := h(message.NewMessage("m", []byte("body"))); err != nil {
		t.Fatal(err)
	}
	p := rec.Next(t)
	if p.Topic != "work" || p.Msg.UUID != "m" || string(p.Msg.Payload) != "body" || amqpretry.Attempt(p.Msg) != 2 {
		t.Fatalf("retry published to %q: %+v", p.Topic, p.Msg)
	}
	if _, err := h(p.Msg); err != nil {
		t.Fatal(err)
	}
	p = rec.Next(t)
	if p.Topic != "amqpretry.poison" || ReadEnvelope(p.Msg.Metadata).Reason != amqpretry.ReasonMaxAttempts {
		t.Fatalf("poisoned to %q: %v", p.Topic, p.Msg.Metadata)
	}
	if st := retry.Stats(); st != (Stats{Retries: 1, Poisoned: 1}) {
		t.Errorf("stats %+v", st)
	}
}

// fakeHolder is a backend that holds retries, as delayed-retry is: its delay is the queue's, and it
// records what it is asked to settle.
type fakeHolder struct {
	fakeBackend
	smu     sync.Mutex
	settled []message.Metadata
	err     error
}

func newFakeHolder(d time.Duration) *fakeHolder {
	return &fakeHolder{fakeBackend: fakeBackend{name: (delay.DelayedRetry(0)).Name(), effective: func(time.Duration) (time.Duration, error) { return d, nil },
		caps: backend.Caps{Keeps: backend.KeepsDelivery, Longest: d, PastLongest: backend.HoldAgain}}}
}

// OneDelay: every retry is held for the queue's one delay (backend.Constant).
func (p *fakeHolder) OneDelay() time.Duration { return p.caps.Longest }

func (p *fakeHolder) Settle(msg *message.Message, effective time.Duration, envelope message.Metadata) error {
	p.smu.Lock()
	defer p.smu.Unlock()
	if p.err != nil {
		return p.err
	}
	p.settled = append(p.settled, envelope)
	return nil
}

// TestHeldRetries: with held retries the first ones are settled for the broker to
// hold. A retry that comes back long before its due time may have lost its nack with
// its connection (the broker gives the delivery back at once): it is held again. When
// the same message comes back early a second time in a row, the work queue does not
// hold retries: it is marked, logged, and its later retries go to the copying backend.
func TestHeldRetries(t *testing.T) {
	b := &fakeBackend{}
	var events []amqpretry.Event
	logs := &countingLogger{}
	e, _ := newEngine(t, amqpretry.Config{Backend: delay.HeldRetries(3, time.Minute, nil), Logger: logs,
		Policy:  amqpretry.Policy{MaxAttempts: 6, Delays: []time.Duration{7 * time.Second}, Jitter: -1},
		Observe: func(ev amqpretry.Event) { events = append(events, ev) }}, b)
	holder := newFakeHolder(time.Minute)
	e.holder = keep(holder)
	h := e.Middleware(failing(errFlaky))

	if _, err := h(message.NewMessage("m", nil)); err != nil {
		t.Fatal(err)
	}
	if len(holder.settled) != 1 || len(b.parked) != 0 {
		t.Fatalf("settled %d, parked %d; want the first retry held", len(holder.settled), len(b.parked))
	}
	if holder.settled[0] != nil {
		t.Errorf("an envelope was built for a nack, which cannot carry it: %v", holder.settled[0])
	}
	if last := events[len(events)-1]; last.Backend != (delay.DelayedRetry(0)).Name() || last.Effective != time.Minute {
		t.Errorf("event %+v", last)
	}
	back := func(attempt int) {
		t.Helper()
		msg := message.NewMessage("m", nil)
		msg.Metadata.Set(keys.Attempt, strconv.Itoa(attempt))
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	}
	// Back at once (the broker counted the return: attempt 2), once: not judged yet,
	// held again.
	back(2)
	if e.held.isBroken("work") || logs.errors != 0 {
		t.Errorf("queue marked broken after one early return (errors logged: %d)", logs.errors)
	}
	if len(holder.settled) != 2 || len(b.parked) != 0 {
		t.Fatalf("settled %d, parked %d; want the second retry held again", len(holder.settled), len(b.parked))
	}
	// Back at once again, in a row: the queue does not hold retries. The next retry is
	// a copy, after the schedule's first delay.
	back(3)
	if !e.held.isBroken("work") || logs.errors != 1 {
		t.Errorf("queue not marked broken after two early returns in a row (errors logged: %d)", logs.errors)
	}
	if len(b.parked) != 1 || len(holder.settled) != 2 {
		t.Fatalf("settled %d, parked %d; want the third retry copied", len(holder.settled), len(b.parked))
	}
	if env := ReadEnvelope(b.msgs()[0].Metadata); env.Attempt != 4 || env.RequestedDelay != 7*time.Second {
		t.Errorf("copied retry %+v, want attempt 4 after the schedule's first delay", env)
	}
}

// TestHeldRetryBackEarlyOnceIsNotJudged: a held retry given back at once (its nack lost
// with its connection) and then held as it should be never marks the queue, however
// many messages it happens to.
func TestHeldRetryBackEarlyOnceIsNotJudged(t *testing.T) {
	logs := &countingLogger{}
	// Every run fails, retries included: outage detection would stop the queue at the
	// tenth failure; this test is about held retries' early returns.
	e, _ := newEngine(t, amqpretry.Config{Backend: delay.DelayedRetry(time.Second), Logger: logs,
		Policy: amqpretry.Policy{MaxAttempts: 10}, Outage: amqpretry.Outage{Consecutive: -1}}, nil)
	e.backend = nil
	e.holder = keep(newFakeHolder(time.Second))
	h := e.Middleware(failing(errFlaky))
	for _, id := range []string{"a", "b", "c", "d"} {
		for attempt := 1; attempt <= 2; attempt++ { // held, then back at once
			msg := message.NewMessage(id, nil)
			msg.Metadata.Set(keys.Attempt, strconv.Itoa(attempt))
			if _, err := h(msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	if e.held.isBroken("work") || logs.errors != 0 {
		t.Fatalf("queue marked broken by single early returns (errors logged: %d)", logs.errors)
	}
	// Each is now held again; when it comes back due, its count of early returns starts
	// again.
	for _, id := range []string{"a", "b", "c", "d"} {
		hr, ok := e.held.take("work", id)
		if !ok || hr.early != 1 {
			t.Fatalf("%s: held %v, early returns %d; want held again after one", id, ok, hr.early)
		}
		hr.due = time.Now()
		e.held.add("work", id, hr)
		msg := message.NewMessage(id, nil)
		msg.Metadata.Set(keys.Attempt, "3")
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
		if hr, _ := e.held.take("work", id); hr.early != 0 {
			t.Errorf("%s: early returns %d after coming back due, want 0", id, hr.early)
		}
	}
	if e.held.isBroken("work") {
		t.Error("queue marked broken")
	}
}

// TestHeldSettlesOnce: a retry held in the work queue is settled once, by the
// middleware's nack; the handler chain then returns nil, and the router's Ack that
// follows does nothing: the delivery stays nacked, for the broker to hold.
func TestHeldSettlesOnce(t *testing.T) {
	e, _ := newEngine(t, amqpretry.Config{Backend: delay.DelayedRetry(time.Second),
		Policy: amqpretry.Policy{MaxAttempts: 3}}, nil)
	e.backend = nil
	holder := newFakeHolder(time.Second)
	e.holder = keep(holder)
	msg := message.NewMessage("m", nil)
	if _, err := e.Middleware(failing(errFlaky))(msg); err != nil {
		t.Fatal(err)
	}
	if len(holder.settled) != 1 {
		t.Fatalf("settled %d times, want once", len(holder.settled))
	}
	select {
	case <-msg.Nacked():
	default:
		t.Fatal("the held retry was not nacked")
	}
	if msg.Ack() {
		t.Error("the router's Ack acked a delivery the middleware had nacked")
	}
	select {
	case <-msg.Acked():
		t.Error("the delivery is acked: the broker would drop the retry")
	default:
	}
}

// countingLogger counts the errors logged.
type countingLogger struct {
	mu     sync.Mutex
	errors int
}

func (l *countingLogger) Error(string, error, watermill.LogFields) {
	l.mu.Lock()
	l.errors++
	l.mu.Unlock()
}
func (l *countingLogger) Info(string, watermill.LogFields)                 {}
func (l *countingLogger) Debug(string, watermill.LogFields)                {}
func (l *countingLogger) Trace(string, watermill.LogFields)                {}
func (l *countingLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// TestHeldDelayIsTheQueues (issue 33): a retry the broker holds waits the queue's one
// constant delay, whatever the schedule: that delay is the one asked for and the one
// applied. The default policy's jittered backoff is not computed, nor reported as the
// delay asked for (the quickstart printed 3.935251574s→1s).
func TestHeldDelayIsTheQueues(t *testing.T) {
	var events []amqpretry.Event
	e, _ := newEngine(t, amqpretry.Config{Backend: delay.HeldRetries(2, time.Second, nil),
		Observe: func(ev amqpretry.Event) { events = append(events, ev) }}, &fakeBackend{})
	e.holder = keep(newFakeHolder(time.Second))
	h := e.Middleware(failing(errFlaky))
	if _, err := h(message.NewMessage("m", nil)); err != nil {
		t.Fatal(err)
	}
	if len(events) == 0 {
		t.Fatal("no event")
	}
	if last := events[len(events)-1]; last.Kind != amqpretry.EventRetryScheduled || last.Requested != time.Second || last.Effective != time.Second {
		t.Errorf("held retry reported %s→%s (event %+v), want 1s→1s: the queue's delay", last.Requested, last.Effective, last)
	}
}
