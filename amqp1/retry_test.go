package amqp1

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
)

// The Retry tests run the delivery-time backend on the test broker (RabbitMQ 4.3+):
// each measures, for every delivery, when it arrived against when its envelope said it
// was due, and checks the attempt, the envelope and the poison queue.

// lateTolerance bounds how late a retry may come back after its due time in these
// tests: 250 ms, or AMQP1_LATE_TOLERANCE (a Go duration). The broker's own precision
// is a few milliseconds (the benchmark measures it); the bound is generous so that a
// loaded machine does not fail the test, while a backend that ignored the delay, or
// rounded it to a tier, would still fail it.
var lateTolerance = func() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("AMQP1_LATE_TOLERANCE")); err == nil && d > 0 {
		return d
	}
	return 250 * time.Millisecond
}()

// earlyTolerance: the broker gets the due time in whole Unix milliseconds, truncated.
const earlyTolerance = 2 * time.Millisecond

// arrival is one delivery the handler saw.
type arrival struct {
	uuid, payload string
	attempt       int    // amqpretry.Attempt
	count         uint32 // DeliveryCount
	at, returned  time.Time
	err           error // what the handler returned
	metadata      message.Metadata
	annotations   map[string]any
}

// retryRig is a Retry on a work queue of its own, behind a router, with a handler that
// fails as the test says and records every delivery.
type retryRig struct {
	t              *testing.T
	uri            string
	prefix, topic  string
	poison         string
	handler        string
	retry          *Retry
	pub            message.Publisher
	mu             sync.Mutex
	arrivals       []arrival
	arrived        chan struct{}
	routerFinished chan struct{}
}

