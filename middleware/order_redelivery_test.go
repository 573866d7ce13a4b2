package middleware

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// What keeps a key's order when deliveries come twice (at-least-once): a copy of a
// message that is no longer its key's head, a release sent for a head that is gone, a
// release whose head is nacked after a message behind it became the head, and two
// deliveries of one key at once in one process. Each drives the engine directly, with
// the in-process lines and a fake backend that keeps the retry copies.

// orderRig is an engine with order keys on key "k" of queue "work": its handler applies
// events (metadata "seq") to p, failing the first attempt of those in fail.
type orderRig struct {
	t     *testing.T
	e     *engine
	b     *fakeBackend
	lines *memoryLines
	p     *inOrder
	mw    message.HandlerFunc

	mu   sync.Mutex
	fail map[int]bool
	runs []int // every run of the handler, by seq
}

func newOrderRig(t *testing.T) *orderRig {
	t.Helper()
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{
		Policy:   amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{time.Second}},
		OrderKey: func(msg *message.Message) string { return msg.Metadata.Get("key") },
		Outage:   amqpretry.Outage{Consecutive: -1},
	}, b)
	l := &memoryLines{}
	e.order = newOrder(e.cfg, l)
	r := &orderRig{t: t, e: e, b: b, lines: l, p: &inOrder{last: map[string]int{}, done: make(chan struct{}), total: -1}, fail: map[int]bool{}}
	r.mw = e.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
		r.mu.Lock()
		r.runs = append(r.runs, seq)
		fails := r.fail[seq] && amqpretry.Attempt(msg) == 1
		r.mu.Unlock()
		if fails {
			return nil, errors.New("lock timeout")
		}
		r.p.apply("k", seq)
		return nil, nil
	})
	return r
}

// event is event seq of key k.
func event(seq int) *message.Message {
	msg := message.NewMessage("k-"+strconv.Itoa(seq), nil)
	msg.Metadata.Set("key", "k")
	msg.Metadata.Set("seq", strconv.Itoa(seq))
	return msg
}

// deliver runs msg through the Retry and acks it, as the router does when the chain
// returns nil, then waits until the key's deliveries are settled (its hold freed).
func (r *orderRig) deliver(msg *message.Message) {
	r.t.Helper()
	if _, err := r.mw(msg); err != nil {
		r.t.Fatalf("message %s: %v", msg.UUID, err)
	}
	msg.Ack()
	r.settled()
}

// settled waits until no delivery holds the key.
func (r *orderRig) settled() {
	r.t.Helper()
	o := r.e.order
	o.mu.Lock()
	h := o.held[orderKey{"work", "k"}]
	o.mu.Unlock()
	if h == nil {
		return
	}
	select {
	case <-h.done:
	case <-time.After(10 * time.Second):
		r.t.Fatal("the key's last delivery never settled")
	}
}

// copyOfRetry returns the retry copy of event seq the backend was given last.
func (r *orderRig) copyOfRetry(seq int) *message.Message {
	r.t.Helper()
	msgs := r.b.msgs()
	for i := len(msgs) - 1; i >= 0; i-- {
		if msgs[i].UUID == "k-"+strconv.Itoa(seq) {
			cp := msgs[i].Copy()
			if cp.Metadata.Get(keys.OrderHead) != "k" {
				r.t.Fatalf("the retry copy of event %d is not marked as its key's head: %v", seq, cp.Metadata)
			}
			return cp
		}
	}
	r.t.Fatalf("no retry copy of event %d", seq)
	return nil
}

// behind lists the events behind the key, in order.
func (r *orderRig) behind() []int {
	r.lines.mu.Lock()
	defer r.lines.mu.Unlock()
	var out []int
	for _, b := range r.lines.line[orderKey{"work", "k"}] {
		seq, _ := strconv.Atoi(b.msg.Metadata.Get("seq"))
		out = append(out, seq)
	}
	return out
}

func (r *orderRig) applied() int {
	r.p.mu.Lock()
	defer r.p.mu.Unlock()
	return r.p.last["k"]
}

func (r *orderRig) checkInOrder() {
	r.t.Helper()
	r.p.mu.Lock()
	defer r.p.mu.Unlock()
	if len(r.p.outOfOrder) > 0 {
		r.t.Errorf("out of order: %v", r.p.outOfOrder)
	}
}

