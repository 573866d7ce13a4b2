package pgdedup_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/lib/pq"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/pgdedup"
)

var _ amqpretry.DedupStore = (*pgdedup.Store)(nil)

// dsn is the PostgreSQL the tests use: PGDEDUP_DSN, or the machine's (trust auth,
// database test).
func dsn() string {
	if v := os.Getenv("PGDEDUP_DSN"); v != "" {
		return v
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

// open connects to the test PostgreSQL, or skips the test (fails it under CI=true)
// when none answers.
func open(tb testing.TB) *sql.DB {
	tb.Helper()
	db, err := sql.Open("postgres", dsn())
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = db.PingContext(ctx)
		cancel()
	}
	if err != nil {
		if os.Getenv("CI") == "true" {
			tb.Fatalf("no PostgreSQL at PGDEDUP_DSN (%v); scripts/test.sh starts the machine's", err)
		}
		tb.Skipf("no PostgreSQL at PGDEDUP_DSN: %v", err)
	}
	tb.Cleanup(func() { _ = db.Close() })
	return db
}

// table returns a Store on a table of its own, dropped when the test ends.
func table(tb testing.TB, db *sql.DB) (*pgdedup.Store, string) {
	tb.Helper()
	name := fmt.Sprintf("amqpretry_test_%d", time.Now().UnixNano())
	s, err := pgdedup.New(context.Background(), db, name)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _, _ = db.Exec(`DROP TABLE IF EXISTS "` + name + `"`) })
	return s, name
}

func TestSeenOnlyWhatWasRecordedAndNotPastItsTime(t *testing.T) {
	db := open(t)
	s, _ := table(t, db)
	ctx := context.Background()
	if seen, err := s.Seen(ctx, "q/u"); err != nil || seen {
		t.Fatalf("Seen before Record = %v, %v", seen, err)
	}
	if err := s.Record(ctx, "q/u", time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if seen, err := s.Seen(ctx, "q/u"); err != nil || !seen {
		t.Fatalf("Seen after Record = %v, %v", seen, err)
	}
	if seen, _ := s.Seen(ctx, "q/other"); seen {
		t.Error("another key is seen")
	}
	// Recorded again with a time past: no longer seen.
	if err := s.Record(ctx, "q/u", time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	if seen, _ := s.Seen(ctx, "q/u"); seen {
		t.Error("a key past its time is seen")
	}
}

func TestNewKeepsAnExistingTable(t *testing.T) {
	db := open(t)
	s, name := table(t, db)
	ctx := context.Background()
	if err := s.Record(ctx, "k", time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	again, err := pgdedup.New(ctx, db, name) // a restart
	if err != nil {
		t.Fatal(err)
	}
	if seen, _ := again.Seen(ctx, "k"); !seen {
		t.Error("a key recorded before the restart is not seen")
	}
	if _, err := pgdedup.New(ctx, db, fmt.Sprintf("%063d", 0)); err == nil {
		t.Error("a table name too long for its index was accepted")
	}
}

func TestRecordDeletesTheKeysPastTheirTime(t *testing.T) {
	db := open(t)
	s, name := table(t, db)
	ctx := context.Background()
	past := time.Now().Add(-time.Minute)
	for i := range 1000 {
		if err := s.Record(ctx, fmt.Sprint("old-", i), past); err != nil {
			t.Fatal(err)
		}
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM "` + name + `"`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("%d rows past their time after 1,000 Records, want them deleted", n)
	}
}

// Two processes of one application (or one process restarted) share the table: a
// duplicate handled by the second is dropped; a message that failed in the first is
// retried in the second.
func TestTwoRetriesShareTheTable(t *testing.T) {
	db := open(t)
	s, _ := table(t, db)
	var mu sync.Mutex
	runs := map[string]int{}
	handler := func(msg *message.Message) ([]*message.Message, error) {
		mu.Lock()
		defer mu.Unlock()
		runs[msg.UUID]++
		if msg.UUID == "flaky" && amqpretry.Attempt(msg) == 1 {
			return nil, fmt.Errorf("flaky")
		}
		return nil, nil
	}
	newRetry := func() message.HandlerFunc {
		r, err := middleware.New(amqpretry.Config{
			Backend: delay.Memory(discard{}), Dedup: time.Hour, DedupStore: s,
		}, middleware.Transport{Queue: func(string) string { return "work" }})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.Close() })
		return r.Middleware(handler)
	}
	first, second := newRetry(), newRetry()
	for _, id := range []string{"ok", "flaky"} {
		if _, err := first(message.NewMessage(id, nil)); err != nil {
			t.Fatal(err)
		}
	}
	retry := message.NewMessage("flaky", nil)
	retry.Metadata.Set("amqpretry-attempt", "2")
	for _, msg := range []*message.Message{message.NewMessage("ok", nil), retry} {
		if _, err := second(msg); err != nil {
			t.Fatal(err)
		}
	}
	if runs["ok"] != 1 || runs["flaky"] != 2 {
		t.Errorf("runs %v, want ok once (its duplicate dropped by the second) and flaky twice (its retry run)", runs)
	}
}

type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }
