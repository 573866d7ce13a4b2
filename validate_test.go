package amqpretry_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqpv3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// TestLimitCheckedAgainstTheSchedule (issue 25 §2): a backend's limit is checked
// against the longest delay the policy can actually ask for, given MaxAttempts and the
// schedule, never against a default the schedule cannot reach; the refusal names the
// field to change.
func TestLimitCheckedAgainstTheSchedule(t *testing.T) {
	levels := func(n int, p amqpretry.Policy) amqpretry.Config {
		return amqpretry.Config{Backend: delay.BinaryLevels(n), Policy: p}
	}
	for _, tt := range []struct {
		name string
		cfg  amqpretry.Config
		want []string // nil: accepted
	}{
		// 3 attempts: 2 retries, 1s and 2s (+20% jitter), far below 31s.
		{"two retries fit 31s", levels(5, amqpretry.Policy{MaxAttempts: 3, Delays: amqpretry.Exponential(time.Second, 2, time.Minute)}), nil},
		// The default policy: 4 retries, the last 8s + 20%.
		{"default policy fits 31s", levels(5, amqpretry.Policy{}), nil},
		{"schedule past 31s", levels(5, amqpretry.Policy{MaxAttempts: 10}),
			[]string{"Policy.Delays: ", "delay too long", "with 10 attempts the policy asks for up to 5m7.2s, jitter included, longer than the 31s", "set Policy.Delays to a schedule of at most 31s (Exponential(time.Second, 2, 31s))", "raise Levels"}},
		{"jitter's upper bound counts", levels(4, amqpretry.Policy{MaxAttempts: 5, Jitter: 0.9}),
			[]string{"Policy.Delays: ", "up to 15.2s, jitter included", "set Policy.Delays to a schedule of at most 15s"}},
		{"without jitter 8s fits 15s", levels(4, amqpretry.Policy{MaxAttempts: 5, Jitter: -1}), nil},
		{"its longest entry caps it", levels(5, amqpretry.Policy{MaxAttempts: 50, Delays: amqpretry.Exponential(time.Second, 2, 31*time.Second)}), nil},
		{"jitter counts below the longest entry", levels(5, amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{30 * time.Second, time.Minute}}),
			[]string{"Policy.Delays[0]: ", "up to 36s, jitter included", "shorten Policy.Delays[0] to at most 25.833333333s"}},
		// Delays past what MaxAttempts reaches are never asked for.
		{"unreached delay", levels(4, amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{time.Second, 20 * time.Second}}), nil},
		{"reached delay", levels(4, amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{time.Second, 20 * time.Second}}),
			[]string{"Policy.Delays[1]: ", "20s", "15s", "shorten Policy.Delays[1] to at most 15s"}},
		// Immediate retries and held retries come first: they leave fewer for the schedule.
		{"immediate retries take the attempts", levels(4, amqpretry.Policy{MaxAttempts: 3, Immediate: 2, Delays: []time.Duration{time.Hour}}), nil},
		{"held retries take the attempts", amqpretry.Config{Backend: delay.HeldRetries(2, 0, delay.BinaryLevels(4)),
			Policy: amqpretry.Policy{MaxAttempts: 4, Delays: []time.Duration{time.Second, time.Hour}}}, nil},
		{"one attempt asks for nothing", levels(1, amqpretry.Policy{MaxAttempts: 1, Delays: []time.Duration{time.Hour}}), nil},
		{"delayed-exchange", amqpretry.Config{Backend: delay.DelayedExchange(), Policy: amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{60 * 24 * time.Hour}}},
			[]string{"Policy.Delays[0]: ", "shorten Policy.Delays[0] to at most 1193h2m47.295s"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if tt.want == nil {
				if err != nil {
					t.Fatalf("Validate() = %v, want accepted", err)
				}
				return
			}
			if !errors.Is(err, delay.ErrDelayTooLong) {
				t.Fatalf("Validate() = %v, want ErrDelayTooLong", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Validate() = %v\ndoes not say %q", err, w)
				}
			}
		})
	}
}

