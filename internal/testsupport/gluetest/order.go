package gluetest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/ops"
)

// The order scenarios (Config.OrderKey, docs/ordering.md): a projection of accounts'
// events, each applied in order through retries, while other keys flow.

// projection applies each account's events, numbered from 1 in the order they were
// published, and records every one applied out of order: not the next of its account.
// An event applied again is a duplicate (at-least-once), counted apart.
type projection struct {
	mu         sync.Mutex
	last       map[string]int
	applied    map[string]bool
	outOfOrder []string
	duplicates int
	count      int
	total      int
	done       chan struct{}
	attempts   map[string][]int // by event, the attempts it ran at
}

func newProjection(total int) *projection {
	return &projection{last: map[string]int{}, applied: map[string]bool{}, total: total, done: make(chan struct{}), attempts: map[string][]int{}}
}

// apply applies event seq of account; it tells whether it was a duplicate.
func (p *projection) apply(account string, seq int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	id := account + "/" + strconv.Itoa(seq)
	if p.applied[id] {
		p.duplicates++
		return
	}
	if seq != p.last[account]+1 {
		p.outOfOrder = append(p.outOfOrder, fmt.Sprintf("%s after %d", id, p.last[account]))
	}
	p.applied[id] = true
	p.last[account] = max(p.last[account], seq)
	if p.count++; p.count == p.total {
		close(p.done)
	}
}

func (p *projection) wait(t *testing.T, timeout time.Duration) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.mu.Lock()
		defer p.mu.Unlock()
		t.Fatalf("%d of %d events applied within %s", p.count, p.total, timeout)
	}
}

// orderEvents counts the key events Config.Observe is told.
type orderEvents struct {
	mu                sync.Mutex
	blocked, released int
	changed           chan struct{}
}

func newOrderEvents() *orderEvents { return &orderEvents{changed: make(chan struct{}, 1)} }

func (o *orderEvents) observe(ev amqpretry.Event) {
	o.mu.Lock()
	switch ev.Kind {
	case amqpretry.EventKeyBlocked:
		o.blocked++
	case amqpretry.EventKeyReleased:
		o.released++
	default:
		o.mu.Unlock()
		return
	}
	o.mu.Unlock()
	select {
	case o.changed <- struct{}{}:
	default:
	}
}

// waitAllReleased waits until every key blocked was released, and returns how many
// blocks there were.
func (o *orderEvents) waitAllReleased(t *testing.T, timeout time.Duration) int {
	t.Helper()
	deadline := time.After(timeout)
	for {
		o.mu.Lock()
		b, r := o.blocked, o.released
		o.mu.Unlock()
		if b == r {
			return b
		}
		select {
		case <-o.changed:
		case <-deadline:
			t.Fatalf("%d keys blocked, %d released within %s", b, r, timeout)
		}
	}
}

// orderAccount and orderSeq are the metadata of a projection's event.
const (
	orderAccount = "account"
	orderSeq     = "seq"
)

func accountOf(msg *message.Message) string { return msg.Metadata.Get(orderAccount) }

// failsOnce tells whether event seq of account a fails its first attempt: about one in
// four, spread over the accounts.
func failsOnce(a, seq int) bool { return (a*7+seq*3)%4 == 0 }

