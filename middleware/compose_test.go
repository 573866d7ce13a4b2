package middleware

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// counting is a handler that records the attempts it sees and behaves as do says.
type counting struct {
	attempts []int
	do       func(call int) error
}

func (c *counting) handle(msg *message.Message) ([]*message.Message, error) {
	c.attempts = append(c.attempts, amqpretry.Attempt(msg))
	return nil, c.do(len(c.attempts))
}

// TestCompositionWithImmediateAndRecoverer wires what the docs give for in-process
// retries: this Retry with Policy.Immediate, Recoverer nearest the handler.
func TestCompositionWithImmediateAndRecoverer(t *testing.T) {
	chain := func(h message.HandlerFunc) (message.HandlerFunc, *fakeBackend, *poisonQueue) {
		b := &fakeBackend{}
		e, poison := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{time.Second}, Immediate: 2}}, b)
		return e.Middleware(wmiddleware.Recoverer(h)), b, poison
	}

	// A Permanent error is not run again in-process: poisoned after one call.
	c := &counting{do: func(int) error { return amqpretry.Permanent(errors.New("malformed")) }}
	h, b, poison := chain(c.handle)
	if _, err := h(message.NewMessage("p", nil)); err != nil {
		t.Fatal(err)
	}
	if len(c.attempts) != 1 || len(poison.got()) != 1 || len(b.parked) != 0 {
		t.Errorf("permanent: %d calls, %d poisoned, %d parked; want 1, 1, 0", len(c.attempts), len(poison.got()), len(b.parked))
	}

	// A panic becomes an error: retried in-process, then handed to the broker.
	c = &counting{do: func(int) error { panic("boom") }}
	h, b, poison = chain(c.handle)
	if _, err := h(message.NewMessage("q", nil)); err != nil {
		t.Fatal(err)
	}
	if len(c.attempts) != 3 || len(b.parked) != 1 || len(poison.got()) != 0 {
		t.Errorf("panic: %d calls, %d parked, %d poisoned; want 3, 1, 0", len(c.attempts), len(b.parked), len(poison.got()))
	}
}

func TestImmediateRetriesShareTheAttemptCount(t *testing.T) {
	policy := amqpretry.Policy{MaxAttempts: 5, Immediate: 2, Delays: []time.Duration{time.Second, 4 * time.Second}, Jitter: -1}

	// A blip: handled on the third attempt, in-process, nothing handed off.
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Policy: policy}, b)
	c := &counting{do: func(call int) error {
		if call < 3 {
			return errFlaky
		}
		return nil
	}}
	if _, err := e.Middleware(c.handle)(message.NewMessage("blip", nil)); err != nil {
		t.Fatal(err)
	}
	if want := []int{1, 2, 3}; !slices.Equal(c.attempts, want) || len(b.parked) != 0 {
		t.Errorf("blip: attempts %v, %d parked; want %v, 0", c.attempts, len(b.parked), want)
	}

	// Longer trouble: attempts 1-3 in-process, then the first delayed retry, attempt 4,
	// after the schedule's first delay.
	b = &fakeBackend{}
	var events []amqpretry.Event
	e, _ = newEngine(t, amqpretry.Config{Policy: policy, Observe: func(ev amqpretry.Event) { events = append(events, ev) }}, b)
	c = &counting{do: func(int) error { return errFlaky }}
	orig := message.NewMessage("down", nil)
	if _, err := e.Middleware(c.handle)(orig); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.attempts, []int{1, 2, 3}) || len(b.parked) != 1 {
		t.Fatalf("down: attempts %v, %d parked; want [1 2 3], 1", c.attempts, len(b.parked))
	}
	if _, ok := orig.Metadata[keys.Attempt]; ok {
		t.Error("the immediate retries changed the original message")
	}
	env := ReadEnvelope(b.msgs()[0].Metadata)
	if env.Attempt != 4 || env.RequestedDelay != time.Second {
		t.Errorf("first delayed retry: attempt %d after %s, want 4 after 1s", env.Attempt, env.RequestedDelay)
	}
	if last := events[len(events)-1]; last.Kind != amqpretry.EventRetryScheduled || last.Attempt != 3 {
		t.Errorf("retry event %+v, want attempt 3 handed off", last)
	}

	// The delayed retry fails again: no immediate retries after a delayed one.
	c = &counting{do: func(int) error { return errFlaky }}
	if _, err := e.Middleware(c.handle)(b.msgs()[0]); err != nil {
		t.Fatal(err)
	}
	if env := ReadEnvelope(b.msgs()[1].Metadata); !slices.Equal(c.attempts, []int{4}) || env.RequestedDelay != 4*time.Second || env.Attempt != 5 {
		t.Errorf("after a delayed retry: attempts %v, next %+v; want [4], attempt 5 after 4s", c.attempts, env)
	}

	// Only a first delivery gets them: a message delayed by a RetryAfter on its first
	// delivery that fails again on its second gets its next retry delayed, not run at
	// once in the process (issue 50: attempt 3 ran at once).
	b = &fakeBackend{}
	e, _ = newEngine(t, amqpretry.Config{Policy: policy}, b)
	c = &counting{do: func(int) error { return amqpretry.RetryAfter(errFlaky, time.Minute) }}
	if _, err := e.Middleware(c.handle)(message.NewMessage("later", nil)); err != nil {
		t.Fatal(err)
	}
	c = &counting{do: func(int) error { return errFlaky }}
	if _, err := e.Middleware(c.handle)(b.msgs()[0]); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.attempts, []int{2}) || len(b.msgs()) != 2 {
		t.Fatalf("second delivery after a RetryAfter: attempts %v, %d parked; want [2], 2", c.attempts, len(b.msgs()))
	}
	if env := ReadEnvelope(b.msgs()[1].Metadata); env.Attempt != 3 || env.RequestedDelay <= 0 {
		t.Errorf("after a second delivery: next %+v; want attempt 3, delayed", env)
	}

	// A Permanent error skips them, and so does a RetryAfter.
	for _, err := range []error{amqpretry.Permanent(errFlaky), amqpretry.RetryAfter(errFlaky, time.Minute)} {
		b = &fakeBackend{}
		e, poison := newEngine(t, amqpretry.Config{Policy: policy}, b)
		c = &counting{do: func(int) error { return err }}
		if _, err := e.Middleware(c.handle)(message.NewMessage("bad", nil)); err != nil {
			t.Fatal(err)
		}
		if len(c.attempts) != 1 || len(poison.got())+len(b.parked) != 1 {
			t.Errorf("%v: %d calls, %d poisoned, %d parked; want 1 call, one copy", err, len(c.attempts), len(poison.got()), len(b.parked))
		}
	}

	// Immediate retries stop at MaxAttempts: then poisoned.
	b = &fakeBackend{}
	e, poison := newEngine(t, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 2, Immediate: 5}}, b)
	c = &counting{do: func(int) error { return errFlaky }}
	if _, err := e.Middleware(c.handle)(message.NewMessage("short", nil)); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.attempts, []int{1, 2}) || len(poison.got()) != 1 || poison.got()[0].Metadata.Get(keys.Attempt) != "2" {
		t.Errorf("MaxAttempts 2, Immediate 5: attempts %v, %d poisoned", c.attempts, len(poison.got()))
	}
}

