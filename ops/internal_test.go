package ops

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestFilterMatch(t *testing.T) {
	now := time.Now()
	m := Message{UUID: "u1", MessageID: "id1", Queue: "orders", Reason: "permanent", Error: "missing customer id", Time: now.Add(-time.Hour)}
	for _, tt := range []struct {
		f    Filter
		want bool
	}{
		{Filter{}, true},
		{Filter{Queue: "orders", Reason: "permanent", Error: "customer"}, true},
		{Filter{Queue: "billing"}, false},
		{Filter{Reason: "max-attempts"}, false},
		{Filter{Error: "warehouse"}, false},
		{Filter{OlderThan: 30 * time.Minute}, true},
		{Filter{OlderThan: 2 * time.Hour}, false},
		{Filter{NewerThan: 2 * time.Hour}, true},
		{Filter{NewerThan: 30 * time.Minute}, false},
		{Filter{IDs: []string{"x", "id1"}}, true},
		{Filter{IDs: []string{"x"}}, false},
	} {
		if got := tt.f.match(m, now); got != tt.want {
			t.Errorf("%+v: match = %v, want %v", tt.f, got, tt.want)
		}
	}
	if (Filter{OlderThan: time.Minute}).match(Message{}, now) {
		t.Error("a message without a time matched an age filter")
	}
}

func TestRedactIn(t *testing.T) {
	uri := "amqp://app:hunter2@broker:5672/prod"
	got := RedactIn("dial "+uri+": password hunter2 refused", uri)
	if got != "dial amqp://app:xxxxx@broker:5672/prod: password xxxxx refused" {
		t.Errorf("RedactIn: %q", got)
	}
	if VHost(uri) != "prod" || VHost("amqp://h/") != "/" || VHost("amqp://h") != "/" || VHost("amqp://h/%2Fx") != "/x" {
		t.Errorf("VHost: %q %q %q", VHost(uri), VHost("amqp://h/"), VHost("amqp://h/%2Fx"))
	}
}

func TestCountsNacks(t *testing.T) {
	for v, want := range map[string]bool{"3.10.8": false, "3.13.7": false, "4.0.5": true, "4.2.1": true, "4.3.0": false, "5.0.0": false, "": true} {
		if got := countsNacks(v); got != want {
			t.Errorf("countsNacks(%q) = %v, want %v", v, got, want)
		}
	}
}

func TestPacer(t *testing.T) {
	p := newPacer(100)
	start := time.Now()
	for range 11 {
		if err := p.wait(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if d := time.Since(start); d < 90*time.Millisecond || d > 500*time.Millisecond {
		t.Errorf("11 actions at 100/s took %s, want about 100ms", d)
	}
}

func TestManagementCounts(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, pass, ok := r.BasicAuth()
		if !ok || user != "ops" || pass != "pw" || r.URL.EscapedPath() != "/api/queues/%2F" {
			http.Error(w, "no", http.StatusUnauthorized)
			return
		}
		_, _ = w.Write([]byte(`[{"name":"p.delay.1s","messages":3,"messages_ready":1,"messages_unacknowledged":0}]`))
	}))
	defer srv.Close()
	counts, err := ManagementCounts(srv.URL, "ops", "pw", "/", nil)(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if c := counts["p.delay.1s"]; c.Backlog() != 2 {
		t.Errorf("counts: %+v", counts)
	}
	if _, err := ManagementCounts(srv.URL, "ops", "wrong", "/", nil)(context.Background()); err == nil || strings.Contains(err.Error(), "wrong") {
		t.Errorf("bad password: %v", err)
	}
}
