package middleware

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// counting is a handler that records the attempts it sees and behaves as do says.
type counting struct {
	attempts []int
	do       func(call int) error
}

func (c *counting) handle(msg *message.Message) ([]*message.Message, error) {
	c.attempts = append(c.attempts, Attempt(msg))
	return nil, c.do(len(c.attempts))
}

// TestCompositionWithWatermillRetryAndRecoverer wires the order the docs give: this
// Retry outermost, Watermill's Retry with Retryable, Recoverer nearest the handler.
func TestCompositionWithWatermillRetryAndRecoverer(t *testing.T) {
	chain := func(h message.HandlerFunc) (message.HandlerFunc, *recorder, *recorder) {
		r, delayPub, poisonPub := newTestRetry(t, Policy{MaxAttempts: 5, Delays: []time.Duration{time.Second}})
		inner := wmiddleware.Retry{MaxRetries: 2, ShouldRetry: func(p wmiddleware.RetryParams) bool { return Retryable(p.Err) }}
		return r.Middleware(inner.Middleware(wmiddleware.Recoverer(h))), delayPub, poisonPub
	}

	// A Permanent error is not run again in-process: poisoned after one call.
	c := &counting{do: func(int) error { return Permanent(errors.New("malformed")) }}
	h, delayPub, poisonPub := chain(c.handle)
	if _, err := h(message.NewMessage("p", nil)); err != nil {
		t.Fatal(err)
	}
	if len(c.attempts) != 1 || len(poisonPub.msgs) != 1 || len(delayPub.msgs) != 0 {
		t.Errorf("permanent: %d calls, %d poisoned, %d delayed; want 1, 1, 0", len(c.attempts), len(poisonPub.msgs), len(delayPub.msgs))
	}

	// A panic becomes an error: retried in-process, then handed to the broker.
	c = &counting{do: func(int) error { panic("boom") }}
	h, delayPub, poisonPub = chain(c.handle)
	if _, err := h(message.NewMessage("q", nil)); err != nil {
		t.Fatal(err)
	}
	if len(c.attempts) != 3 || len(delayPub.msgs) != 1 || len(poisonPub.msgs) != 0 {
		t.Errorf("panic: %d calls, %d delayed, %d poisoned; want 3, 1, 0", len(c.attempts), len(delayPub.msgs), len(poisonPub.msgs))
	}

	if Retryable(nil) || Retryable(Permanent(errors.New("x"))) || Retryable(errors.Join(errors.New("x"), ErrHandoff)) || !Retryable(errors.New("x")) {
		t.Error("Retryable misjudges")
	}
}

func TestImmediateRetriesShareTheAttemptCount(t *testing.T) {
	policy := Policy{MaxAttempts: 5, Immediate: 2, Delays: []time.Duration{time.Second, 4 * time.Second}}

	// A blip: handled on the third attempt, in-process, nothing handed off.
	r, delayPub, _ := newTestRetry(t, policy)
	c := &counting{do: func(call int) error {
		if call < 3 {
			return errFlakyUnit
		}
		return nil
	}}
	if _, err := r.Middleware(c.handle)(message.NewMessage("blip", nil)); err != nil {
		t.Fatal(err)
	}
	if want := []int{1, 2, 3}; !slices.Equal(c.attempts, want) || len(delayPub.msgs) != 0 {
		t.Errorf("blip: attempts %v, %d delayed; want %v, 0", c.attempts, len(delayPub.msgs), want)
	}

	// Longer trouble: attempts 1-3 in-process, then the first delayed retry, attempt 4,
	// after the schedule's first delay.
	r, delayPub, _ = newTestRetry(t, policy)
	c = &counting{do: func(int) error { return errFlakyUnit }}
	if _, err := r.Middleware(c.handle)(message.NewMessage("down", nil)); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.attempts, []int{1, 2, 3}) || len(delayPub.msgs) != 1 {
		t.Fatalf("down: attempts %v, %d delayed; want [1 2 3], 1", c.attempts, len(delayPub.msgs))
	}
	md := delayPub.msgs[0].Metadata
	if md.Get(AttemptKey) != "4" || md.Get(RequestedDelayKey) != "1s" {
		t.Errorf("first delayed retry: attempt %s after %s, want 4 after 1s", md.Get(AttemptKey), md.Get(RequestedDelayKey))
	}

	// The delayed retry fails again: no immediate retries after a delayed one.
	c = &counting{do: func(int) error { return errFlakyUnit }}
	if _, err := r.Middleware(c.handle)(delayPub.msgs[0]); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.attempts, []int{4}) || delayPub.msgs[1].Metadata.Get(RequestedDelayKey) != "4s" {
		t.Errorf("after a delayed retry: attempts %v, next delay %s; want [4], 4s", c.attempts, delayPub.msgs[1].Metadata.Get(RequestedDelayKey))
	}

	// A Permanent error skips them.
	r, _, poisonPub := newTestRetry(t, policy)
	c = &counting{do: func(int) error { return Permanent(errFlakyUnit) }}
	if _, err := r.Middleware(c.handle)(message.NewMessage("bad", nil)); err != nil {
		t.Fatal(err)
	}
	if len(c.attempts) != 1 || len(poisonPub.msgs) != 1 {
		t.Errorf("permanent: %d calls, %d poisoned; want 1, 1", len(c.attempts), len(poisonPub.msgs))
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
		{"permanent", Permanent(errFlakyUnit), 1},
		{"retry-after", RetryAfter(errFlakyUnit, time.Minute), 1},
		{"transient", errFlakyUnit, 3}, // 2 immediate retries, then handed off
	} {
		t.Run(tc.name, func(t *testing.T) {
			classified := 0
			delayPub, poisonPub := &recorder{}, &recorder{}
			r, err := NewRetry(RetryConfig{
				Policy: Policy{MaxAttempts: 5, Immediate: 2, Delays: []time.Duration{time.Second}},
				Classify: func(p ClassifyParams) Decision {
					classified++
					return p.Default
				},
				Delay: delayPub, Poison: poisonPub, PoisonTopic: "poison",
				Queue: func(string) string { return "work" },
			})
			if err != nil {
				t.Fatal(err)
			}
			c := &counting{do: func(int) error { return tc.err }}
			if _, err := r.Middleware(c.handle)(message.NewMessage(tc.name, nil)); err != nil {
				t.Fatal(err)
			}
			if len(c.attempts) != tc.calls || classified != tc.calls {
				t.Errorf("%d handler calls, Classify asked %d times; want %d and %d", len(c.attempts), classified, tc.calls, tc.calls)
			}
			if len(delayPub.msgs)+len(poisonPub.msgs) != 1 {
				t.Errorf("%d delayed + %d poisoned, want exactly one copy", len(delayPub.msgs), len(poisonPub.msgs))
			}
		})
	}
}