// TestOrderStaleHeadWaitsBehindItsKey: a copy of a message that was its key's head,
// delivered again after its key was released (its ack lost with its connection), and
// the key blocked since behind another head, does not release the key: it waits
// behind the key like any message, after what was already there, and runs once the
// current head succeeds. A release sent for the old head is dropped.
func TestOrderStaleHeadWaitsBehindItsKey(t *testing.T) {
	r := newOrderRig(t)
	r.fail[1], r.fail[3] = true, true
	r.deliver(event(1)) // fails: the key's head
	r.deliver(event(2)) // behind it
	head1 := r.copyOfRetry(1)
	r.deliver(head1.Copy()) // 1 runs, then 2; the key is released
	if got := r.applied(); got != 2 {
		t.Fatalf("applied up to %d, want 2", got)
	}
	r.deliver(event(3)) // fails: the key's head now
	r.deliver(event(4)) // behind it

	// The old head's copy again: it must not run the messages behind event 3.
	r.deliver(head1.Copy())
	if got, want := r.behind(), []int{4, 1}; !slices.Equal(got, want) {
		t.Errorf("behind the key: %v, want %v (the old head's copy behind event 4)", got, want)
	}
	// A release sent for the old head: dropped.
	rel := message.NewMessage("release-1", nil)
	rel.Metadata[keys.OrderRelease] = "k"
	rel.Metadata[keys.OrderReleaseHead] = "k-1"
	r.deliver(rel)
	if got := r.applied(); got != 2 {
		t.Errorf("applied up to %d before event 3's retry, want 2", got)
	}
	r.deliver(r.copyOfRetry(3)) // 3 runs, then 4, then 1 again (a duplicate)
	if got := r.applied(); got != 4 {
		t.Errorf("applied up to %d, want 4", got)
	}
	if b := r.behind(); len(b) != 0 {
		t.Errorf("behind the key at the end: %v", b)
	}
	if blocked, _ := r.e.order.state(orderKey{"work", "k"}); blocked {
		t.Error("the key is still blocked")
	}
	r.checkInOrder()
}

// TestOrderFollowerThatFailsSettlesWithItsHead: a message behind the key that fails
// while the key is released becomes its head, but is settled with its release's head:
// when that head is nacked (its handler call failed after the Retry, or its
// connection went), it goes back behind the key in its place, with those that ran
// before it, and the old head is the key's head again. Acked at once, as it was, the
// head's next run would run the message after it first.
func TestOrderFollowerThatFailsSettlesWithItsHead(t *testing.T) {
	r := newOrderRig(t)
	r.fail[1], r.fail[3] = true, true
	r.deliver(event(1))
	for seq := 2; seq <= 4; seq++ {
		r.deliver(event(seq))
	}
	head1 := r.copyOfRetry(1)
	// 1 runs, 2 runs, 3 fails and becomes the head; then the head is nacked.
	first := head1.Copy()
	if _, err := r.mw(first); err != nil {
		t.Fatal(err)
	}
	first.Nack()
	r.settled()
	if got, want := r.behind(), []int{2, 3, 4}; !slices.Equal(got, want) {
		t.Errorf("behind the key after its release was undone: %v, want %v", got, want)
	}
	for _, c := range []struct {
		head string
		want bool
	}{{"k-1", true}, {"k-3", false}} {
		if is, err := r.e.order.lines.isHead(orderKey{"work", "k"}, c.head); err != nil || is != c.want {
			t.Errorf("isHead(%s) = %v, %v; want %v", c.head, is, err, c.want)
		}
	}
	// The head again: 1 and 2 again (duplicates), 3 fails again, 4 waits.
	r.deliver(head1.Copy())
	if got := r.applied(); got != 2 {
		t.Fatalf("applied up to %d, want 2 (4 waits behind 3)", got)
	}
	// Event 3's first copy (from the undone release) runs as the head: 3, then 4.
	if msgs := r.b.msgs(); len(msgs) != 3 || msgs[1].UUID != "k-3" {
		t.Fatalf("retry copies %v, want those of events 1, 3 and 3", msgs)
	}
	r.deliver(r.b.msgs()[1].Copy())
	if got := r.applied(); got != 4 {
		t.Errorf("applied up to %d, want 4", got)
	}
	r.deliver(r.copyOfRetry(3)) // its second copy: not the head any more, a duplicate
	r.checkInOrder()
	if blocked, _ := r.e.order.state(orderKey{"work", "k"}); blocked {
		t.Error("the key is still blocked")
	}
}