// publishEvents publishes seqs events of each of accounts accounts, interleaved, each
// account's in order, to topic.
func publishEvents(t *testing.T, m Major, topic string, accounts, seqs int) {
	t.Helper()
	pub := m.Publisher(t, Sub{URI: brokertest.URI()})
	for seq := 1; seq <= seqs; seq++ {
		for a := range accounts {
			msg := message.NewMessage(fmt.Sprintf("acc%d-%d", a, seq), []byte("event"))
			msg.Metadata.Set(orderAccount, "acc"+strconv.Itoa(a))
			msg.Metadata.Set(orderSeq, strconv.Itoa(seq))
			if err := pub.Publish(topic, msg); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// cleanupBehind deletes, when the test ends, the behind queues of the accounts.
func cleanupBehind(t *testing.T, prefix, queue string, accounts int) {
	var qs []string
	for a := range accounts {
		qs = append(qs, names.Names{Prefix: prefix}.Behind(queue, "acc"+strconv.Itoa(a)))
	}
	brokertest.Cleanup(t, qs, nil)
}

// projectionHandler applies each event, failing the first attempt of those failsOnce
// picks.
func projectionHandler(p *projection) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		a, _ := strconv.Atoi(accountOf(msg)[len("acc"):])
		seq, _ := strconv.Atoi(msg.Metadata.Get(orderSeq))
		p.mu.Lock()
		p.attempts[msg.UUID] = append(p.attempts[msg.UUID], amqpretry.Attempt(msg))
		p.mu.Unlock()
		if failsOnce(a, seq) && amqpretry.Attempt(msg) == 1 {
			return errors.New("lock timeout")
		}
		p.apply(accountOf(msg), seq)
		return nil
	}
}

// OrderKeepsEachKeysOrder is the projection of issue 48 scaled to CI: 8 accounts, 8
// events each, one in four failing once; with Config.OrderKey every account's events
// are applied in exact order through the retries, on every backend this broker runs,
// and every key blocked is released, its behind queue deleted.
func OrderKeepsEachKeysOrder(t *testing.T, m Major) {
	const accounts, seqs = 8, 8
	type variant struct {
		name    string
		backend delay.Backend
		held    int
	}
	for _, v := range []variant{
		{"ttl-tiers", delay.TTLTiers(), 0},
		{"binary-levels", delay.BinaryLevels(0), 0},
		{"delayed-exchange", delay.DelayedExchange(), 0},
		{"memory", delay.Memory(nil), 0},
		{"delayed-retry", delay.DelayedRetry(0), 0},
		{"held-retries", delay.TTLTiers(), 2},
	} {
		t.Run(v.name, func(t *testing.T) {
			if testing.Short() && v.name != "ttl-tiers" {
				t.Skip("one backend in the quick loop (go test -short)")
			}
			s := newSetup(t, m, v.backend)
			s.cfg.Policy = amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
			if v.name == "delayed-retry" {
				s.cfg.Policy = amqpretry.Policy{MaxAttempts: 5}
			}
			s.cfg.Backend = delay.HeldRetries(v.held, 0, s.cfg.Backend)
			s.cfg.OrderKey = accountOf
			ev := newOrderEvents()
			s.cfg.Observe = ev.observe
			cleanupBehind(t, s.prefix, s.topic, accounts)
			r := newRetry(t, m, s.sub, s.cfg)
			p := newProjection(accounts * seqs)
			run(t, m, r, s.topic, projectionHandler(p))
			publishEvents(t, m, s.topic, accounts, seqs)

			p.wait(t, 90*time.Second)
			blocks := ev.waitAllReleased(t, 30*time.Second)
			p.mu.Lock()
			defer p.mu.Unlock()
			if len(p.outOfOrder) > 0 {
				t.Errorf("%d events applied out of order: %v", len(p.outOfOrder), p.outOfOrder)
			}
			if blocks == 0 {
				t.Error("no key was ever blocked: the scenario did not exercise order")
			}
			failing := 0
			for a := range accounts {
				for seq := 1; seq <= seqs; seq++ {
					want := "[1]"
					if failsOnce(a, seq) {
						failing++
						want = "[1 2]"
					}
					if id := fmt.Sprintf("acc%d-%d", a, seq); p.duplicates == 0 && fmt.Sprint(p.attempts[id]) != want {
						t.Errorf("event %s ran at attempts %v, want %s", id, p.attempts[id], want)
					}
				}
			}
			if st := r.Stats(); st.BlockedKeys != 0 || st.Behind != 0 || st.Retries != int64(failing) || st.Poisoned != 0 {
				t.Errorf("stats after every release: %+v, want %d retries", st, failing)
			}
			if p.duplicates > 0 {
				t.Logf("%d duplicates (at-least-once)", p.duplicates)
			}
			assertNoBehindQueues(t, s.prefix, s.topic, accounts)
		})
	}
}

// assertNoBehindQueues fails if a behind queue of the accounts exists.
func assertNoBehindQueues(t *testing.T, prefix, queue string, accounts int) {
	t.Helper()
	conn := brokertest.Dial(t)
	for a := range accounts {
		q := names.Names{Prefix: prefix}.Behind(queue, "acc"+strconv.Itoa(a))
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDeclarePassive(q, true, false, false, false, nil); err == nil {
			t.Errorf("behind queue %s left after every release", q)
			_ = ch.Close()
		}
	}
}

// OrderOtherKeysFlow: one key whose head waits 10 minutes (a RetryAfter) holds back
// its own later messages only: every other key's messages are handled meanwhile, and
// the key's later messages wait on the broker, in its behind queue.
func OrderOtherKeysFlow(t *testing.T, m Major) {
	const others, seqs = 4, 5
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 5, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
	s.cfg.OrderKey = accountOf
	cleanupBehind(t, s.prefix, s.topic, others+1)
	r := newRetry(t, m, s.sub, s.cfg)
	p := newProjection(others * seqs)
	slow := "acc" + strconv.Itoa(others) // the last account: its first event waits 10 minutes
	var slowRuns sync.Map
	run(t, m, r, s.topic, func(msg *message.Message) error {
		if accountOf(msg) == slow {
			slowRuns.Store(msg.UUID, true)
			if msg.Metadata.Get(orderSeq) == "1" {
				return amqpretry.RetryAfter(errors.New("rate limited"), 10*time.Minute)
			}
			return nil
		}
		seq, _ := strconv.Atoi(msg.Metadata.Get(orderSeq))
		p.apply(accountOf(msg), seq)
		return nil
	})
	publishEvents(t, m, s.topic, others+1, seqs)

	p.wait(t, 60*time.Second)
	ran := 0
	slowRuns.Range(func(k, _ any) bool { ran++; return true })
	if ran != 1 {
		t.Errorf("the blocked key's messages ran %d times while its head waits, want 1 (the head's first attempt)", ran)
	}
	// Its later messages wait on the broker, in order, in its behind queue.
	q := names.Names{Prefix: s.prefix}.Behind(s.topic, slow)
	waitFor(t, 30*time.Second, fmt.Sprintf("%d messages in behind queue %s", seqs-1, q), func() bool {
		return queueReady(t, q) == seqs-1
	})
	if st := r.Stats(); st.BlockedKeys != 1 || st.Behind != seqs-1 {
		t.Errorf("stats %+v, want 1 blocked key with %d behind it", st, seqs-1)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.outOfOrder) > 0 {
		t.Errorf("out of order: %v", p.outOfOrder)
	}
}

// OrderPoisonedHead: a key's head that is poisoned releases the messages behind it, in
// order, by default; with Config.BlockOnPoison they wait until an operator releases
// the key (ops.Release, the amqpretry command's `blocked release`), or redrives its
// head, which releases the key when it succeeds.
func OrderPoisonedHead(t *testing.T, m Major) {
	const seqs = 4
	for _, tc := range []struct {
		name          string
		blockOnPoison bool
		redriveHead   bool
	}{
		{"released by default", false, false},
		{"blocked until released", true, false},
		{"blocked until its head is redriven", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSetup(t, m, delay.TTLTiers())
			s.cfg.Policy = amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
			s.cfg.OrderKey = accountOf
			s.cfg.BlockOnPoison = tc.blockOnPoison
			ev := newOrderEvents()
			s.cfg.Observe = ev.observe
			cleanupBehind(t, s.prefix, s.topic, 2)
			r := newRetry(t, m, s.sub, s.cfg)
			p := newProjection(2*seqs - 1) // acc0's first event is poisoned
			if !tc.redriveHead {
				p.last["acc0"] = 1 // and never applied: acc0's next is its second
			} else {
				p.total++ // redriven, it is applied first
			}
			var healed sync.Map // after a redrive, the head succeeds
			run(t, m, r, s.topic, func(msg *message.Message) error {
				seq, _ := strconv.Atoi(msg.Metadata.Get(orderSeq))
				if accountOf(msg) == "acc0" && seq == 1 {
					if _, ok := healed.Load("acc0"); !ok {
						return errors.New("account locked")
					}
				}
				p.apply(accountOf(msg), seq)
				return nil
			})
			publishEvents(t, m, s.topic, 2, seqs)

			head := poisoned(t, s.prefix+".poison", 30*time.Second)
			if head.UUID != "acc0-1" || head.Metadata.Get(keys.OrderHead) != "acc0" {
				t.Fatalf("poisoned %s with head mark %q, want acc0-1 marked as acc0's head", head.UUID, head.Metadata.Get(keys.OrderHead))
			}
			// Put it back for ops to find, as an operator would see it.
			pub := m.Publisher(t, Sub{URI: brokertest.URI()})
			if err := pub.Publish(s.prefix+".poison", head); err != nil {
				t.Fatal(err)
			}
			if !tc.blockOnPoison {
				p.wait(t, 30*time.Second)
				ev.waitAllReleased(t, 30*time.Second)
				assertNoBehindQueues(t, s.prefix, s.topic, 2)
				assertInOrder(t, p)
				return
			}
			// acc1's events all run; acc0's wait behind its poisoned head.
			o, err := ops.New(ops.Config{URI: brokertest.URI(), Retry: s.cfg, Rabbitmqctl: brokertest.Ctl})
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			behind := names.Names{Prefix: s.prefix}.Behind(s.topic, "acc0")
			waitFor(t, 30*time.Second, "acc0's later events behind its poisoned head", func() bool {
				return queueReady(t, behind) == seqs-1
			})
			blocked, err := o.Blocked(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if len(blocked) != 1 || blocked[0].Behind != seqs-1 || blocked[0].Head == nil {
				t.Fatalf("blocked keys %+v, want acc0 with %d behind its poisoned head", blocked, seqs-1)
			}
			if b := blocked[0]; b.Queue != s.topic || b.Key != "acc0" || b.Head.UUID != "acc0-1" {
				t.Fatalf("blocked %+v (head %+v), want acc0 of %s, head acc0-1", b, b.Head, s.topic)
			}
			p.mu.Lock()
			ranBehind := p.applied["acc0/2"]
			p.mu.Unlock()
			if ranBehind {
				t.Fatal("acc0's events ran while its head is poisoned")
			}
			if _, err := o.Release(context.Background(), ops.ReleaseOptions{Queue: s.topic, Key: "acc1", Force: true}); err == nil {
				t.Error("a key that is not blocked was released")
			}
			if tc.redriveHead {
				healed.Store("acc0", true)
			}
			res, err := o.Release(context.Background(), ops.ReleaseOptions{Queue: s.topic, Key: "acc0", RedriveHead: tc.redriveHead})
			if err != nil {
				t.Fatal(err)
			}
			if res.Released == tc.redriveHead || (res.Redriven != nil) != tc.redriveHead {
				t.Errorf("release result %+v", res)
			}
			p.wait(t, 30*time.Second)
			ev.waitAllReleased(t, 30*time.Second)
			assertNoBehindQueues(t, s.prefix, s.topic, 2)
			assertInOrder(t, p)
		})
	}
}

// assertInOrder fails if p applied an event out of order.
func assertInOrder(t *testing.T, p *projection) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.outOfOrder) > 0 {
		t.Errorf("%d events applied out of order: %v", len(p.outOfOrder), p.outOfOrder)
	}
}