// TestClassifyRunsOncePerFailure: with immediate retries on, the decision that ends them
// is the one the failure path uses; Classify (user code, maybe with side effects) is not
// asked twice about the same error.
func TestClassifyRunsOncePerFailure(t *testing.T) {
	for _, tc := range []struct {
		name  string
		err   error
		calls int // handler calls
	}{
		{"permanent", amqpretry.Permanent(errFlaky), 1},
		{"retry-after", amqpretry.RetryAfter(errFlaky, time.Minute), 1},
		{"transient", errFlaky, 3}, // 2 immediate retries, then handed off
	} {
		t.Run(tc.name, func(t *testing.T) {
			classified := 0
			b := &fakeBackend{}
			e, poison := newEngine(t, amqpretry.Config{
				Policy: amqpretry.Policy{MaxAttempts: 5, Immediate: 2, Delays: []time.Duration{time.Second}},
				Classify: func(p amqpretry.ClassifyParams) amqpretry.Decision {
					classified++
					return p.Default
				},
			}, b)
			c := &counting{do: func(int) error { return tc.err }}
			if _, err := e.Middleware(c.handle)(message.NewMessage(tc.name, nil)); err != nil {
				t.Fatal(err)
			}
			if len(c.attempts) != tc.calls || classified != tc.calls {
				t.Errorf("%d handler calls, Classify asked %d times; want %d and %d", len(c.attempts), classified, tc.calls, tc.calls)
			}
			if len(b.parked)+len(poison.got()) != 1 {
				t.Errorf("%d parked + %d poisoned, want exactly one copy", len(b.parked), len(poison.got()))
			}
		})
	}
}

// TestImmediateLeavesUnavailableToTheOutage: with outage detection on, an error marked
// Unavailable is not rerun in the process (the queue's outage deals with it); with
// detection off it is a plain failure, rerun like any other.
func TestImmediateLeavesUnavailableToTheOutage(t *testing.T) {
	policy := amqpretry.Policy{MaxAttempts: 5, Immediate: 2, Delays: []time.Duration{time.Second}, Jitter: -1}
	for _, tt := range []struct {
		name   string
		outage amqpretry.Outage
		runs   int
	}{
		{"detection on", amqpretry.Outage{}, 1},
		{"detection off", amqpretry.Outage{Consecutive: -1}, 3},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e, _ := newEngine(t, amqpretry.Config{Policy: policy, Outage: tt.outage}, &fakeBackend{})
			c := &counting{do: func(int) error { return amqpretry.Unavailable(errors.New("connection refused")) }}
			_, _ = e.Middleware(c.handle)(message.NewMessage("down", nil))
			if len(c.attempts) != tt.runs {
				t.Errorf("runs %v, want %d", c.attempts, tt.runs)
			}
		})
	}
}

// TestDebugsOnlyWhereALineCanBeWritten: the retry's DEBUG line is built only for a
// logger that may write it.
func TestDebugsOnlyWhereALineCanBeWritten(t *testing.T) {
	for _, tt := range []struct {
		name string
		l    watermill.LoggerAdapter
		want bool
	}{
		{"NopLogger", watermill.NopLogger{}, false},
		{"NewStdLogger without debug", watermill.NewStdLogger(false, false), false},
		{"NewStdLogger with debug", watermill.NewStdLogger(true, false), true},
		{"with fields, without debug", watermill.NewStdLogger(false, false).With(watermill.LogFields{"a": 1}), false},
		{"a logger of another type", watermill.NewCaptureLogger(), true},
	} {
		if got := debugs(tt.l); got != tt.want {
			t.Errorf("%s: debugs = %v, want %v", tt.name, got, tt.want)
		}
	}
}
