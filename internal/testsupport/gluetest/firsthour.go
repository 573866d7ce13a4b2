package gluetest

// What a new user tripped on in their fourth hour with the library (issue 51): a
// poison queue named like the work queue, and the documented delayed-retry setup
// starting with an ERROR.

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/topology"
)

// runHandler adds a handler on topic with r's AddHandler to a router logging to logger
// and runs it: the error of AddHandler or of Run (where a subscription is refused), or
// nil once the router runs, with stop to close it.
func runHandler(t *testing.T, r Retry, topic string, h message.NoPublishHandlerFunc, logger watermill.LoggerAdapter) (stop func(), err error) {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.AddHandler(router, "orders", topic, h); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
		stop = sync.OnceFunc(func() { _ = router.Close(); cancel(); <-done })
		t.Cleanup(stop)
		return stop, nil
	case err := <-done:
		cancel()
		return nil, err
	case <-time.After(30 * time.Second):
		cancel()
		t.Fatal("the router neither ran nor failed within 30s")
	}
	return nil, nil
}

// PoisonQueueNamedLikeTheWorkQueue: Config.PoisonQueue names the handler's work queue.
// AddHandler refuses it, naming the fix and the queue New declared as the poison
// queue (before: accepted, and router.Run refused it). With the config fixed, the
// subscriber's declaration clashes with that stray queue: the error says it is a
// poison queue an earlier config left and gives the command that deletes it
// (before: the clash's one argument, and no word of deleting it). Deleted, the router
// runs. And where the work queue exists already, New refuses the poison queue's name
// before it declares anything.
func PoisonQueueNamedLikeTheWorkQueue(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	logs := &logCapture{}
	s.cfg.Logger = logs
	wrong := s.cfg
	wrong.PoisonQueue = s.topic
	fail := func(*message.Message) error { return errFlaky }
	_, err := runHandler(t, newRetry(t, m, s.sub, wrong), s.topic, fail, logs)
	if !errors.Is(err, amqpretry.ErrNotWired) {
		t.Fatalf("AddHandler on the poison queue: %v, want ErrNotWired", err)
	}
	for _, want := range []string{`handler "orders"`, `queue "` + s.topic + `" is this Retry's poison queue (Config.PoisonQueue)`,
		`give the poison queue a name of its own (by default "` + s.prefix + `.poison")`, "rabbitmqctl delete_queue " + s.topic} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("AddHandler's refusal %q does not say %s", err, want)
		}
	}

	// The config fixed: the queue New declared under the work queue's name is named.
	r := newRetry(t, m, s.sub, s.cfg)
	_, err = runHandler(t, r, s.topic, fail, logs)
	if !errors.Is(err, topology.ErrMismatch) {
		t.Fatalf("subscribe over the stray poison queue: %v, want ErrMismatch", err)
	}
	for _, want := range []string{`work queue "` + s.topic + `"`, "a poison queue's arguments", "PoisonQueue was " + `"` + s.topic + `"`,
		"`rabbitmqctl delete_queue " + s.topic + "`"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the clash %q does not say %s", err, want)
		}
	}
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDelete(s.topic, false, false, false); err != nil {
		t.Fatal(err)
	}
	stop, err := runHandler(t, r, s.topic, fail, logs)
	if err != nil {
		t.Fatalf("the router does not run once the stray queue is deleted: %v", err)
	}
	stop()

	// The work queue exists (it just ran): New refuses it as the poison queue before
	// it declares anything.
	other := s.cfg
	other.Prefix = brokertest.Prefix(t)
	other.PoisonQueue = s.topic
	if plan, err := other.Plan(); err == nil {
		brokertest.CleanupTopology(t, plan)
	}
	_, err = m.New(s.sub, other)
	if !errors.Is(err, topology.ErrMismatch) {
		t.Fatalf("New with the work queue as the poison queue: %v, want ErrMismatch", err)
	}
	for _, want := range []string{`PoisonQueue: "` + s.topic + `"`, "a queue of that name exists with", "nothing was declared",
		`give the poison queue a name of its own (by default "` + other.Prefix + `.poison")`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("New's refusal %q does not say %s", err, want)
		}
	}
	if exchangeExists(t, other.Prefix+".delay") {
		t.Error("New declared the backend's exchange before it refused the poison queue")
	}
}

