package delay_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
)

func caseOf(t *testing.T, name string) backendCase {
	t.Helper()
	for _, bc := range backendCases {
		if bc.name == name {
			return bc
		}
	}
	t.Fatalf("no backend case %s", name)
	return backendCase{}
}

// TestBinaryLevelsLongDelays: 3s, 17s and 65s, scheduled together, each come back within
// the backend's precision (3 = 2+1, 17 = 16+1, 65 = 64+1: two levels each).
func TestBinaryLevelsLongDelays(t *testing.T) {
	bc := caseOf(t, delay.BackendBinaryLevels)
	r := newRig(t, bc)
	delays := map[string]time.Duration{"3s": 3 * time.Second, "17s": 17 * time.Second, "65s": 65 * time.Second}
	for id, d := range delays {
		r.schedule(r.queue, id, d)
	}
	for _, a := range collect(t, r.queue, len(delays), 90*time.Second) {
		due := dueOf(t, a.msg)
		t.Logf("%s delay came back %s after its due time", a.msg.UUID, a.at.Sub(due).Round(time.Millisecond))
		checkOnTime(t, bc, a)
	}
}

func TestBinaryLevelsRefusesDelayPastMaximum(t *testing.T) {
	brokertest.Dial(t)
	h, err := delay.Dial(delay.HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	b, err := delay.New(delay.Config{Backend: delay.BackendBinaryLevels, Prefix: brokertest.Prefix(t), Levels: 4, Handoff: h})
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, b.Topology())

	if d, err := b.Effective(15 * time.Second); err != nil || d != 15*time.Second {
		t.Errorf("Effective(15s) = %s, %v; want 15s, the maximum with 4 levels", d, err)
	}
	for _, d := range []time.Duration{15*time.Second + time.Millisecond, 16 * time.Second, time.Hour} {
		if _, err := b.Effective(d); !errors.Is(err, delay.ErrDelayTooLong) {
			t.Errorf("Effective(%s): %v, want ErrDelayTooLong", d, err)
		}
		msg := message.NewMessage("late", nil)
		wdelay.Message(msg, wdelay.For(d))
		err := b.Publish("orders", msg)
		if !errors.Is(err, delay.ErrDelayTooLong) {
			t.Fatalf("Publish %s: %v, want ErrDelayTooLong", d, err)
		}
		for _, want := range []string{d.String(), "maximum 15s", `"orders"`} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not say %q", err, want)
			}
		}
	}
}

// TestDelayedExchangeWithoutPlugin: where the plugin is missing, New says so and how to
// enable it, declares nothing and leaves the hand-off connection open.
func TestDelayedExchangeWithoutPlugin(t *testing.T) {
	brokertest.Dial(t)
	h, err := delay.Dial(delay.HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	if why := skipWithoutPlugin(t, h); why == "" {
		t.Skip("the delayed-message plugin is enabled here; the conformance suite covers that case")
	}
	conn, err := h.Connection()
	if err != nil {
		t.Fatal(err)
	}
	prefix := brokertest.Prefix(t)
	_, err = delay.New(delay.Config{Backend: delay.BackendDelayedExchange, Prefix: prefix, Handoff: h})
	if !errors.Is(err, delay.ErrPluginMissing) {
		t.Fatalf("New: %v, want ErrPluginMissing", err)
	}
	for _, want := range []string{"rabbitmq_delayed_message_exchange", "rabbitmq-plugins enable rabbitmq_delayed_message_exchange", prefix + ".delayed"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if after, err := h.Connection(); err != nil || after != conn || conn.IsClosed() {
		t.Errorf("the failed construction disturbed the hand-off connection (err %v)", err)
	}
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclarePassive(prefix+".delayed", "x-delayed-message", true, false, false, false, nil); err == nil {
		t.Errorf("exchange %s.delayed exists", prefix)
	}
}

// TestDelayedExchangeRefusesMissingQueue needs the plugin: the binding made before the
// first publish proves the queue exists, since the plugin cannot return a publish.
func TestDelayedExchangeRefusesMissingQueue(t *testing.T) {
	r := newRig(t, caseOf(t, delay.BackendDelayedExchange)) // skips without the plugin
	msg := message.NewMessage("lost", nil)
	wdelay.Message(msg, wdelay.For(time.Second))
	missing := r.prefix + ".missing"
	if err := r.backend.Publish(missing, msg); err == nil || !strings.Contains(err.Error(), missing) {
		t.Fatalf("Publish to a missing queue: %v, want an error naming it", err)
	}
}

// TestBackendsShareAPrefix: ttl-tiers and binary-levels declare no name two ways (their
// delivery exchanges differ in kind), so both can be built under one prefix.
func TestBackendsShareAPrefix(t *testing.T) {
	brokertest.Dial(t)
	h, err := delay.Dial(delay.HandoffConfig{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	prefix := brokertest.Prefix(t)
	for _, name := range []string{delay.BackendTTLTiers, delay.BackendBinaryLevels, delay.BackendTTLTiers} {
		b, err := delay.New(delay.Config{Backend: name, Prefix: prefix, Handoff: h})
		if err != nil {
			t.Fatalf("%s under a prefix shared with the other backend: %v", name, err)
		}
		brokertest.CleanupTopology(t, b.Topology())
	}
}
