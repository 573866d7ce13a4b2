package main

import (
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/redact"
)

// The command reads through the public API only (issue 24): what it derives from it
// must stay what the library defines.

func TestShownKeys(t *testing.T) {
	want := []string{
		keys.Queue, keys.PoisonReason, keys.Error, keys.ErrorTypes, keys.Stack, keys.Attempt,
		keys.MaxAttempts, keys.FirstFailure, keys.LastFailure, keys.Handler, keys.Topic,
		keys.RedriveCount, keys.RedrivenAt, keys.RedrivenFrom, keys.TypedHeaders,
		keys.XDeliveryCount, keys.XAcquiredCount,
	}
	slices.Sort(want)
	if got := slices.Sorted(maps.Keys(shownKeys())); !slices.Equal(got, want) {
		t.Errorf("shown keys:\n got %v\nwant %v", got, want)
	}
}

func TestSpellIsTierName(t *testing.T) {
	for _, d := range []time.Duration{250 * time.Millisecond, time.Second, 1250 * time.Millisecond, 2 * time.Minute,
		90 * time.Minute, time.Hour, 64 * time.Second, 4096 * time.Second, 2*time.Hour + 30*time.Second} {
		if got, want := spell(d), names.Tier(d); got != want {
			t.Errorf("spell(%s) = %q, want %q", d, got, want)
		}
	}
}

func TestRedactAsLibrary(t *testing.T) {
	uris := []string{"amqp://guest:s3cret@127.0.0.1:5672/", "amqps://u:1@host/vh", "amqp//u:p@host/", "http://u:p@h:15672", "amqp://host/", ""}
	for _, uri := range uris {
		if got, want := redactURI(uri), redact.URI(uri); got != want {
			t.Errorf("redactURI(%q) = %q, want %q", uri, got, want)
		}
		for _, s := range []string{"dial " + uri + ": refused", `Get "http://a:b@h/api": x`, "nothing"} {
			if got, want := redactString(s, uri), redact.String(s, uri); got != want {
				t.Errorf("redactString(%q, %q) = %q, want %q", s, uri, got, want)
			}
		}
	}
}