// newRetryRig declares nothing itself: the Retry declares the poison queue, the
// handler's Subscriber the work queue; both are deleted when the test ends. fail
// decides each delivery's error from the message and its attempt.
func newRetryRig(t *testing.T, name string, cfg amqpretry.Config, fail func(msg *message.Message, attempt int) error) *retryRig {
	t.Helper()
	uri := requireBroker43(t)
	prefix := queueName(t, name) // deleted at the end, as the work queue
	r := &retryRig{t: t, uri: uri, prefix: prefix, topic: prefix, poison: prefix + ".poison", handler: "retry-" + name,
		arrived: make(chan struct{}, 1), routerFinished: make(chan struct{})}
	t.Cleanup(func() { deleteQueues(t, r.poison) })
	cfg.Prefix = prefix
	cfg.Logger = testLogger()
	retry, err := NewRetry(SubscriberConfig{URI: uri, ContainerID: "amqp1-test-" + runID + "-" + name}, cfg)
	if err != nil {
		t.Fatalf("NewRetry: %v", err)
	}
	r.retry = retry
	t.Cleanup(func() { _ = retry.Close() })

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	_, err = retry.AddHandler(router, r.handler, r.topic, func(msg *message.Message) error {
		a := arrival{uuid: msg.UUID, payload: string(msg.Payload), at: time.Now(), attempt: amqpretry.Attempt(msg),
			metadata: maps.Clone(msg.Metadata), annotations: Annotations(msg)}
		a.count, _ = DeliveryCount(msg)
		a.err = fail(msg, a.attempt)
		a.returned = time.Now()
		r.mu.Lock()
		r.arrivals = append(r.arrivals, a)
		r.mu.Unlock()
		select {
		case r.arrived <- struct{}{}:
		default:
		}
		return a.err
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		defer close(r.routerFinished)
		if err := router.Run(ctx); err != nil {
			t.Errorf("router: %v", err)
		}
	}()
	t.Cleanup(func() {
		cancel()
		_ = router.Close()
		select {
		case <-r.routerFinished:
		case <-time.After(30 * time.Second):
			t.Error("router did not stop within 30 s")
		}
	})
	select {
	case <-router.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router not running within 30 s")
	}

	pub, err := NewPublisher(PublisherConfig{URI: uri, ContainerID: "amqp1-test-" + runID + "-" + name + "-pub"}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	r.pub = pub
	return r
}

// waitFor waits until done is true for the arrivals so far, or fails the test at the
// deadline.
func (r *retryRig) waitFor(ctx context.Context, what string, done func([]arrival) bool) []arrival {
	r.t.Helper()
	for {
		r.mu.Lock()
		got := append([]arrival(nil), r.arrivals...)
		r.mu.Unlock()
		if done(got) {
			return got
		}
		select {
		case <-r.arrived:
		case <-time.After(50 * time.Millisecond):
		case <-ctx.Done():
			r.t.Fatalf("%s: not within the deadline; %d deliveries: %s", what, len(got), describeArrivals(got))
		}
	}
}

func describeArrivals(as []arrival) string {
	var b strings.Builder
	for _, a := range as {
		fmt.Fprintf(&b, "\n  %s attempt %d (count %d) at %s err=%v", a.payload, a.attempt, a.count, a.at.Format("15:04:05.000"), a.err)
	}
	return b.String()
}

func byPayload(as []arrival, payload string) []arrival {
	var out []arrival
	for _, a := range as {
		if a.payload == payload {
			out = append(out, a)
		}
	}
	return out
}

// readPoison reads n messages from the poison queue (acking them), or fails the test.
func readPoison(t *testing.T, ctx context.Context, uri, queue string, n int) map[string]*message.Message {
	t.Helper()
	sub, err := NewSubscriber(SubscriberConfig{URI: uri, Queue: QueueConfig{NoDeclare: true}, ContainerID: "amqp1-test-" + runID + "-poison"}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	messages, err := sub.Subscribe(subCtx, queue)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*message.Message{}
	for len(out) < n {
		select {
		case msg := <-messages:
			msg.Ack()
			out[string(msg.Payload)] = msg
		case <-ctx.Done():
			t.Fatalf("poison queue %s: %d of %d messages within the deadline", queue, len(out), n)
		}
	}
	return out
}

var (
	errAlways    = errors.New("downstream unavailable")
	errLimited   = errors.New("429 too many requests")
	errMalformed = errors.New("missing customer id")
)

// TestRetryDelays: an explicit schedule (300ms, 700ms, 1.2s) and a RetryAfter, each
// retry measured against its due time; attempts 1..N from the delivery count; the
// envelope of the previous hop in each retry's metadata; poisoned at MaxAttempts with
// reason max-attempts and the full envelope; Permanent poisoned at once; and nothing
// declared but the work and poison queues.
func TestRetryDelays(t *testing.T) {
	schedule := []time.Duration{300 * time.Millisecond, 700 * time.Millisecond, 1200 * time.Millisecond}
	const retryAfter = time.Second
	cfg := amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 4, Delays: schedule, Jitter: -1}}
	r := newRetryRig(t, "retry-delays", cfg, func(msg *message.Message, attempt int) error {
		switch string(msg.Payload) {
		case "always":
			return fmt.Errorf("attempt %d: %w", attempt, errAlways)
		case "after":
			// A RetryAfter on the first attempt, a plain error (the schedule's second
			// delay) on the second, then success.
			switch attempt {
			case 1:
				return amqpretry.RetryAfter(errLimited, retryAfter)
			case 2:
				return fmt.Errorf("attempt %d: %w", attempt, errAlways)
			}
			return nil
		case "permanent":
			return amqpretry.Permanent(errMalformed)
		}
		return nil
	})
	ctx := testContext(t, 60*time.Second)

	sent := map[string]*message.Message{}
	for _, p := range []string{"always", "after", "permanent"} {
		msg := message.NewMessage(watermill.NewUUID(), []byte(p))
		msg.Metadata.Set("name", "value")
		sent[p] = msg
		if err := r.pub.Publish(r.topic, msg); err != nil {
			t.Fatal(err)
		}
	}
	all := r.waitFor(ctx, "4 deliveries of always, 3 of after, 1 of permanent", func(as []arrival) bool {
		return len(byPayload(as, "always")) >= 4 && len(byPayload(as, "after")) >= 3 && len(byPayload(as, "permanent")) >= 1
	})
	poisoned := readPoison(t, ctx, r.uri, r.poison, 2)

	// Every delivery: the attempt is the delivery count plus one, counted 1..N, the
	// message as published.
	for p, want := range map[string]int{"always": 4, "after": 3, "permanent": 1} {
		as := byPayload(all, p)
		if len(as) != want {
			t.Errorf("%s: %d deliveries, want %d: %s", p, len(as), want, describeArrivals(as))
		}
		for i, a := range as {
			if a.attempt != i+1 || a.count != uint32(i) {
				t.Errorf("%s delivery %d: attempt %d, delivery count %d; want %d, %d", p, i+1, a.attempt, a.count, i+1, i)
			}
			if a.uuid != sent[p].UUID || a.metadata.Get("name") != "value" {
				t.Errorf("%s delivery %d: UUID %s, name=%q; want %s, value", p, i+1, a.uuid, a.metadata.Get("name"), sent[p].UUID)
			}
		}
	}

	// Each retry: back at its due time (within the tolerance), after the delay asked,
	// with the envelope of the hop before it.
	var lates []time.Duration
	checkRetry := func(p string, as []arrival, i int, asked time.Duration) {
		prev, a := as[i-1], as[i]
		env := middleware.ReadEnvelope(a.metadata)
		late := a.at.Sub(env.Due)
		gap := a.at.Sub(prev.returned)
		lates = append(lates, late)
		t.Logf("%s attempt %d: asked %v, back %v after the failure, %v after its due time", p, a.attempt, asked, gap.Round(time.Millisecond), late.Round(100*time.Microsecond))
		if env.Due.IsZero() || late < -earlyTolerance || late > lateTolerance {
			t.Errorf("%s attempt %d: arrived %v after its due time %v, want within [-%v, %v]", p, a.attempt, late, env.Due, earlyTolerance, lateTolerance)
		}
		if gap < asked-earlyTolerance || gap > asked+lateTolerance {
			t.Errorf("%s attempt %d: back %v after the failure, asked %v (tolerance +%v)", p, a.attempt, gap, asked, lateTolerance)
		}
		// The previous hop's envelope, as the retry carries it.
		if env.RequestedDelay != asked || env.EffectiveDelay != asked {
			t.Errorf("%s attempt %d: envelope delays requested %v effective %v, want %v", p, a.attempt, env.RequestedDelay, env.EffectiveDelay, asked)
		}
		if env.Error != prev.err.Error() || len(env.ErrorTypes) == 0 {
			t.Errorf("%s attempt %d: envelope error %q types %v, want %q and its types", p, a.attempt, env.Error, env.ErrorTypes, prev.err)
		}
		if env.Attempt != a.attempt || a.annotations[envelopeAnnotation+"attempt"] != fmt.Sprint(a.attempt) {
			t.Errorf("%s attempt %d: envelope attempt %d, annotation %v", p, a.attempt, env.Attempt, a.annotations[envelopeAnnotation+"attempt"])
		}
		if d := env.LastFailure.Sub(prev.at); d < -time.Millisecond || d > time.Second {
			t.Errorf("%s attempt %d: last failure %v, the failed delivery arrived at %v", p, a.attempt, env.LastFailure, prev.at)
		}
		if d := env.FirstFailure.Sub(as[0].at); d < -time.Millisecond || d > time.Second {
			t.Errorf("%s attempt %d: first failure %v, the first delivery arrived at %v", p, a.attempt, env.FirstFailure, as[0].at)
		}
		if env.Handler != r.handler || env.Topic != r.topic || env.Queue != r.topic || env.Reason != "" {
			t.Errorf("%s attempt %d: envelope handler %q topic %q queue %q reason %q", p, a.attempt, env.Handler, env.Topic, env.Queue, env.Reason)
		}
		// What the broker keeps on modified: the annotations given, merged into the
		// message's own; the delivery-time annotation is not kept (checked below).
		for k, v := range a.annotations {
			if strings.HasPrefix(k, envelopeAnnotation) && a.metadata.Get(strings.TrimPrefix(k, "x-opt-")) != fmt.Sprint(v) && k != envelopeAnnotation+"attempt" {
				t.Errorf("%s attempt %d: annotation %s=%v not in the metadata", p, a.attempt, k, v)
			}
		}
	}
	always := byPayload(all, "always")
	if len(always) == 4 {
		if env := middleware.ReadEnvelope(always[0].metadata); !env.Due.IsZero() || env.Error != "" {
			t.Errorf("first delivery carries an envelope: %+v", env)
		}
		for i := 1; i < 4; i++ {
			checkRetry("always", always, i, schedule[i-1])
		}
		t.Logf("annotations of the last retry of always: %v", always[3].annotations)
		if _, kept := always[3].annotations[deliveryTimeAnnotation]; kept {
			t.Logf("the broker keeps %s on the redelivery", deliveryTimeAnnotation)
		}
		if got := always[3].annotations["x-delivery-count"]; fmt.Sprint(got) != "3" {
			t.Errorf("x-delivery-count on attempt 4: %v, want 3", got)
		}
	}
	if after := byPayload(all, "after"); len(after) == 3 {
		checkRetry("after", after, 1, retryAfter)  // the RetryAfter, not the schedule's 300ms
		checkRetry("after", after, 2, schedule[1]) // the schedule's second delay
		if after[2].err != nil {
			t.Errorf("after: attempt 3 failed: %v", after[2].err)
		}
	}
	sort.Slice(lates, func(i, j int) bool { return lates[i] < lates[j] })
	if len(lates) > 0 {
		t.Logf("lateness of %d retries against their due time: min %v, max %v", len(lates), lates[0], lates[len(lates)-1])
	}

	// The poison queue: the full envelope, the message as published.
	checkPoison := func(p string, reason amqpretry.Reason, attempt int, failures []arrival) {
		msg := poisoned[p]
		if msg == nil {
			t.Errorf("%s not in the poison queue", p)
			return
		}
		env := middleware.ReadEnvelope(msg.Metadata)
		last := failures[len(failures)-1]
		t.Logf("poisoned %s: %v", p, msg.Metadata)
		switch {
		case msg.UUID != sent[p].UUID, msg.Metadata.Get("name") != "value":
			t.Errorf("poisoned %s: UUID %s name=%q, want %s value", p, msg.UUID, msg.Metadata.Get("name"), sent[p].UUID)
		case env.Reason != reason, env.Attempt != attempt, env.MaxAttempts != cfg.Policy.MaxAttempts:
			t.Errorf("poisoned %s: reason %q attempt %d max %d; want %q %d %d", p, env.Reason, env.Attempt, env.MaxAttempts, reason, attempt, cfg.Policy.MaxAttempts)
		case env.Error != last.err.Error(), len(env.ErrorTypes) == 0:
			t.Errorf("poisoned %s: error %q types %v; want %q", p, env.Error, env.ErrorTypes, last.err)
		case env.Handler != r.handler, env.Topic != r.topic, env.Queue != r.topic:
			t.Errorf("poisoned %s: handler %q topic %q queue %q", p, env.Handler, env.Topic, env.Queue)
		case env.FirstFailure.Sub(failures[0].at).Abs() > time.Second, env.LastFailure.Sub(last.at).Abs() > time.Second:
			t.Errorf("poisoned %s: first failure %v last %v; deliveries at %v and %v", p, env.FirstFailure, env.LastFailure, failures[0].at, last.at)
		case env.RequestedDelay != 0, env.EffectiveDelay != 0, !env.Due.IsZero():
			t.Errorf("poisoned %s: carries its last hop's delay: %+v", p, env)
		}
	}
	checkPoison("always", amqpretry.ReasonMaxAttempts, 4, always)
	checkPoison("permanent", amqpretry.ReasonPermanent, 1, byPayload(all, "permanent"))
	if st := r.retry.Stats(); st.Retries != 5 || st.Poisoned != 2 {
		t.Errorf("stats: %+v, want 5 retries and 2 poisoned", st)
	}

	t.Run("declares only the work and poison queues", func(t *testing.T) {
		ctl := rabbitmqctl(t)
		queues := ctlNames(t, ctl, "list_queues", r.prefix)
		exchanges := ctlNames(t, ctl, "list_exchanges", r.prefix)
		want := []string{r.topic, r.poison}
		sort.Strings(want)
		if strings.Join(queues, ",") != strings.Join(want, ",") || len(exchanges) != 0 {
			t.Errorf("with prefix %s the broker has queues %v and exchanges %v; want queues %v and no exchange", r.prefix, queues, exchanges, want)
		}
	})
}

// ctlNames runs `rabbitmqctl <list> name` and returns the sorted names starting with
// prefix.
func ctlNames(t *testing.T, ctl []string, list, prefix string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, ctl[0], append(ctl[1:], list, "-q", "--no-table-headers", "name")...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("rabbitmqctl %s: %v: %s", list, err, stderr.String())
	}
	var names []string
	for _, line := range strings.Split(out.String(), "\n") {
		if name := strings.TrimSpace(line); strings.HasPrefix(name, prefix) {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	return names
}

// TestRetryRefusedBefore43: on RabbitMQ 4.0 (AMQP1_URI_40, default the 4.0 node of
// scripts/rabbitmq4.sh) NewRetry refuses with delay.ErrUnsupported, naming 4.3.
func TestRetryRefusedBefore43(t *testing.T) {
	uri := os.Getenv("AMQP1_URI_40")
	if uri == "" {
		uri = "amqp://guest:guest@127.0.0.1:5674/"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	conn, err := dialTest(ctx, uri, "amqp1-test-"+runID+"-probe40")
	if err != nil {
		e, _ := parseURI(uri, nil)
		if os.Getenv("CI") == "true" {
			t.Fatalf("no RabbitMQ 4.0-4.2 at %s (AMQP1_URI_40): %v", e.redacted, err)
		}
		t.Skipf("no RabbitMQ 4.0-4.2 at %s (set AMQP1_URI_40; CI=true makes this a failure): %v", e.redacted, err)
	}
	v, _ := conn.Properties()["version"].(string)
	_ = conn.Close()
	if versionAtLeast(v, 4, 3) {
		t.Skipf("the broker at AMQP1_URI_40 is RabbitMQ %s, not older than 4.3", v)
	}
	prefix := "amqp1-test-" + runID + "-refused"
	// The poison queue is deleted whether or not NewRetry left it (see below).
	defer deleteQueuesAt(t, uri, prefix+".poison")
	r, err := NewRetry(SubscriberConfig{URI: uri}, amqpretry.Config{Prefix: prefix, Logger: testLogger()})
	if err == nil {
		_ = r.Close()
		t.Fatalf("NewRetry on RabbitMQ %s: no error, want delay.ErrUnsupported", v)
	}
	if !errors.Is(err, delay.ErrUnsupported) || !strings.Contains(err.Error(), "4.3") || !strings.Contains(err.Error(), v) {
		t.Fatalf("NewRetry on RabbitMQ %s: %v; want delay.ErrUnsupported naming 4.3 and the broker's version", v, err)
	}
	t.Logf("RabbitMQ %s: %v", v, err)
	if queueExists(t, uri, prefix+".poison") {
		t.Logf("NewRetry declared the poison queue %s.poison before refusing (middleware/start.go declares it before delay.Prepare checks the version)", prefix)
	}
}

// queueExists tells whether queue exists on the broker at uri (a passive declare).
func queueExists(t *testing.T, uri, queue string) bool {
	t.Helper()
	conn, err := amqp091.DialConfig(uri, amqp091.Config{Dial: amqp091.DefaultDial(10 * time.Second)})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	_, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	return err == nil
}

// deleteQueuesAt deletes queues of the broker at uri, over AMQP 1.0.
func deleteQueuesAt(t *testing.T, uri string, queues ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := dialTest(ctx, uri, "amqp1-test-"+runID+"-cleanup")
	if err != nil {
		t.Errorf("cleanup: connect: %v", err)
		return
	}
	defer conn.Close()
	for _, q := range queues {
		if err := withManagement(ctx, conn, func(m *management) error { return m.deleteQueue(ctx, q) }); err != nil {
			t.Errorf("cleanup: delete queue %q: %v", q, err)
		}
	}
}

// TestNewRetryInvalidConfig: a config the delivery-time backend cannot run is refused
// before any connection (a listener that counts them sees none), naming the field.
func TestNewRetryInvalidConfig(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	// Every accepted connection's remote address, in the order the kernel queued them.
	accepted := make(chan string, 64)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c.RemoteAddr().String()
			_ = c.Close()
		}
	}()
	uri := "amqp://guest:guest@" + ln.Addr().String() + "/"
	for _, tc := range []struct {
		name  string
		sub   SubscriberConfig
		cfg   amqpretry.Config
		names []string
	}{
		{"another backend", SubscriberConfig{URI: uri}, amqpretry.Config{Backend: delay.TTLTiers()}, []string{"Backend", delay.TTLTiers().Name(), delay.DeliveryTime().Name()}},
		{"memory backend", SubscriberConfig{URI: uri}, amqpretry.Config{Backend: delay.Memory(nil)}, []string{"Backend", delay.Memory(nil).Name()}},
		{"classic queue", SubscriberConfig{URI: uri, Queue: QueueConfig{Type: "classic"}}, amqpretry.Config{}, []string{"Queue.Type", "classic", "quorum"}},
		{"held retries", SubscriberConfig{URI: uri}, amqpretry.Config{Backend: delay.HeldRetries(2, 0, delay.DeliveryTime())}, []string{"delay.HeldRetries(then)", "delivery-time"}},
		{"policy", SubscriberConfig{URI: uri}, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: -1}}, []string{"MaxAttempts"}},
		{"no URI", SubscriberConfig{}, amqpretry.Config{}, []string{"URI"}},
		{"above the default delivery limit", SubscriberConfig{URI: uri}, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 21}},
			[]string{"Policy.MaxAttempts", "21", "x-delivery-limit of 20"}},
		{"above the queue's delivery limit", SubscriberConfig{URI: uri, Queue: QueueConfig{Arguments: map[string]any{"x-delivery-limit": int64(3)}}},
			amqpretry.Config{}, []string{"Policy.MaxAttempts", "5", "x-delivery-limit 3"}},
		{"delivery limit not an integer", SubscriberConfig{URI: uri, Queue: QueueConfig{Arguments: map[string]any{"x-delivery-limit": "30"}}},
			amqpretry.Config{}, []string{"x-delivery-limit", "integer"}},
		{"all at once", SubscriberConfig{URI: uri, Queue: QueueConfig{Type: "classic"}}, amqpretry.Config{Backend: delay.HeldRetries(1, 0, delay.TTLTiers())},
			[]string{"Backend", "Queue.Type"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := NewRetry(tc.sub, tc.cfg)
			if err == nil {
				_ = r.Close()
				t.Fatal("no error")
			}
			for _, want := range tc.names {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
			if !strings.Contains(err.Error(), "invalid config") {
				t.Errorf("error %q: want an invalid config error", err)
			}
		})
	}
	// A last connection of the test's own: accepted in order, so once it is seen every
	// connection the refused configs might have opened has been seen before it.
	sentinel, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer sentinel.Close()
	opened := 0
	for deadline := time.After(30 * time.Second); ; {
		select {
		case addr := <-accepted:
			if addr == sentinel.LocalAddr().String() {
				if opened != 0 {
					t.Errorf("%d connections were opened to the broker address before refusing", opened)
				}
				return
			}
			opened++
		case <-deadline:
			t.Fatal("the listener did not accept the test's own connection within 30s")
		}
	}
}