// exchangeExists tells whether exchange exists on the broker.
func exchangeExists(t *testing.T, exchange string) bool {
	t.Helper()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ch.Close() }()
	return ch.ExchangeDeclarePassive(exchange, "direct", true, false, false, false, nil) == nil
}

// HeldRetriesStartWithNoError: on RabbitMQ 4.3, delayed retries on the setups the docs
// give: the README's durable queue config (no queue arguments), docs/cqrs.md's
// x-queue-type quorum, and ttl-tiers with delay.HeldRetries. The subscriber config gives the
// work queue every argument it needs, the poison queue as its dead-letter target
// included, so that nothing is logged at ERROR from New to Close, a failed message
// retried included (before: "Work queues drop what they cannot deliver" at start).
// Queue arguments of the user's that conflict with them are refused by New, named.
func HeldRetriesStartWithNoError(t *testing.T, m Major) {
	for _, tc := range []struct {
		name    string
		backend delay.Backend
		held    int
		args    amqp.Table
		policy  amqpretry.Policy
	}{
		{"delayed-retry, durable queue config", delay.DelayedRetry(0), 0, nil, amqpretry.Policy{MaxAttempts: 3}},
		{"delayed-retry, x-queue-type quorum", delay.DelayedRetry(0), 0, quorum, amqpretry.Policy{MaxAttempts: 3}},
		{"ttl-tiers with HeldRetries", delay.TTLTiers(), 1, nil, amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			need43(t)
			s := newSetup(t, m, tc.backend)
			logs := &logCapture{}
			s.cfg.Logger = logs
			if tc.held > 0 {
				s.cfg.Backend = delay.HeldRetries(tc.held, 300*time.Millisecond, s.cfg.Backend)
			} else {
				s.cfg.Backend = delay.DelayedRetry(300 * time.Millisecond)
			}
			s.cfg.Policy = tc.policy
			s.sub.QueueArgs = tc.args
			r := newRetry(t, m, s.sub, s.cfg)
			rec := newRecorder(failFirst(1))
			if _, err := runHandler(t, r, s.topic, rec.handle, logs); err != nil {
				t.Fatal(err)
			}
			publish(t, m, s.topic, "once")
			rec.waitCalls(t, 2, 30*time.Second)
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			for _, l := range logs.at(watermill.ErrorLogLevel) {
				t.Errorf("ERROR %q: %v %v", l.Msg, l.Err, l.Fields)
			}
			has, ok := declare.QueueArgs(brokertest.Dial(t), s.topic, amqp.Table{declare.DeadLetterKeyArg: s.prefix + ".poison"})
			if !ok || has[declare.DeadLetterExchangeArg] != "" || has[declare.DeadLetterKeyArg] != s.prefix+".poison" {
				t.Errorf("work queue declared with %v, want the poison queue as its dead-letter target", has)
			}
		})
	}
	t.Run("conflicting queue arguments", func(t *testing.T) {
		s := newSetup(t, m, delay.DelayedRetry(0))
		s.sub.QueueArgs = amqp.Table{"x-queue-type": "quorum", "x-delayed-retry-min": int64(5000), "x-dead-letter-exchange": "app.dlx"}
		_, err := m.New(s.sub, s.cfg)
		want := `Subscriber: Queue.Arguments: x-delayed-retry-min 5000: a work queue that holds delayed retries needs x-delayed-retry-min 1000, which the subscriber config adds (the delayed-retry backend's delay sets it): leave it out of Queue.Arguments`
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("New = %v, want %s", err, want)
		}
		if strings.Contains(err.Error(), "x-dead-letter-exchange") {
			t.Errorf("New refused the user's own dead-letter exchange: %v", err)
		}
	})
}
