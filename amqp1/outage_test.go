package amqp1

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/middleware"
)

var errDependencyDown = errors.New("dial tcp 10.0.0.5:5432: connection refused")

// outageEvents records the outage events a Retry reports.
type outageEvents struct {
	mu  sync.Mutex
	all []amqpretry.Event
}

func (e *outageEvents) observe(ev amqpretry.Event) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.all = append(e.all, ev)
}

func (e *outageEvents) of(kind amqpretry.EventKind) []amqpretry.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []amqpretry.Event
	for _, ev := range e.all {
		if ev.Kind == kind {
			out = append(out, ev)
		}
	}
	return out
}

func lasted(evs []amqpretry.Event) []time.Duration {
	var out []time.Duration
	for _, ev := range evs {
		out = append(out, ev.Duration.Round(time.Millisecond))
	}
	return out
}

// poll waits until cond is true, or fails t after timeout.
func poll(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", timeout, what)
		}
	}
}

// TestOutageIsNotAPoison: issue 41's scenario on the delivery-time backend (RabbitMQ
// 4.3). Messages flow at a steady rate; one in 25 is bad for good (Permanent), one in
// 5 fails once; in the middle the handler's dependency is down for longer than the
// whole retry schedule. The outage poisons nothing, every Permanent message is
// poisoned, nothing is lost, the handler's runs while down are the failures before
// the outage began and the probes, the fail-once messages begin no outage, and every
// message runs once per attempt.
func TestOutageIsNotAPoison(t *testing.T) {
	obs := &outageEvents{}
	var down, started, wentDown atomic.Bool
	// published counts the messages published while down, publishedAtStart those
	// when the outage began.
	var published, publishedAtStart atomic.Int64
	ranBeforeDown := map[string]bool{} // under mu
	cfg := amqpretry.Config{
		// MaxAttempts 4: a fail-once message may lose two attempts to the outage
		// (a run as it began, a probe) and still have one to spare.
		Policy: amqpretry.Policy{MaxAttempts: 4, Delays: []time.Duration{500 * time.Millisecond, time.Second}, Jitter: -1},
		Outage: amqpretry.Outage{ProbeInterval: 200 * time.Millisecond},
		Observe: func(ev amqpretry.Event) {
			if ev.Kind == amqpretry.EventOutageStarted {
				publishedAtStart.Store(published.Load())
				started.Store(true)
			}
			obs.observe(ev)
		},
	}
	var runsDown, runsDownBefore atomic.Int64
	var mu sync.Mutex
	succeeded := map[string]bool{}
	failedOnce := map[string]bool{}
	ran := map[string][]int{} // under mu: the attempts each message ran on
	r := newRetryRig(t, "outage", cfg, func(msg *message.Message, attempt int) error {
		mu.Lock()
		ran[string(msg.Payload)] = append(ran[string(msg.Payload)], attempt)
		mu.Unlock()
		i, _ := strconv.Atoi(string(msg.Payload[1:]))
		if i%25 == 0 {
			return amqpretry.Permanent(errors.New("malformed"))
		}
		if down.Load() {
			runsDown.Add(1)
			if !started.Load() {
				runsDownBefore.Add(1)
			}
			return errDependencyDown
		}
		mu.Lock()
		defer mu.Unlock()
		if !wentDown.Load() {
			ranBeforeDown[string(msg.Payload)] = true
		}
		if i%5 == 1 && !failedOnce[msg.UUID] {
			failedOnce[msg.UUID] = true
			return errors.New("flaky downstream")
		}
		succeeded[msg.UUID] = true
		return nil
	})
	const total = 120
	// 40 a second; the dependency is down from message 30 to message 90 and a while
	// after: longer than the whole retry schedule (0.5 s + 1 s).
	for i := range total {
		if i == 30 {
			wentDown.Store(true)
			down.Store(true)
		}
		if down.Load() {
			published.Add(1)
		}
		if err := r.pub.Publish(r.topic, message.NewMessage(fmt.Sprintf("u%03d", i), []byte(fmt.Sprintf("m%03d", i)))); err != nil {
			t.Fatal(err)
		}
		time.Sleep(25 * time.Millisecond) // pacing the traffic, not a wait for a result
		if i == 90 {
			poll(t, 10*time.Second, "the outage to begin", func() bool { return len(obs.of(amqpretry.EventOutageStarted)) > 0 })
			time.Sleep(2 * time.Second) // the outage lasts beyond the retry schedule
			down.Store(false)
		}
	}
	wantOK, perm := 0, 0
	for i := range total {
		if i%25 == 0 {
			perm++
		} else {
			wantOK++
		}
	}
	poll(t, 60*time.Second, "every good message handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(succeeded) == wantOK
	})
	ctx := testContext(t, 30*time.Second)
	for payload, msg := range readPoison(t, ctx, r.uri, r.poison, perm) {
		i, _ := strconv.Atoi(payload[1:])
		if reason := middleware.ReadEnvelope(msg.Metadata).Reason; i%25 != 0 || reason != amqpretry.ReasonPermanent {
			t.Errorf("poisoned %s for %s: only the Permanent ones may be", payload, reason)
		}
	}
	if st := r.retry.Stats(); st.Poisoned != int64(perm) || st.InOutage != 0 {
		t.Errorf("stats %+v: want the %d Permanent ones poisoned and no queue in an outage", st, perm)
	}
	startedEv, ended, probes := obs.of(amqpretry.EventOutageStarted), obs.of(amqpretry.EventOutageEnded), obs.of(amqpretry.EventProbe)
	if len(startedEv) != 1 || len(ended) != 1 {
		t.Errorf("outages started %d, ended %d; want exactly one each (the fail-once fifth begins none)", len(startedEv), len(ended))
	}
	failedProbes := 0
	for _, p := range probes {
		if errors.Is(p.Err, errDependencyDown) { // not a Permanent one's
			failedProbes++
		}
	}
	// Before the outage began: the first attempts of the messages published while
	// down until then and of those published before but not yet run, and the
	// retries that failed, at most Consecutive of them (the first failed retry
	// begins the outage once Consecutive failures are in a row). Once it began: the
	// failed probes, not one run per message per attempt.
	mu.Lock()
	lag := int64(0)
	for i := range 30 {
		if i%25 != 0 && !ranBeforeDown[fmt.Sprintf("m%03d", i)] {
			lag++
		}
	}
	mu.Unlock()
	before, in := runsDownBefore.Load(), runsDown.Load()-runsDownBefore.Load()
	bound := publishedAtStart.Load() + lag + int64(cfg.WithDefaults().Outage.Consecutive)
	t.Logf("handler runs while down %d: %d before the outage began (bound %d: %d published while down, %d before and not yet run, and Consecutive), %d in it (%d failed probes of %d), outage lasted %v",
		runsDown.Load(), before, bound, publishedAtStart.Load(), lag, in, failedProbes, len(probes), lasted(ended))
	if before > bound {
		t.Errorf("handler ran %d times while down before the outage began, want at most %d: the first attempts of the messages published until then, and Consecutive retries", before, bound)
	}
	if in != int64(failedProbes) {
		t.Errorf("handler ran %d times while down in the outage, want only the %d failed probes", in, failedProbes)
	}
	mu.Lock()
	defer mu.Unlock()
	for id, attempts := range ran {
		for k, a := range attempts {
			if a != k+1 {
				t.Errorf("%s ran on attempts %v, want once per attempt", id, attempts)
				break
			}
		}
	}
}

