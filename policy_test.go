package amqpretry_test

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
)

// discard is a message.Publisher that accepts everything.
type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

// schedule runs the retry engine in-process (memory backend) with policy, fails n
// messages on attempt, and returns the delay the engine asked the backend for each
// time: the policy's schedule as the engine applies it.
func schedule(t testing.TB, policy amqpretry.Policy, attempt, n int) []time.Duration {
	t.Helper()
	var (
		mu        sync.Mutex
		requested []time.Duration
	)
	// Every message fails: outage detection off, or the failures of retries would begin
	// an outage and keep the messages instead of scheduling them.
	cfg := amqpretry.Config{Backend: delay.Memory(discard{}), Policy: policy, Outage: amqpretry.Outage{Consecutive: -1},
		Observe: func(ev amqpretry.Event) {
			if ev.Kind == amqpretry.EventRetryScheduled {
				mu.Lock()
				requested = append(requested, ev.Requested)
				mu.Unlock()
			}
		}}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	r, err := middleware.New(cfg, middleware.Transport{Queue: func(string) string { return "work" }})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close() // stops the memory backend's timers
	h := r.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errors.New("boom") })
	for i := range n {
		msg := message.NewMessage(strconv.Itoa(i), nil)
		msg.Metadata.Set(keys.Attempt, strconv.Itoa(attempt))
		if _, err := h(msg); err != nil {
			t.Fatalf("attempt %d: %v", attempt, err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(requested) != n {
		t.Fatalf("attempt %d: %d retries scheduled, want %d", attempt, len(requested), n)
	}
	return requested
}

func TestPolicyDelay(t *testing.T) {
	tests := []struct {
		name   string
		policy amqpretry.Policy
		want   []time.Duration // delay after attempts 1, 2, 3, ...
	}{
		{
			name:   "defaults without jitter double from 1s",
			policy: amqpretry.Policy{Jitter: -1},
			want:   []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second},
		},
		{
			name:   "multiplier 1.5 keeps its fraction",
			policy: amqpretry.Policy{Delays: amqpretry.Exponential(time.Second, 1.5, 10*time.Minute), Jitter: -1},
			want:   []time.Duration{time.Second, 1500 * time.Millisecond, 2250 * time.Millisecond, 3375 * time.Millisecond},
		},
		{
			name:   "capped at its max, which repeats",
			policy: amqpretry.Policy{Delays: amqpretry.Exponential(100*time.Millisecond, 10, 5*time.Second), Jitter: -1},
			want:   []time.Duration{100 * time.Millisecond, time.Second, 5 * time.Second, 5 * time.Second},
		},
		{
			name:   "explicit delays, last repeats",
			policy: amqpretry.Policy{Delays: []time.Duration{time.Second, time.Minute}, Jitter: -1},
			want:   []time.Duration{time.Second, time.Minute, time.Minute},
		},
		{
			name:   "multiplier 1 is constant",
			policy: amqpretry.Policy{Delays: amqpretry.Exponential(3*time.Second, 1, time.Minute), Jitter: -1},
			want:   []time.Duration{3 * time.Second, 3 * time.Second, 3 * time.Second},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.policy
			p.MaxAttempts = len(tt.want) + 1
			for i, want := range tt.want {
				if got := schedule(t, p, i+1, 1)[0]; got != want {
					t.Errorf("delay after attempt %d = %s, want %s", i+1, got, want)
				}
			}
		})
	}
}

func TestPolicyJitterStaysInBounds(t *testing.T) {
	p := amqpretry.Policy{MaxAttempts: 6, Delays: amqpretry.Exponential(time.Second, 2, 3*time.Second), Jitter: 0.5}
	seen := map[time.Duration]bool{}
	for _, d := range schedule(t, p, 1, 200) {
		if d < 500*time.Millisecond || d > 1500*time.Millisecond {
			t.Fatalf("delay after attempt 1 = %s, outside 1s ± 50%%", d)
		}
		seen[d] = true
	}
	if len(seen) < 10 {
		t.Fatalf("jitter produced only %d distinct delays in 200 draws", len(seen))
	}
	for _, d := range schedule(t, p, 5, 200) {
		if d > 3*time.Second || d < 1500*time.Millisecond {
			t.Fatalf("delay after attempt 5 = %s, want within the longest entry, 3s, and no lower than 3s - 50%%", d)
		}
	}
}