// TestOrderKeyRunsOneDeliveryAtATime: in one process a key's deliveries run one at a
// time. A second delivery of the key while the first one's handler runs (after a
// reconnection, the handler call of the old delivery may still run when the broker
// delivers the queue again) waits; its context ending first, it is nacked without
// running. Other keys do not wait.
func TestOrderKeyRunsOneDeliveryAtATime(t *testing.T) {
	b := &fakeBackend{}
	e, _ := newEngine(t, amqpretry.Config{
		Policy:   amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{time.Second}},
		OrderKey: func(msg *message.Message) string { return msg.Metadata.Get("key") },
	}, b)
	e.order = newOrder(e.cfg, &memoryLines{})
	entered, release := make(chan string, 4), make(chan struct{})
	mw := e.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		entered <- msg.UUID
		if msg.UUID == "first" {
			<-release
		}
		return nil, nil
	})
	of := func(uuid, key string) *message.Message {
		msg := message.NewMessage(uuid, nil)
		msg.Metadata.Set("key", key)
		return msg
	}
	done := make(chan error, 1)
	go func() {
		_, err := mw(of("first", "k"))
		done <- err
	}()
	if got := <-entered; got != "first" {
		t.Fatalf("entered %s", got)
	}
	second := of("second", "k")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	second.SetContext(ctx)
	if _, err := mw(second); !errors.Is(err, amqpretry.ErrHandoff) {
		t.Errorf("a second delivery of the key while the first runs, its context ended: %v, want ErrHandoff without running", err)
	}
	if _, err := mw(of("other", "j")); err != nil {
		t.Fatal(err)
	}
	if got := <-entered; got != "other" {
		t.Errorf("entered %s, want other (another key does not wait)", got)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := mw(of("second", "k")); err != nil {
		t.Fatal(err)
	}
	if got := <-entered; got != "second" {
		t.Errorf("entered %s, want second", got)
	}
}

// guardedLines are in-process lines that record the releases guard would send.
type guardedLines struct {
	*memoryLines
	mu     sync.Mutex
	guards []string // the heads, in order
}

func (g *guardedLines) guard(_ context.Context, _ orderKey, head string) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.guards = append(g.guards, head)
	return nil
}

func (g *guardedLines) sent() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.guards)
}

// TestOrderReleaseGuardsItsUnblock: a head with nothing behind its key unblocks it in
// its own handler call, before it is acked, and sends no release; a head with messages
// behind its key, which unblocks it only once it is acked, sends a release of the key
// behind itself first, in its handler call: a process that dies after the head's ack,
// before the key's unblock, leaves a release that runs what is left.
func TestOrderReleaseGuardsItsUnblock(t *testing.T) {
	r := newOrderRig(t)
	g := &guardedLines{memoryLines: r.lines}
	r.e.order.lines = g
	k := orderKey{"work", "k"}
	r.fail[1], r.fail[2] = true, true

	r.deliver(event(1)) // fails: the key's head, nothing behind it
	head1 := r.copyOfRetry(1)
	if _, err := r.mw(head1); err != nil {
		t.Fatal(err)
	}
	if blocked, _ := r.e.order.state(k); blocked {
		t.Error("a head with nothing behind its key: the key is still blocked when its handler call returns")
	}
	if sent := g.sent(); len(sent) != 0 {
		t.Errorf("a head with nothing behind its key sent releases %v, want none", sent)
	}
	head1.Ack()
	r.settled()

	r.deliver(event(2)) // fails: the key's head
	r.deliver(event(3)) // behind it
	head2 := r.copyOfRetry(2)
	if _, err := r.mw(head2); err != nil {
		t.Fatal(err)
	}
	if sent := g.sent(); !slices.Equal(sent, []string{"k-2"}) {
		t.Errorf("a head with a message behind its key sent releases %v when its handler call returned, want one behind k-2", sent)
	}
	head2.Ack()
	r.settled()
	if blocked, _ := r.e.order.state(k); blocked {
		t.Error("the key is still blocked once its head was acked")
	}
	if got := r.applied(); got != 3 {
		t.Errorf("applied up to %d, want 3", got)
	}
	r.checkInOrder()
}
