package console

import (
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/ops"
)

// TestChartCountsEveryRetryOnce: the buckets (overdue, the span cut in n, later) add
// up to the retries, each in the bucket of its due time (the envelope's, else the
// broker's release).
func TestChartCountsEveryRetryOnce(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	at := func(d time.Duration) ops.Message {
		var m ops.Message
		m.Due = now.Add(d)
		return m
	}
	released := ops.Message{Release: now.Add(7 * time.Minute)}
	msgs := []ops.Message{at(-time.Second), at(0), at(4*time.Minute + 59*time.Second), at(5 * time.Minute), released,
		at(59 * time.Minute), at(time.Hour), at(48 * time.Hour)}
	bars, _, _ := chart(msgs, now, time.Hour, 12)
	if len(bars) != 14 {
		t.Fatalf("%d bars, want overdue, 12 and later", len(bars))
	}
	got := map[string]int{}
	sum := 0
	for _, b := range bars {
		got[b.Label] = b.Count
		sum += b.Count
		if b.H < 0 || b.Y+b.H != 130 || (b.Count > 0) != (b.H > 0) {
			t.Errorf("bar %+v", b)
		}
	}
	want := map[string]int{"overdue": 1, "+0m": 2, "+5m": 2, "+55m": 1, "later": 2}
	for label, n := range want {
		if got[label] != n {
			t.Errorf("bucket %s: %d, want %d (all: %v)", label, got[label], n, got)
		}
	}
	if sum != len(msgs) {
		t.Errorf("buckets sum to %d, want %d", sum, len(msgs))
	}
}

// TestParseFilter: the filter's fields, and each malformed one refused with its name.
func TestParseFilter(t *testing.T) {
	f, err := parseFilter(url.Values{"queue": {" orders "}, "reason": {"max-attempts"}, "error": {"<b>"}, "older": {"90s"}, "newer": {"2h"}, "id": {"a", " ", "b"}})
	if err != nil || f.Queue != "orders" || f.Reason != "max-attempts" || f.Error != "<b>" || f.OlderThan != 90*time.Second ||
		f.NewerThan != 2*time.Hour || strings.Join(f.IDs, ",") != "a,b" {
		t.Errorf("%+v %v", f, err)
	}
	for field, bad := range map[string]string{"reason": "oops", "older": "soon", "newer": "-1m"} {
		if _, err := parseFilter(url.Values{field: {bad}}); err == nil || !strings.HasPrefix(err.Error(), field+":") {
			t.Errorf("%s=%s: %v", field, bad, err)
		}
	}
}

// TestPrintable: text is shown as text, anything else as hex.
func TestPrintable(t *testing.T) {
	for in, want := range map[string]bool{"order 1\n\tok": true, "<script>": true, "caf\xc3\xa9": true, "\x00\x01": false, "\xff\xfe": false, "a\x1bb": false} {
		if printable([]byte(in)) != want {
			t.Errorf("printable(%q) = %t", in, !want)
		}
	}
}