// TestDelayedRetryRefusesOnlyWhatChangesBehaviour (issue 25 §4, issue 43 §3): the
// delayed-retry backend refuses a schedule it cannot keep, and says what it cannot
// keep and the fix; a zero field (its default) and a value its one delay honours are
// accepted. A value set that it would ignore is refused even when it is a copying
// backend's default: a growth was dropped with an INFO line (50 of 50 second retries
// came back after 1s on 4.3, not 2s).
func TestDelayedRetryRefusesOnlyWhatChangesBehaviour(t *testing.T) {
	dr := func(p amqpretry.Policy) amqpretry.Config {
		return amqpretry.Config{Backend: delay.DelayedRetry(0), Policy: p}
	}
	for _, tt := range []struct {
		name string
		cfg  amqpretry.Config
		want []string
	}{
		{"zero defaults", dr(amqpretry.Policy{}), nil},
		{"values its one delay honours", dr(amqpretry.Policy{Delays: amqpretry.Exponential(time.Second, 1, 10*time.Minute)}), nil},
		{"a delay past the default schedule's longest", amqpretry.Config{Backend: delay.DelayedRetry(20 * time.Minute)}, nil},
		{"the default schedule, set", dr(amqpretry.Policy{Delays: amqpretry.Exponential(time.Second, 2, 10*time.Minute)}),
			[]string{"Policy.Delays: ", "one constant delay, every 1s (its delay)", "cannot grow it: leave Policy.Delays empty and set its delay, or use a copying Backend", "HeldRetries"}},
		{"Jitter 0.2", dr(amqpretry.Policy{Jitter: 0.2}), []string{"Policy.Jitter: 0.2, ", "set Policy.Jitter to 0 (or -1)"}},
		{"Jitter with constant delays", dr(amqpretry.Policy{Delays: []time.Duration{time.Second}, Jitter: 0.1}), []string{"Policy.Jitter: 0.1, "}},
		{"a first delay of another length", amqpretry.Config{Backend: delay.DelayedRetry(3 * time.Second), Policy: amqpretry.Policy{Delays: []time.Duration{time.Second}}},
			[]string{"Policy.Delays: [1s], ", "every 3s (its delay): set its delay to 1s instead"}},
		{"no jitter", dr(amqpretry.Policy{Jitter: -1}), nil},
		{"constant delays", dr(amqpretry.Policy{Delays: []time.Duration{time.Second, time.Second}}), nil},
		{"delays of another constant", dr(amqpretry.Policy{Delays: []time.Duration{3 * time.Second}}),
			[]string{"Policy.Delays: ", "3s", "every 1s (its delay)", "set its delay to 3s"}},
		{"a growing schedule", dr(amqpretry.Policy{Delays: []time.Duration{time.Second, 5 * time.Second}}),
			[]string{"Policy.Delays: ", "cannot grow", "HeldRetries"}},
		{"immediate retries", dr(amqpretry.Policy{Immediate: 1}), []string{"Policy.Immediate: 1", "set Policy.Immediate to 0, or use a copying Backend"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if tt.want == nil {
				if err != nil {
					t.Fatalf("Validate() = %v, want accepted", err)
				}
				return
			}
			for _, w := range tt.want {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("Validate() = %v\ndoes not say %q", err, w)
				}
			}
		})
	}
}

// TestValidationLinesNameTheirField (issue 25 §10): every line of a joined
// validation error names its field the same way, "Policy.Jitter: 1.5, must be in
// [0, 1)".
func TestValidationLinesNameTheirField(t *testing.T) {
	err := amqpretry.Config{Backend: delay.Memory(discard{}), Policy: amqpretry.Policy{
		MaxAttempts: -1, Delays: []time.Duration{-time.Second}, Jitter: 1.5, Immediate: -1,
	}}.Validate()
	if err == nil {
		t.Fatal("Validate() = nil")
	}
	lines := strings.Split(err.Error(), "\n")
	want := []string{
		"Policy.MaxAttempts: -1, must be at least 1 (0 means the default, 5)",
		"Policy.Delays[0]: -1s, must not be negative: set it to 0 or more (Exponential builds a growing schedule)",
		"Policy.Jitter: 1.5, must be below 1 (a fraction of the delay, either way): set it below 1, 0 for the default 0.2, or -1 for no jitter",
		"Policy.Immediate: -1, must not be negative: set it to 0 (none) or more",
	}
	if fmt.Sprint(lines) != fmt.Sprint(want) {
		t.Errorf("Validate() lines:\n%s\nwant:\n%s", strings.Join(lines, "\n"), strings.Join(want, "\n"))
	}
}

// logged records a logger's lines.
type logged struct {
	mu    sync.Mutex
	lines []string
}

func (l *logged) add(level, msg string, err error, f watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	line := level + " " + msg
	if err != nil {
		line += " err=" + err.Error()
	}
	for k, v := range f {
		line += fmt.Sprintf(" %s=%v", k, v)
	}
	l.lines = append(l.lines, line)
}

func (l *logged) matching(s string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			out = append(out, line)
		}
	}
	return out
}

type logger struct{ l *logged }

func (g logger) Error(msg string, err error, f watermill.LogFields) { g.l.add("ERROR", msg, err, f) }
func (g logger) Info(msg string, f watermill.LogFields)             { g.l.add("INFO", msg, nil, f) }
func (g logger) Debug(msg string, f watermill.LogFields)            { g.l.add("DEBUG", msg, nil, f) }
func (g logger) Trace(msg string, f watermill.LogFields)            { g.l.add("TRACE", msg, nil, f) }
func (g logger) With(watermill.LogFields) watermill.LoggerAdapter   { return g }