func TestPolicyValidateNamesTheField(t *testing.T) {
	tests := []struct {
		policy amqpretry.Policy
		field  string
	}{
		{amqpretry.Policy{MaxAttempts: -1}, "MaxAttempts"},
		{amqpretry.Policy{Delays: []time.Duration{time.Second, -time.Second}}, "Delays[1]"},
		{amqpretry.Policy{Delays: amqpretry.Exponential(-time.Second, 2, time.Minute)}, "Delays[0]"},
		{amqpretry.Policy{Jitter: 1.5}, "Jitter"},
		{amqpretry.Policy{Jitter: 1}, "Jitter"},
		{amqpretry.Policy{Immediate: -1}, "Immediate"},
	}
	for _, tt := range tests {
		t.Run(tt.field, func(t *testing.T) {
			err := amqpretry.Config{Backend: delay.Memory(discard{}), Policy: tt.policy}.Validate()
			if err == nil || !strings.Contains(err.Error(), "Policy."+tt.field+": ") {
				t.Fatalf("Validate() = %v, want an error naming Policy.%s", err, tt.field)
			}
		})
	}
	// Several invalid fields: each is named.
	err := amqpretry.Config{Backend: delay.Memory(discard{}), Policy: amqpretry.Policy{MaxAttempts: -1, Jitter: 2}}.Validate()
	for _, field := range []string{"MaxAttempts", "Jitter"} {
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("Validate() = %v, does not name %s", err, field)
		}
	}
	// Jitter 1 or more is refused with the fix; a negative one means none.
	err = amqpretry.Config{Backend: delay.Memory(discard{}), Policy: amqpretry.Policy{Jitter: 1.5}}.Validate()
	if want := "Policy.Jitter: 1.5, must be below 1 (a fraction of the delay, either way): set it below 1, 0 for the default 0.2, or -1 for no jitter"; err == nil || err.Error() != want {
		t.Errorf("Jitter 1.5: %v, want %q", err, want)
	}
	if err := (amqpretry.Config{Backend: delay.Memory(discard{}), Policy: amqpretry.Policy{Jitter: -1}}).Validate(); err != nil {
		t.Errorf("Jitter -1 (none): %v", err)
	}
}

// TestPolicyMustFitTheBackend: a policy whose longest delay the backend refuses is
// refused up front, naming the delay; one the backend keeps shorter is accepted.
func TestPolicyMustFitTheBackend(t *testing.T) {
	err := amqpretry.Config{Backend: delay.BinaryLevels(4), Policy: amqpretry.Policy{Delays: []time.Duration{time.Second, 20 * time.Second}, Jitter: -1}}.Validate()
	if !errors.Is(err, delay.ErrDelayTooLong) || !strings.Contains(err.Error(), "Policy.Delays[1]: delay too long: with 5 attempts the policy asks for up to 20s") {
		t.Errorf("binary-levels with 4 levels and a 20s delay: %v", err)
	}
	if err := (amqpretry.Config{Policy: amqpretry.Policy{Delays: amqpretry.Exponential(time.Second, 2, 3*time.Hour)}}).Validate(); err != nil {
		t.Errorf("ttl-tiers with delays past its longest tier: %v, want accepted (they are parked again until due)", err)
	}
	err = errors.Join(amqpretry.Config{Backend: delay.DelayedRetry(0), Policy: amqpretry.Policy{Delays: []time.Duration{time.Second, 2 * time.Second}}}.Validate(),
		amqpretry.Config{Backend: delay.DelayedRetry(0), Policy: amqpretry.Policy{Jitter: 0.1}}.Validate())
	for _, field := range []string{"Policy.Delays", "Policy.Jitter"} {
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("delayed-retry with a schedule: %v, does not name %s", err, field)
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
			msg.Metadata.Set(keys.Attempt, tt.value)
		}
		if got := amqpretry.Attempt(msg); got != tt.want {
			t.Errorf("Attempt(%q) = %d, want %d", tt.value, got, tt.want)
		}
	}
}

