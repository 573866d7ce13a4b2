package middleware

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/ctxkey"
	"github.com/amqpretry/amqpretry/internal/keys"
)

func chainKey() any { return ctxkey.Chain{} }

// runCounter is a handler that counts its runs and fails the first attempt of every
// message when failFirst.
type runCounter struct {
	mu        sync.Mutex
	runs      map[string]int
	failFirst bool
}

func (c *runCounter) handle(msg *message.Message) ([]*message.Message, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.runs == nil {
		c.runs = map[string]int{}
	}
	c.runs[msg.UUID]++
	if c.failFirst && amqpretry.Attempt(msg) == 1 {
		return nil, errFlaky
	}
	return nil, nil
}

func (c *runCounter) of(uuid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[uuid]
}

func TestDedupRunsEveryRetryAndDropsDuplicates(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Dedup: time.Hour}, b)
	h := &runCounter{failFirst: true}
	mw := e.Middleware(h.handle)
	first := message.NewMessage("u", []byte("p"))
	if _, err := mw(first); err != nil {
		t.Fatal(err)
	}
	if len(b.msgs()) != 1 {
		t.Fatalf("parked %d copies, want the retry", len(b.msgs()))
	}
	retry := b.msgs()[0]
	if _, err := mw(retry.Copy()); err != nil {
		t.Fatal(err)
	}
	if h.of("u") != 2 {
		t.Fatalf("the handler ran %d times, want 2: its failure must not be remembered, so that the retry runs", h.of("u"))
	}
	// The retry delivered again, and the first delivery again: duplicates.
	for _, dup := range []*message.Message{retry.Copy(), message.NewMessage("u", []byte("p"))} {
		if _, err := mw(dup); err != nil {
			t.Fatal(err)
		}
	}
	if h.of("u") != 2 || e.Stats().Duplicates != 2 {
		t.Errorf("handler ran %d times, %d duplicates; want 2 runs, 2 duplicates", h.of("u"), e.Stats().Duplicates)
	}
	// Redriven from the poison queue: runs again.
	redriven := retry.Copy()
	redriven.Metadata.Set(keys.RedriveCount, "1")
	if _, err := mw(redriven); err != nil {
		t.Fatal(err)
	}
	if h.of("u") != 3 {
		t.Errorf("a redriven message was taken for a duplicate: %d runs, want 3", h.of("u"))
	}
	if len(b.msgs()) != 1 {
		t.Errorf("%d copies parked, want only the one retry", len(b.msgs()))
	}
}

func TestDedupRemembersAPoisonedMessage(t *testing.T) {
	e, poison := newEngine(t, amqpretry.Config{Dedup: time.Hour}, &fakeBackend{})
	runs := 0
	mw := e.Middleware(func(*message.Message) ([]*message.Message, error) {
		runs++
		return nil, amqpretry.Permanent(errFlaky)
	})
	for range 2 {
		if _, err := mw(message.NewMessage("bad", nil)); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 1 || len(poison.got()) != 1 {
		t.Errorf("ran %d times, poisoned %d; want once each: the duplicate of a poisoned message is dropped", runs, len(poison.got()))
	}
}

// failingStore is a DedupStore whose calls fail as set.
type failingStore struct{ seen, record error }

func (s failingStore) Seen(context.Context, string) (bool, error) { return false, s.seen }
func (s failingStore) Record(context.Context, string, time.Time) error {
	return s.record
}

func TestDedupStoreThatFailsRunsNothingAndRetries(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{Dedup: time.Hour, DedupStore: failingStore{seen: errors.New("connection refused")}, Outage: amqpretry.Outage{Consecutive: -1}}, b)
	h := &runCounter{}
	if _, err := e.Middleware(h.handle)(message.NewMessage("u", nil)); err != nil {
		t.Fatal(err)
	}
	if h.of("u") != 0 || len(b.msgs()) != 1 {
		t.Fatalf("handler ran %d times, %d retries parked; want none run and a retry", h.of("u"), len(b.msgs()))
	}
	if env := ReadEnvelope(b.msgs()[0].Metadata); !strings.Contains(env.Error, "dedup store: connection refused") {
		t.Errorf("retry's error %q, want the store's", env.Error)
	}
	var dup bool
	dd := &dedup{store: failingStore{seen: errFlaky}, inMemory: true}
	if _, err := dd.handler(nil, "k", &dup)(message.NewMessage("u", nil)); !amqpretry.DecisionOf(err).Unavailable {
		t.Errorf("a store that fails gives %v, want it marked Unavailable, so that the work queue's outage waits it out", err)
	}
}