// TestRetryInterop: messages published by watermill-amqp v3 over AMQP 0-9-1 (to the
// quorum queue the Retry's Subscriber declares) are retried over AMQP 1.0: metadata and
// UUID intact on every delivery, the attempt and the envelope as for a message
// published over 1.0, and the poisoned one readable by watermill-amqp.
func TestRetryInterop(t *testing.T) {
	cfg := amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{200 * time.Millisecond, 400 * time.Millisecond}, Jitter: -1}}
	r := newRetryRig(t, "retry-interop", cfg, func(msg *message.Message, attempt int) error {
		switch string(msg.Payload) {
		case "twice":
			if attempt <= 2 {
				return fmt.Errorf("attempt %d: %w", attempt, errAlways)
			}
		case "permanent":
			return amqpretry.Permanent(errMalformed)
		}
		return nil
	})
	ctx := testContext(t, 60*time.Second)

	wcfg := wamqp.NewDurableQueueConfig(r.uri)
	wcfg.Queue.Arguments = amqp091.Table{"x-queue-type": "quorum"} // the quorum queue the Subscriber declared
	pub, err := wamqp.NewPublisher(wcfg, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	sent := map[string]*message.Message{}
	for _, p := range []string{"twice", "permanent"} {
		msg := interopMessage()
		msg.Payload = []byte(p)
		sent[p] = msg
		if err := pub.Publish(r.topic, msg); err != nil {
			t.Fatal(err)
		}
	}
	all := r.waitFor(ctx, "3 deliveries of twice, 1 of permanent", func(as []arrival) bool {
		return len(byPayload(as, "twice")) >= 3 && len(byPayload(as, "permanent")) >= 1
	})
	twice := byPayload(all, "twice")
	for i, a := range twice {
		if a.attempt != i+1 || a.uuid != sent["twice"].UUID {
			t.Errorf("twice delivery %d: attempt %d UUID %s; want %d %s", i+1, a.attempt, a.uuid, i+1, sent["twice"].UUID)
		}
		for k, v := range sent["twice"].Metadata {
			if a.metadata.Get(k) != v {
				t.Errorf("twice delivery %d: metadata %q = %q, want %q", i+1, k, a.metadata.Get(k), v)
			}
		}
		if i > 0 {
			env := middleware.ReadEnvelope(a.metadata)
			asked := cfg.Policy.Delays[i-1]
			late := a.at.Sub(env.Due)
			if env.RequestedDelay != asked || env.Error != twice[i-1].err.Error() || late < -earlyTolerance || late > lateTolerance {
				t.Errorf("twice delivery %d: envelope %+v, %v after its due time; want delay %v, error %q", i+1, env, late, asked, twice[i-1].err)
			}
		}
	}

	// The poisoned message, read back by watermill-amqp: the publisher's metadata and
	// the envelope.
	pcfg := wamqp.NewDurableQueueConfig(r.uri)
	pcfg.TopologyBuilder = existingQueue{} // the Retry declared the poison queue
	sub, err := wamqp.NewSubscriber(pcfg, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	messages, err := sub.Subscribe(ctx, r.poison)
	if err != nil {
		t.Fatal(err)
	}
	got := receiveOne(t, ctx, messages)
	env := middleware.ReadEnvelope(got.Metadata)
	if got.UUID != sent["permanent"].UUID || got.Metadata.Get("unicode") != "żółw 🐢" || env.Reason != amqpretry.ReasonPermanent || env.Error != errMalformed.Error() {
		t.Errorf("poisoned: UUID %s metadata %v envelope %+v", got.UUID, got.Metadata, env)
	}
	var meta bytes.Buffer
	_ = json.NewEncoder(&meta).Encode(got.Metadata)
	t.Logf("poisoned message as watermill-amqp reads it: %s", strings.TrimSpace(meta.String()))
}

// existingQueue is a watermill-amqp topology builder that declares nothing.
type existingQueue struct{}

func (existingQueue) BuildTopology(*amqp091.Channel, wamqp.BuildTopologyParams, wamqp.Config, watermill.LoggerAdapter) error {
	return nil
}
func (existingQueue) ExchangeDeclare(*amqp091.Channel, string, wamqp.Config) error { return nil }

// TestRedeliverMergesAnnotations: what the broker keeps on modified, measured: the
// annotations of each modified outcome are merged into those the message already
// has (a key given once stays on every later delivery unless given again), so the
// Retry writes the same envelope keys on every hop and no stale one can remain.
func TestRedeliverMergesAnnotations(t *testing.T) {
	messages, _, ctx := redeliverSetup(t, "redeliver-merge", QueueConfig{})
	first, _ := next(t, ctx, messages)
	if err := Redeliver(first, time.Now().Add(10*time.Millisecond), map[string]any{"x-opt-a": "1", "x-opt-b": "2"}); err != nil {
		t.Fatal(err)
	}
	first.Nack()
	second, _ := next(t, ctx, messages)
	if err := Redeliver(second, time.Now().Add(10*time.Millisecond), map[string]any{"x-opt-a": "3"}); err != nil {
		t.Fatal(err)
	}
	second.Nack()
	third, _ := next(t, ctx, messages)
	ann := Annotations(third)
	t.Logf("third delivery: %v", ann)
	if ann["x-opt-a"] != "3" || ann["x-opt-b"] != "2" {
		t.Errorf("annotations after modified {a:1, b:2} then {a:3}: a=%v b=%v, want a=3 (replaced) b=2 (kept)", ann["x-opt-a"], ann["x-opt-b"])
	}
	third.Ack()
}

// TestRedeliverDeliveryLimit: what the broker does at a quorum queue's delivery limit
// (RabbitMQ 4's default 20): the 20th modified{delivery-failed} still comes back (count
// 20), the 21st drops the message (no dead-letter target). NewRetry refuses a policy
// whose attempts would pass the limit.
func TestRedeliverDeliveryLimit(t *testing.T) {
	messages, _, ctx := redeliverSetup(t, "redeliver-limit", QueueConfig{})
	for i := 0; i <= defaultDeliveryLimit; i++ {
		m, _ := next(t, ctx, messages)
		if n, _ := DeliveryCount(m); n != uint32(i) {
			t.Fatalf("delivery %d: count %d, want %d", i+1, n, i)
		}
		if err := Redeliver(m, time.Now().Add(time.Millisecond), nil); err != nil {
			t.Fatal(err)
		}
		m.Nack()
	}
	select {
	case m := <-messages:
		n, _ := DeliveryCount(m)
		t.Errorf("delivered again after %d failed deliveries (count %d): the default delivery limit is not %d", defaultDeliveryLimit+1, n, defaultDeliveryLimit)
		m.Ack()
	case <-time.After(3 * time.Second):
		t.Logf("after failed delivery %d the broker delivered the message no more", defaultDeliveryLimit+1)
	}
}

// TestRetryDeliveryLimitRaised: with x-delivery-limit -1 in the Subscriber's queue
// arguments, a policy of 25 attempts runs to its end: 24 retries held by the broker,
// then the poison queue with reason max-attempts.
func TestRetryDeliveryLimitRaised(t *testing.T) {
	cfg := amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 25, Delays: []time.Duration{time.Millisecond}, Jitter: -1}}
	uri := requireBroker43(t)
	prefix := queueName(t, "retry-limit")
	t.Cleanup(func() { deleteQueues(t, prefix+".poison") })
	cfg.Prefix, cfg.Logger = prefix, testLogger()
	retry, err := NewRetry(SubscriberConfig{URI: uri, Queue: QueueConfig{Arguments: map[string]any{"x-delivery-limit": int64(-1)}}}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer retry.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	var last atomic.Int64
	if _, err := retry.AddHandler(router, "limit", prefix, func(msg *message.Message) error {
		last.Store(int64(amqpretry.Attempt(msg)))
		return errAlways
	}); err != nil {
		t.Fatal(err)
	}
	ctx := testContext(t, 60*time.Second)
	runCtx, cancel := context.WithCancel(ctx)
	finished := make(chan struct{})
	go func() { defer close(finished); _ = router.Run(runCtx) }()
	defer func() { cancel(); <-finished }()
	<-router.Running()
	pub, err := NewPublisher(PublisherConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Publish(prefix, message.NewMessage(watermill.NewUUID(), []byte("always"))); err != nil {
		t.Fatal(err)
	}
	msg := readPoison(t, ctx, uri, prefix+".poison", 1)["always"]
	env := middleware.ReadEnvelope(msg.Metadata)
	if env.Reason != amqpretry.ReasonMaxAttempts || env.Attempt != 25 || last.Load() != 25 {
		t.Errorf("poisoned with reason %q at attempt %d (last handled %d), want max-attempts at 25", env.Reason, env.Attempt, last.Load())
	}
}