// TestEffectivePolicyLoggedAtStart (issue 25 §8): the policy in effect, defaults
// applied, is logged once at start: attempts (and what 0 meant), the schedule, and
// the backend's limits.
func TestEffectivePolicyLoggedAtStart(t *testing.T) {
	l := &logged{}
	cfg := amqpretry.Config{Backend: delay.Memory(discard{}), Logger: logger{l}}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	r, err := middleware.New(cfg, middleware.Transport{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	lines := l.matching("Broker-side retry ready")
	if len(lines) != 1 {
		t.Fatalf("ready lines: %q, want one", lines)
	}
	for _, want := range []string{
		"max_attempts=5",
		"schedule=1s, ×2 per retry up to 10m0s, jitter ±20%",
		"longest_delay=9.6s",
		"backend_limits=any delay, kept in this process",
	} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("ready line %q does not say %q", lines[0], want)
		}
	}
}

// TestTTLTiersLogsOnlyWhatThePolicyAsks (issue 25 §2): on ttl-tiers, the start-up
// line "longer than the longest tier" appears only when the policy's schedule can
// actually ask for more than the longest tier, not for an entry of Delays it never
// reaches.
func TestTTLTiersLogsOnlyWhatThePolicyAsks(t *testing.T) {
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	for _, tt := range []struct {
		policy amqpretry.Policy
		want   string // "" for no line
	}{
		{amqpretry.Policy{MaxAttempts: 3, Delays: amqpretry.Exponential(time.Second, 2, time.Minute)}, ""},
		{amqpretry.Policy{MaxAttempts: 5}, "policy_longest_delay=9.6s"},
	} {
		l := &logged{}
		cfg := amqpretry.Config{Prefix: prefix, Backend: delay.TTLTiers(time.Second, 2*time.Second, 3*time.Second), Policy: tt.policy, Logger: logger{l}}
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		plan, err := cfg.Plan()
		if err != nil {
			t.Fatal(err)
		}
		brokertest.CleanupTopology(t, plan)
		r, err := middleware.New(cfg, middleware.Transport{URI: brokertest.URI()})
		if err != nil {
			t.Fatal(err)
		}
		_ = r.Close()
		lines := l.matching("longer than the longest tier")
		switch {
		case tt.want == "" && len(lines) > 0:
			t.Errorf("%+v: logged %q, though its longest delay is 2.4s and the longest tier 3s", tt.policy, lines)
		case tt.want != "" && (len(lines) != 1 || !strings.Contains(lines[0], tt.want)):
			t.Errorf("%+v: logged %q, want one line saying %q", tt.policy, lines, tt.want)
		}
	}
}

// TestDeliveryTimeNamesTheTransport (issue 25 §7): delivery-time on the AMQP 0-9-1
// transport is refused naming the transport as what is wrong, not the broker, and the
// fix: the AMQP 1.0 transport, or a backend of 0-9-1.
func TestDeliveryTimeNamesTheTransport(t *testing.T) {
	_, err := wamqp3.New(wamqpv3.NewDurableQueueConfig("amqp://guest:guest@127.0.0.1:1/"), amqpretry.Config{Backend: delay.DeliveryTime()})
	if !errors.Is(err, delay.ErrUnsupported) {
		t.Fatalf("New = %v, want ErrUnsupported", err)
	}
	for _, want := range []string{
		"Backend: delivery-time is not supported on the AMQP 0-9-1 transport (watermill-amqp)",
		"use the AMQP 1.0 transport, package github.com/amqpretry/amqpretry/amqp1, or another Backend",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("New = %v\ndoes not say %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "broker") {
		t.Errorf("New = %v, blames the broker", err)
	}
}

// TestOutageSettingsValidated (issue 41): nonsense Outage settings are refused, each
// naming its field; zero means the default, and a negative Consecutive turns detection
// off whatever the rest says.
func TestOutageSettingsValidated(t *testing.T) {
	for _, tt := range []struct {
		name   string
		outage amqpretry.Outage
		want   []string // nil: accepted
	}{
		{"defaults", amqpretry.Outage{}, nil},
		{"off ignores the rest", amqpretry.Outage{Consecutive: -1, Ratio: 7}, nil},
		{"negative consecutive is off", amqpretry.Outage{Consecutive: -1}, nil},
		{"a window too large", amqpretry.Outage{Consecutive: 1 << 40}, []string{"Outage.Consecutive: 1099511627776, must be at most 100000", "set -1 to turn detection off"}},
		{"ratio past 1", amqpretry.Outage{Ratio: 1.5}, []string{"Outage.Ratio: 1.5, must be in (0, 1]", "Outage.Consecutive -1"}},
		{"negative probe interval", amqpretry.Outage{ProbeInterval: -time.Second}, []string{"Outage.ProbeInterval: -1s", "0 means the default, 1s"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := amqpretry.Config{Outage: tt.outage}.Validate()
			if tt.want == nil {
				if err != nil {
					t.Fatalf("Validate() = %v, want accepted", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate() accepted %+v", tt.outage)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Validate() = %v, want it to say %q", err, w)
				}
			}
		})
	}
}