func TestDedupRecordThatFailsAcksAndSaysSo(t *testing.T) {
	logs := watermill.NewCaptureLogger()
	e, _ := newEngine(t, amqpretry.Config{Dedup: time.Hour, DedupStore: failingStore{record: errors.New("disk full")}, Logger: logs}, &fakeBackend{})
	h := &runCounter{}
	if _, err := e.Middleware(h.handle)(message.NewMessage("u", nil)); err != nil {
		t.Fatalf("a handled message must be acked even when it cannot be recorded, got %v", err)
	}
	if errs := logs.Captured()[watermill.ErrorLogLevel]; len(errs) != 1 || !strings.Contains(errs[0].Msg, "dedup store") {
		t.Errorf("logged %v, want one ERROR naming the dedup store", errs)
	}
}

func TestMemoryDedupForgetsTheOldestAndTheExpired(t *testing.T) {
	m := newMemoryDedup(3)
	ctx := context.Background()
	later := time.Now().Add(time.Hour)
	for _, k := range []string{"a", "b", "c", "d"} {
		if err := m.Record(ctx, k, later); err != nil {
			t.Fatal(err)
		}
	}
	for k, want := range map[string]bool{"a": false, "b": true, "c": true, "d": true, "e": false} {
		if got, _ := m.Seen(ctx, k); got != want {
			t.Errorf("Seen(%q) = %v, want %v", k, got, want)
		}
	}
	_ = m.Record(ctx, "past", time.Now().Add(-time.Second))
	if got, _ := m.Seen(ctx, "past"); got {
		t.Error("a key past its time is seen")
	}
	// Recorded again, b is remembered from then on.
	_ = m.Record(ctx, "b", later)
	for _, k := range []string{"x", "y"} {
		_ = m.Record(ctx, k, later)
	}
	if got, _ := m.Seen(ctx, "b"); !got {
		t.Error("b, recorded again, was forgotten")
	}
}

