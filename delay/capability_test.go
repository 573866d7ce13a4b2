package delay

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/brokertest"
)

func TestParseVersion(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want version
		ok   bool
	}{
		{"3.10.8", version{3, 10, 8}, true},
		{"3.13.7", version{3, 13, 7}, true},
		{"4.0.0-rc.1", version{4, 0, 0}, true},
		{"4.0.0+2", version{4, 0, 0}, true},
		{"4.1", version{4, 1, 0}, true},
		{"10.20.30", version{10, 20, 30}, true},
		{"", version{}, false},
		{"4", version{}, false},
		{"unknown", version{}, false},
		{"v4.0.1", version{}, false},
	} {
		got, ok := parseVersion(tt.in)
		if got != tt.want || ok != tt.ok {
			t.Errorf("parseVersion(%q) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

func TestVersionWarning(t *testing.T) {
	for _, tt := range []struct {
		version string
		warn    bool
	}{
		{"3.10.8", false},
		{"3.12.14", false},
		{"3.13.0", true},
		{"3.13.0-rc.1", true},
		{"3.13.1", true},
		{"3.13.2", true},
		{"3.13.3", false},
		{"4.0.5", false},
		{"", false},
		{"garbage", false},
	} {
		w := versionWarning(tt.version)
		if (w != "") != tt.warn {
			t.Errorf("versionWarning(%q) = %q, want a warning: %v", tt.version, w, tt.warn)
		}
		if w != "" && !strings.Contains(w, tt.version) {
			t.Errorf("warning %q does not name the version", w)
		}
	}
}

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
		{"limit disabled", "4.0.0", quorum("x-delivery-limit", int64(-1)), 5, ""},
		{"limit high", "4.0.0", quorum("x-delivery-limit", int32(50)), 5, ""},
		{"limit equals attempts", "4.0.0", quorum("x-delivery-limit", 5), 5, ""},
		{"limit below attempts", "4.0.0", quorum("x-delivery-limit", int16(3)), 5, "below the policy's 5 attempts"},
		{"limit zero", "3.13.7", quorum("x-delivery-limit", int64(0)), 1, "x-delivery-limit 0"},
		{"limit low on 3.x", "3.12.0", quorum("x-delivery-limit", int64(2)), 10, "at least 10"},
		{"limit not an integer", "4.0.0", quorum("x-delivery-limit", "20"), 5, "expects an integer"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := WorkQueueWarning(tt.version, tt.args, tt.maxAttempts)
			if tt.want == "" && got != "" || tt.want != "" && !strings.Contains(got, tt.want) {
				t.Errorf("WorkQueueWarning = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestPluginMissingOnBothBrokerGenerations(t *testing.T) {
	for _, tt := range []struct {
		name string
		err  error
		want bool
	}{
		{"3.x connection error", &amqp.Error{Code: amqp.CommandInvalid, Reason: "COMMAND_INVALID - unknown exchange type 'x-delayed-message'"}, true},
		{"4.x channel error", &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - unknown exchange type 'x-delayed-message'"}, true},
		{"wrapped", fmt.Errorf("declare: %w", &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - unknown exchange type 'x-delayed-message'"}), true},
		{"type clash with an existing exchange", &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'amq.direct' in vhost '/': received 'x-delayed-message' but current is 'direct'"}, false},
		{"another unknown type", &amqp.Error{Code: amqp.CommandInvalid, Reason: "COMMAND_INVALID - unknown exchange type 'x-other'"}, false},
		{"access refused", &amqp.Error{Code: amqp.AccessRefused, Reason: "ACCESS_REFUSED"}, false},
		{"nil", nil, false},
	} {
		if got := pluginMissing(tt.err); got != tt.want {
			t.Errorf("%s: pluginMissing = %v, want %v", tt.name, got, tt.want)
		}
	}
}

// TestMissingPluginIsErrPluginMissing: on a broker without the plugin (3.x answers 503,
// 4.x 406), the delayed-exchange backend fails with ErrPluginMissing, never with a
// topology mismatch that would send an operator to delete an exchange.
func TestMissingPluginIsErrPluginMissing(t *testing.T) {
	brokertest.Dial(t)
	h, err := Dial(HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	c, err := Probe(h)
	if err != nil {
		t.Fatal(err)
	}
	if c.DelayedMessagePlugin {
		t.Skipf("RabbitMQ %s has the plugin", c.Version)
	}
	_, err = New(Config{Backend: BackendDelayedExchange, Prefix: brokertest.Prefix(t), Handoff: h})
	if !errors.Is(err, ErrPluginMissing) || !strings.Contains(err.Error(), "rabbitmq-plugins enable") {
		t.Fatalf("RabbitMQ %s: New = %v, want ErrPluginMissing naming the fix", c.Version, err)
	}
	// The same answer where the declaration, not the probe, meets the missing type.
	b := &delayedExchange{names: names{brokertest.Prefix(t)}}
	err = h.Declare(b.Topology())
	if !pluginMissing(err) {
		t.Fatalf("RabbitMQ %s: declaring the exchange gave %v, which pluginMissing does not recognise", c.Version, err)
	}
}

// TestProbe runs against the broker: it reads the version, tells about the plugin, and
// leaves the hand-off connection open.
func TestProbe(t *testing.T) {
	brokertest.Dial(t)
	h, err := Dial(HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	before, err := h.Connection()
	if err != nil {
		t.Fatal(err)
	}
	c, err := Probe(h)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := parseVersion(c.Version); !ok {
		t.Errorf("version %q", c.Version)
	}
	after, err := h.Connection()
	if err != nil || after != before || after.IsClosed() {
		t.Errorf("the probe disturbed the hand-off connection (err %v)", err)
	}
	t.Logf("RabbitMQ %s, delayed-message plugin enabled: %v", c.Version, c.DelayedMessagePlugin)
}