func TestDecisionOf(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want amqpretry.Decision
	}{
		{"plain", errors.New("x"), amqpretry.Decision{}},
		{"nil", nil, amqpretry.Decision{}},
		{"permanent", fmt.Errorf("ctx: %w", amqpretry.Permanent(errors.New("bad input"))), amqpretry.Decision{Permanent: true}},
		{"retry after", amqpretry.RetryAfter(errors.New("429"), 30*time.Second), amqpretry.Decision{Delay: 30 * time.Second}},
		{"negative retry after", amqpretry.RetryAfter(errors.New("429"), -time.Second), amqpretry.Decision{}},
		{"both", amqpretry.Permanent(amqpretry.RetryAfter(errors.New("x"), time.Second)), amqpretry.Decision{Permanent: true, Delay: time.Second}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := amqpretry.DecisionOf(tt.err); got != tt.want {
				t.Errorf("DecisionOf = %+v, want %+v", got, tt.want)
			}
		})
	}
	if amqpretry.Permanent(nil) != nil || amqpretry.RetryAfter(nil, time.Second) != nil {
		t.Error("marking a nil error must give nil")
	}
	inner := errors.New("inner")
	if err := amqpretry.Permanent(inner); err.Error() != "inner" || !errors.Is(err, inner) {
		t.Errorf("Permanent hides its error: %v", err)
	}
	if err := amqpretry.RetryAfter(inner, time.Second); err.Error() != "inner" || !errors.Is(err, inner) {
		t.Errorf("RetryAfter hides its error: %v", err)
	}
}

// TestConfigValidateNamesTheField: every invalid field of the Config is named, the
// topology mode among them (once topology.ParseMode's test).
func TestConfigValidateNamesTheField(t *testing.T) {
	err := amqpretry.Config{
		Topology: "passive", Backend: delay.HeldRetries(-1, 0, delay.BinaryLevels(30)), PoisonQueue: strings.Repeat("p", 256),
	}.Validate()
	for _, want := range []string{
		`Topology: unknown mode "passive" (known: declare, verify, none)`, "Levels: 30 is outside 1 to 29",
		"PoisonQueue:", "delay.HeldRetries(n): -1 is negative",
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate() = %v, does not say %q", err, want)
		}
	}
	for _, mode := range []string{"", "declare", "verify", "none"} {
		if err := (amqpretry.Config{Topology: topology.Mode(mode)}).Validate(); err != nil {
			t.Errorf("mode %q: %v", mode, err)
		}
	}
}

// TestExponential: the schedule Exponential builds grows by its multiplier, fractions
// kept, each delay capped at max, and ends with max; a multiplier of 1 or less, or an
// initial of max or more, gives one delay; it never grows past 64 steps.
func TestExponential(t *testing.T) {
	ms := time.Millisecond
	for _, tt := range []struct {
		initial    time.Duration
		multiplier float64
		max        time.Duration
		want       []time.Duration
	}{
		{time.Second, 2, 10 * time.Second, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 10 * time.Second}},
		{time.Second, 1.5, 4 * time.Second, []time.Duration{time.Second, 1500 * ms, 2250 * ms, 3375 * ms, 4 * time.Second}},
		{time.Second, 2, 8 * time.Second, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second}},
		{3 * time.Second, 1, time.Minute, []time.Duration{3 * time.Second}},
		{time.Minute, 2, time.Second, []time.Duration{time.Second}},
	} {
		if got := amqpretry.Exponential(tt.initial, tt.multiplier, tt.max); !slices.Equal(got, tt.want) {
			t.Errorf("Exponential(%s, %g, %s) = %v, want %v", tt.initial, tt.multiplier, tt.max, got, tt.want)
		}
	}
	if got := amqpretry.Exponential(time.Nanosecond, 1.0001, time.Hour); len(got) != 65 || got[64] != time.Hour {
		t.Errorf("a slow growth: %d delays ending %s, want 64 steps and the max", len(got), got[len(got)-1])
	}
}