func TestDedupKeyTellsARetryFromADuplicate(t *testing.T) {
	key := func(msg *message.Message) string {
		k, err := amqpretry.DedupKey(msg)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	msg := message.NewMessage("u", []byte("p"))
	msg.SetContext(context.Background())
	first := key(msg)
	retry := msg.Copy()
	retry.Metadata.Set(keys.Attempt, "2")
	if key(retry) == first {
		t.Errorf("a retry has its first delivery's key %q", first)
	}
	if key(msg.Copy()) != first {
		t.Error("a duplicate has another key")
	}
	for name, md := range map[string]message.Metadata{
		"redriven":          {keys.RedriveCount: "1"},
		"parked again":      {keys.ParkUntil: "2030-01-01T00:00:00Z", keys.Due: "2029-01-01T00:00:00Z"},
		"given back before": {keys.GivenBack: "1"},
	} {
		m := msg.Copy()
		for k, v := range md {
			m.Metadata.Set(k, v)
		}
		if key(m) == first {
			t.Errorf("%s: the key %q is its first delivery's", name, first)
		}
	}
}

// A delivery given back to the broker unhandled (a failed hand-off) comes back with a
// key of its own: Watermill's Deduplicator keyed by DedupKey runs it again.
func TestDedupKeyOfADeliveryGivenBack(t *testing.T) {
	b := &fakeBackend{park: func(*message.Message) error { return errors.New("connection closed") }}
	e, _ := newEngine(t, amqpretry.Config{}, b)
	e.wiring.ID = "r1"
	msg := hurried("u")
	msg.Metadata.Set(keys.Subscriber, "r1")
	e.wiring.Bound = nil
	if _, err := e.Middleware(failing(errFlaky))(msg); !errors.Is(err, amqpretry.ErrHandoff) {
		t.Fatalf("got %v, want a failed hand-off", err)
	}
	again := hurried("u")
	again.Metadata.Set(keys.Subscriber, "r1")
	e.arrive(again, true)
	k1, _ := amqpretry.DedupKey(message.NewMessage("u", nil))
	k2, _ := amqpretry.DedupKey(again)
	if again.Metadata.Get(keys.GivenBack) != "1" || k1 == k2 {
		t.Errorf("given back once: metadata %v, key %q (first delivery's %q)", again.Metadata, k2, k1)
	}
	b.park = nil
	if _, err := e.Middleware(failing(errFlaky))(again); err != nil {
		t.Fatal(err)
	}
	if e.givenBack.size.Load() != 0 {
		t.Error("a message handed off is still counted as given back")
	}
}

// A retry this Retry scheduled that a middleware acks without running the handler is
// said once at ERROR: inside the Retry (the handler added through AddHandler did not
// run), and outside it (acked before it reached the Retry). A duplicate of a retry
// that ran is not.
func TestRetryDroppedBeforeItsHandlerIsSaidOnce(t *testing.T) {
	t.Run("inside", func(t *testing.T) {
		logs := watermill.NewCaptureLogger()
		b := &fakeBackend{}
		e, _ := newEngine(t, amqpretry.Config{Logger: logs}, b)
		ran := 0
		handler := func(msg *message.Message) ([]*message.Message, error) {
			ran++
			return nil, errFlaky
		}
		// What AddHandler adds: expectHandler just inside the Retry, a deduplicator
		// that drops everything it saw, and the handler telling that it ran.
		seen := map[string]bool{}
		mw := e.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			c := msg.Context().Value(chainKey()).(*chain)
			c.ExpectHandler()
			if seen[msg.UUID] {
				return nil, nil
			}
			seen[msg.UUID] = true
			c.HandlerRan()
			return handler(msg)
		})
		if _, err := mw(message.NewMessage("u", nil)); err != nil {
			t.Fatal(err)
		}
		if _, err := mw(b.msgs()[0].Copy()); err != nil {
			t.Fatal(err)
		}
		errs := logs.Captured()[watermill.ErrorLogLevel]
		if len(errs) != 1 || !strings.Contains(errs[0].Msg, "Deduplicator") || !errors.Is(errs[0].Err, errRetryDropped) || !strings.HasPrefix(errs[0].Fields["middleware"].(string), "inside") {
			t.Fatalf("logged %v, want one ERROR naming the Deduplicator, inside the Retry", errs)
		}
	})
	t.Run("duplicate of a retry that ran", func(t *testing.T) {
		logs := watermill.NewCaptureLogger()
		b := &fakeBackend{}
		e, _ := newEngine(t, amqpretry.Config{Logger: logs}, b)
		h := &runCounter{failFirst: true}
		seen := map[int]bool{}
		mw := e.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			c := msg.Context().Value(chainKey()).(*chain)
			c.ExpectHandler()
			if seen[amqpretry.Attempt(msg)] {
				return nil, nil
			}
			seen[amqpretry.Attempt(msg)] = true
			c.HandlerRan()
			return h.handle(msg)
		})
		if _, err := mw(message.NewMessage("u", nil)); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if _, err := mw(b.msgs()[0].Copy()); err != nil {
				t.Fatal(err)
			}
		}
		if h.of("u") != 2 || len(logs.Captured()[watermill.ErrorLogLevel]) != 0 {
			t.Errorf("ran %d times, logged %v; want 2 runs and nothing at ERROR", h.of("u"), logs.Captured()[watermill.ErrorLogLevel])
		}
	})
	t.Run("outside", func(t *testing.T) {
		logs := watermill.NewCaptureLogger()
		b := &fakeBackend{}
		e, _ := newEngine(t, amqpretry.Config{Logger: logs}, b)
		e.wiring.ID, e.wiring.Bound = "r1", nil
		msg := message.NewMessage("u", nil)
		msg.Metadata.Set(keys.Subscriber, "r1")
		if _, err := e.Middleware(failing(errFlaky))(msg); err != nil {
			t.Fatal(err)
		}
		for range 2 { // delivered, then acked by a middleware outside the Retry
			retry := b.msgs()[0].Copy()
			e.arrive(retry, true)
			retry.Ack()
			e.sweep(false)
		}
		errs := logs.Captured()[watermill.ErrorLogLevel]
		if len(errs) != 1 || !strings.HasPrefix(errs[0].Fields["middleware"].(string), "outside") {
			t.Fatalf("logged %v, want one ERROR, outside the Retry", errs)
		}
		if e.arrivals.size.Load() != 0 {
			t.Error("an acked retry is still watched")
		}
	})
}