// queueReady is the ready messages of queue, -1 when it does not exist.
func queueReady(t *testing.T, queue string) int {
	t.Helper()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close() //nolint:errcheck // closed by the broker on 404
	info, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return -1
	}
	return info.Messages
}

// OrderNeedsOneActiveConsumer: with Config.OrderKey the subscriber config declares the
// work queue with a single active consumer, which a second subscriber cannot change; a
// queue that exists without one is refused when the router subscribes, and a
// subscriber config that asks for competing consumers is refused by New, each naming
// the fix.
func OrderNeedsOneActiveConsumer(t *testing.T, m Major) {
	t.Run("declared with one active consumer", func(t *testing.T) {
		s := newSetup(t, m, delay.TTLTiers())
		s.cfg.OrderKey = accountOf
		r := newRetry(t, m, s.sub, s.cfg)
		rec := newRecorder(nil)
		run(t, m, r, s.topic, rec.handle)
		ch, err := brokertest.Dial(t).Channel()
		if err != nil {
			t.Fatal(err)
		}
		_, err = ch.QueueDeclare(s.topic, true, false, false, false, amqp.Table{"x-single-active-consumer": false})
		if err == nil || !strings.Contains(err.Error(), "x-single-active-consumer") {
			t.Fatalf("declaring the work queue without a single active consumer = %v, want it refused as inequivalent", err)
		}
	})
	t.Run("an existing queue without one is refused", func(t *testing.T) {
		s := newSetup(t, m, delay.TTLTiers())
		ch, err := brokertest.Dial(t).Channel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDeclare(s.topic, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		s.cfg.OrderKey = accountOf
		r := newRetry(t, m, s.sub, s.cfg)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Second}, Logger())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.AddHandler(router, "ordered", s.topic, func(*message.Message) error { return nil }); err != nil {
			t.Fatal(err)
		}
		runErr := make(chan error, 1)
		go func() { runErr <- router.Run(context.Background()) }()
		t.Cleanup(func() { _ = router.Close() })
		select {
		case err := <-runErr:
			for _, want := range []string{s.topic, "x-single-active-consumer", "OrderKey", "delete_queue"} {
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Errorf("router.Run = %v, want it to name %q", err, want)
				}
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the router ran on a work queue without a single active consumer")
		}
	})
	t.Run("competing consumers asked for are refused", func(t *testing.T) {
		s := newSetup(t, m, delay.TTLTiers())
		s.cfg.OrderKey = accountOf
		s.sub.QueueArgs = amqp.Table{"x-single-active-consumer": false}
		_, err := m.New(s.sub, s.cfg)
		if err == nil || !strings.Contains(err.Error(), "Queue.Arguments: x-single-active-consumer false") {
			t.Fatalf("New = %v, want the argument refused", err)
		}
	})
}