// TestOutageCloseGivesBack: messages wait in an outage, one in each of three
// consumers of the work queue, more sent ahead on their links (Credit); the router's
// Close returns within its close timeout, then the Retry's. Each waiting message is
// settled released, which the broker does not count as a failed delivery: a new
// Retry and router on the queue, the dependency back, handle every message on the
// attempt it had, none poisoned. Only the runs before the outage began (the one that
// began it, and any that read it not begun yet) spent an attempt.
func TestOutageCloseGivesBack(t *testing.T) {
	uri := requireBroker43(t)
	name := "outage-close"
	queue := queueName(t, name)
	t.Cleanup(func() { deleteQueues(t, queue+".poison") })
	const consumers, total = 3, 20
	var down atomic.Bool
	down.Store(true)
	var mu sync.Mutex
	handled := map[string][]uint32{} // the delivery counts each message succeeded with
	ranDown := map[string]uint32{}   // runs while down
	handle := func(msg *message.Message) error {
		if down.Load() {
			mu.Lock()
			ranDown[msg.UUID]++
			mu.Unlock()
			return amqpretry.Unavailable(errors.New("dial tcp 10.0.0.5:5432: connection refused"))
		}
		n, _ := DeliveryCount(msg)
		mu.Lock()
		defer mu.Unlock()
		handled[msg.UUID] = append(handled[msg.UUID], n)
		return nil
	}
	var waiting atomic.Int64
	outside := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			waiting.Add(1)
			defer waiting.Add(-1)
			return h(msg)
		}
	}
	start := func(run int) (*Retry, *message.Router) {
		cfg := amqpretry.Config{
			Prefix: queue,
			Policy: amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{300 * time.Millisecond}, Jitter: -1},
			// No probe comes while the test looks: the messages only wait.
			Outage: amqpretry.Outage{ProbeInterval: time.Hour},
			Logger: testLogger(),
		}
		r, err := NewRetry(SubscriberConfig{URI: uri, Credit: 4, ContainerID: fmt.Sprintf("amqp1-test-%s-%s-%d", runID, name, run)}, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.Close() })
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, testLogger())
		if err != nil {
			t.Fatal(err)
		}
		for i := range consumers {
			sub, err := NewSubscriber(r.SubscriberConfig(), testLogger())
			if err != nil {
				t.Fatal(err)
			}
			router.AddConsumerHandler(fmt.Sprintf("handler-%d", i), queue, sub, handle).AddMiddleware(outside, r.Middleware)
		}
		go func() { _ = router.Run(context.Background()) }()
		select {
		case <-router.Running():
		case <-time.After(30 * time.Second):
			t.Fatal("router not running within 30 s")
		}
		t.Cleanup(func() { _ = router.Close() })
		return r, router
	}
	r1, router1 := start(1)
	pub, err := NewPublisher(PublisherConfig{URI: uri, ContainerID: "amqp1-test-" + runID + "-" + name + "-pub"}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	for i := range total {
		if err := pub.Publish(queue, message.NewMessage(fmt.Sprintf("m%02d", i), []byte("booking"))); err != nil {
			t.Fatal(err)
		}
	}
	ranWhileDown := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(ranDown)
	}
	poll(t, 20*time.Second, "a message waiting in each consumer, the runs before the outage handed off", func() bool {
		return waiting.Load() == consumers && r1.Stats().Retries == int64(ranWhileDown())
	})
	runsDown := ranWhileDown()
	if st := r1.Stats(); st.InOutage != 1 || runsDown > consumers || st.Poisoned != 0 {
		t.Fatalf("while down: %+v, %d messages ran; want the queue in an outage, one retry per run, at most %d, nothing poisoned", st, runsDown, consumers)
	}
	closed := make(chan error, 1)
	go func() { closed <- router1.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("router.Close during an outage: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("router.Close did not return within 30 s")
	}
	if err := r1.Close(); err != nil {
		t.Fatal(err)
	}
	if n := waiting.Load(); n != 0 {
		t.Errorf("%d messages still waiting after Close", n)
	}
	st1 := r1.Stats()
	down.Store(false)
	r2, _ := start(2)
	poll(t, 30*time.Second, "every message handled after the restart", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handled) == total
	})
	mu.Lock()
	dups := 0
	for id, counts := range handled {
		dups += len(counts) - 1
		if counts[0] != ranDown[id] {
			t.Errorf("%s came back with delivery count %d, want %d (its runs while down): going back to the queue counted as a failed delivery (an attempt)", id, counts[0], ranDown[id])
		}
	}
	mu.Unlock()
	st2 := r2.Stats()
	t.Logf("%d messages, %d ran while down, %d handled more than once; first Retry %+v", total, runsDown, dups, st1)
	if st1.Retries != int64(runsDown) || st1.Poisoned != 0 || st2.Retries != 0 || st2.Poisoned != 0 {
		t.Errorf("retried or poisoned for the outage: before Close %+v (%d ran while down), after %+v", st1, runsDown, st2)
	}
}
