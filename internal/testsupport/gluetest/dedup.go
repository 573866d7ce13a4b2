package gluetest

// Deduplication beside the retry (issue 49): Config.Dedup, and Watermill's
// Deduplicator given amqpretry.DedupKey, outside the Retry and inside it.

import (
	"fmt"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

// dedupMode is where an application deduplicates: the Retry's own (Config.Dedup), or
// Watermill's Deduplicator with a key factory, on the router (outside the Retry) or on
// the handler after AddHandler (inside it).
type dedupMode struct {
	name    string
	library bool
	key     wmiddleware.MessageHasher
	inside  bool
	// loses: the mode drops every retry (Watermill's Deduplicator keyed by UUID, as
	// applications write it): the control that shows the scenario sees the loss, and
	// that the Retry says so.
	loses bool
}

func uuidKey(msg *message.Message) (string, error) { return msg.UUID, nil }

// DedupDropsDuplicatesNeverRetries: issue 49's table as a test. 300 messages with
// distinct payloads, one in five failing once, through a Retry and a deduplicator:
// with the Retry's own dedup (Config.Dedup) and with Watermill's Deduplicator given
// amqpretry.DedupKey, outside the Retry and inside it, every message is handled (0
// acked but never handled), each once, and a true duplicate published afterwards (a
// message handled at its first attempt, and the retry of one that failed once, each
// published again as it was delivered) is acked without running the handler. With
// Watermill's Deduplicator keyed by UUID (the control) every retry is acked and never
// handled, and the Retry says so once at ERROR, naming the Deduplicator and the fix.
// On ttl-tiers and binary-levels on any broker, on delayed-retry on RabbitMQ 4.3 (the
// attempt counted from x-acquired-count, read before any middleware runs).
func DedupDropsDuplicatesNeverRetries(t *testing.T, m Major) {
	modes := []dedupMode{
		{name: "library", library: true},
		{name: "key-outside", key: amqpretry.DedupKey},
		{name: "key-inside", key: amqpretry.DedupKey, inside: true},
	}
	controls := []dedupMode{
		{name: "uuid-outside", key: uuidKey, loses: true},
		{name: "uuid-inside", key: uuidKey, inside: true, loses: true},
	}
	for _, b := range []struct {
		backend delay.Backend
		need43  bool
		modes   []dedupMode
	}{
		{delay.TTLTiers(), false, append(modes, controls...)},
		{delay.BinaryLevels(0), false, modes},
		{delay.DelayedRetry(0), true, append(modes, controls[1])},
	} {
		for _, mode := range b.modes {
			t.Run(b.backend.Name()+"/"+mode.name, func(t *testing.T) {
				if b.need43 {
					need43(t)
				}
				dedupScenario(t, m, b.backend, mode)
			})
		}
	}
}

// dedupHandler records, per message, the attempts its handler ran and whether it
// succeeded; it fails the first attempt of one message in five.
type dedupHandler struct {
	mu        sync.Mutex
	runs      map[string][]int
	succeeded map[string]bool
	retried   map[string]*message.Message // a failed message's retry, as the handler got it
}

func (h *dedupHandler) handle(msg *message.Message) error {
	attempt := amqpretry.Attempt(msg)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.runs[msg.UUID] = append(h.runs[msg.UUID], attempt)
	var i int
	_, _ = fmt.Sscanf(msg.UUID, "m-%d", &i)
	if i%5 == 0 && attempt == 1 {
		return errFlaky
	}
	if attempt > 1 {
		h.retried[msg.UUID] = msg.Copy()
	}
	h.succeeded[msg.UUID] = true
	return nil
}

func (h *dedupHandler) counts() (handled, runs int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range h.runs {
		runs += len(r)
	}
	return len(h.succeeded), runs
}

func dedupScenario(t *testing.T, m Major, backend delay.Backend, mode dedupMode) {
	const total, failing = 300, 60
	s := newSetup(t, m, backend)
	if backend == (delay.DelayedRetry(0)) {
		s.sub.QueueArgs = quorum
		s.cfg.Backend = delay.DelayedRetry(500 * time.Millisecond)
		s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3}
	} else {
		s.cfg.Backend = withTiers(s.cfg.Backend, 500*time.Millisecond, time.Second)
		s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3, Delays: amqpretry.Exponential(500*time.Millisecond, 2, time.Second), Jitter: -1}
	}
	if mode.library {
		s.cfg.Dedup = time.Hour
	}
	logs := &logCapture{}
	s.cfg.Logger = logs
	r := newRetry(t, m, s.sub, s.cfg)
	h := &dedupHandler{runs: map[string][]int{}, succeeded: map[string]bool{}, retried: map[string]*message.Message{}}
	rec := newRecorder(nil) // its settle middleware, outermost: every delivery, dropped or not
	var outer []message.HandlerMiddleware
	var dedup *wmiddleware.Deduplicator
	if mode.key != nil {
		dedup = &wmiddleware.Deduplicator{KeyFactory: mode.key}
		if !mode.inside {
			outer = append(outer, dedup.Middleware)
		}
	}
	newRouter(t, func(router *message.Router) {
		handler, err := r.AddHandler(router, "dedup-"+s.topic, s.topic, h.handle)
		if err != nil {
			t.Fatal(err)
		}
		if mode.inside {
			handler.AddMiddleware(dedup.Middleware)
		}
	}, append([]message.HandlerMiddleware{rec.settle}, outer...)...)

	pub := m.Publisher(t, Sub{URI: brokertest.URI()})
	for i := range total {
		id := fmt.Sprintf("m-%03d", i)
		if err := pub.Publish(s.topic, message.NewMessage(id, []byte("payload of "+id))); err != nil {
			t.Fatal(err)
		}
	}
	rec.waitSettled(t, total+failing, 90*time.Second)
	handled, runs := h.counts()
	st := r.Stats()
	t.Logf("%s: %d handled, %d acked but never handled, %d handler runs, %d retries, %d poisoned", mode.name, handled, total-handled, runs, st.Retries, st.Poisoned)
	if st.Retries != failing || st.Poisoned != 0 || st.HandoffFailures != 0 {
		t.Errorf("stats %+v, want %d retries, none poisoned, no failed hand-off", st, failing)
	}
	said := dropLines(logs)
	if mode.loses {
		if handled != total-failing {
			t.Errorf("%d handled, want %d: Watermill's Deduplicator keyed by UUID drops every retry", handled, total-failing)
		}
		if len(said) != 1 {
			t.Fatalf("the retries dropped were said %d times at ERROR, want once: %v", len(said), said)
		}
		where := "outside"
		if mode.inside {
			where = "inside"
		}
		if !strings.HasPrefix(fmt.Sprint(said[0].Fields["middleware"]), where) || !strings.Contains(said[0].Err.Error(), "amqpretry.DedupKey") ||
			!strings.Contains(said[0].Msg, "Deduplicator") {
			t.Errorf("logged %q (%v, %v), want it to name Watermill's Deduplicator, amqpretry.DedupKey and the middleware %s the Retry", said[0].Msg, said[0].Err, said[0].Fields, where)
		}
		return
	}
	if handled != total || runs != total+failing {
		t.Errorf("%d handled (%d acked but never handled), %d handler runs: want all %d handled, in %d runs", handled, total-handled, runs, total, total+failing)
	}
	if len(said) != 0 {
		t.Errorf("a dropped retry was reported where none was: %v", said)
	}

	// True duplicates: a message handled at its first attempt, and the retry of one
	// that failed once, published again as they were delivered. Neither runs again.
	h.mu.Lock()
	retry := h.retried["m-000"]
	h.mu.Unlock()
	if retry == nil {
		t.Fatal("m-000 was not handled on a retry")
	}
	again := message.NewMessage(retry.UUID, retry.Payload)
	again.Metadata = maps.Clone(retry.Metadata)
	if amqpretry.Attempt(again) != 2 {
		t.Fatalf("m-000's retry has attempt %d, want 2", amqpretry.Attempt(again))
	}
	for k := range again.Metadata {
		if keys.Reserved(k) {
			delete(again.Metadata, k)
		}
	}
	if err := pub.Publish(s.topic, message.NewMessage("m-001", []byte("payload of m-001")), again); err != nil {
		t.Fatal(err)
	}
	rec.waitSettled(t, 2, 30*time.Second)
	if _, after := h.counts(); after != runs {
		t.Errorf("the handler ran %d more times for duplicates of messages handled, want none", after-runs)
	}
	if st := r.Stats(); mode.library && st.Duplicates != 2 {
		t.Errorf("Stats.Duplicates = %d, want 2", st.Duplicates)
	}
	if said := dropLines(logs); len(said) != 0 {
		t.Errorf("a duplicate dropped was reported as a retry dropped: %v", said)
	}
}

// dropLines are the ERROR lines saying a retry was dropped before its handler.
func dropLines(logs *logCapture) []watermill.CapturedMessage {
	var out []watermill.CapturedMessage
	for _, l := range logs.at(watermill.ErrorLogLevel) {
		if strings.HasPrefix(l.Msg, "A retry was acked without its handler running") {
			out = append(out, l)
		}
	}
	return out
}
