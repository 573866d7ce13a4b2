package wamqp

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/derived"
)

// TestNewValidatesEveryField: New names every invalid field of the subscriber config
// and of the Config, and connects to nothing before they are valid.
func TestNewValidatesEveryField(t *testing.T) {
	sub := Sub{
		URI:             "amqp://guest:secret@127.0.0.1:1/", // nothing listens: never dialled
		NoRequeueOnNack: true,
		Marshaler:       otherMarshaler{},
		QueueArgs:       amqp.Table{"x-queue-type": "classic"},
	}
	_, err := New(sub, amqpretry.Config{Backend: delay.HeldRetries(2, 0, nil), Policy: amqpretry.Policy{MaxAttempts: -2}})
	for _, want := range []string{
		"invalid config", "Subscriber: Queue.GenerateName: required", "Subscriber: Consume.NoRequeueOnNack", "Subscriber: Marshaler: wamqp.otherMarshaler",
		"Subscriber: Queue.Arguments: x-queue-type classic", "Policy.MaxAttempts: -2",
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("New error %v does not say %q", err, want)
		}
	}
	if err != nil && strings.Contains(err.Error(), "secret") {
		t.Errorf("error shows the password: %v", err)
	}
	_, err = New(Sub{}, amqpretry.Config{})
	if err == nil || !strings.Contains(err.Error(), "Subscriber: Connection.AmqpURI: required for the ttl-tiers backend") {
		t.Errorf("no URI: %v", err)
	}
	_, err = New(Sub{}, amqpretry.Config{Backend: delay.Memory(nil)})
	if err == nil || !strings.Contains(err.Error(), "Backend.Publisher: required for the memory backend") {
		t.Errorf("memory backend without Memory: %v", err)
	}
}

// TestInProcessLeavesTheSubscriberAlone: in-process, the subscriber config needs
// nothing of the Retry; the marshaler still marks deliveries, and the queue arguments
// are left as they are when the work queues hold no retries.
func TestInProcessLeavesTheSubscriberAlone(t *testing.T) {
	w, err := New(Sub{QueueName: func(topic string) string { return topic }}, amqpretry.Config{Backend: delay.Memory(discard{})})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Retry.Close()
	if !w.InProcess() {
		t.Error("not in process without a URI")
	}
	if o := w.Marshaler().Options; !o.Retry || o.Delivered == nil || o.ReturnedAttempts || o.MessageUUIDHeaderKey != "" {
		t.Errorf("subscriber marshal options %+v", o)
	}
	if args := (amqp.Table{"a": 1}); w.WorkQueueArgs(args)["a"] != 1 || len(w.WorkQueueArgs(args)) != 1 {
		t.Error("WorkQueueArgs changed the arguments of a Retry that holds no retries")
	}
}

// otherMarshaler is a marshaler of a type the Retry cannot use.
type otherMarshaler struct{}

type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

// counted is a backend value that counts how often it is opened.
type counted struct {
	delay.Backend
	opens *int
}

func (c counted) Open(s backend.Setup) (backend.Backend, error) {
	*c.opens++
	return c.Backend.(backend.Opener).Open(s)
}

func (c counted) Backends() []backend.Opener { return c.Backend.(backend.Opener).Backends() }

// TestNewDerivesOnce: each of the transport's New, the middleware's New and
// Config.Validate derives the Config once (internal/derived.Of, backend.Derive),
// opening the backend to plan, and the middleware opens it once more to run, whatever
// the transport, the middleware and the wiring read of it: the transport's checks and
// its wiring share one derivation, as the middleware's checks and its start do. No
// public method hands a derivation from one package to the next (its type is
// internal); opening to plan parks nothing.
func TestNewDerivesOnce(t *testing.T) {
	opens := 0
	w, err := New(Sub{QueueName: func(topic string) string { return topic }}, amqpretry.Config{Backend: counted{delay.Memory(discard{}), &opens}})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Retry.Close()
	_ = w.Marshaler()
	_ = w.WorkQueueArgs(nil)
	if opens != 4 {
		t.Errorf("the backend was opened %d times by New, want 4: to plan by the transport, the middleware and Validate, once to run", opens)
	}
}

// TestPoisonQueueNamedLikeTheOneWorkQueue: a subscriber config whose Queue.GenerateName
// names one queue whatever the topic has that queue as its work queue: New refuses a
// poison queue of that name before it dials (issue 51), and only that.
func TestPoisonQueueNamedLikeTheOneWorkQueue(t *testing.T) {
	sub := Sub{URI: "amqp://guest:guest@127.0.0.1:1/", QueueName: func(string) string { return "orders" }}
	_, err := New(sub, amqpretry.Config{Prefix: "app", PoisonQueue: "orders"})
	want := `PoisonQueue: "orders" is the work queue, the one queue the subscriber config's Queue.GenerateName names for every topic: a subscriber with retries would send its failures back into it; give the poison queue a name of its own (by default "app.poison")`
	if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "dial") {
		t.Errorf("New = %v, want refused before dialling: %s", err, want)
	}
	sub.QueueName = func(topic string) string { return topic } // "orders" only for topic "orders": AddHandler knows
	if _, err := New(sub, amqpretry.Config{PoisonQueue: "orders"}); err == nil || strings.Contains(err.Error(), "PoisonQueue") {
		t.Errorf("New with a queue per topic = %v, want only the dial to fail", err)
	}
}

// TestWorkQueueArgsOfHeldRetries: with retries held in the work queue, the subscriber
// config adds every argument the work queue needs, the poison queue as its dead-letter
// target included, unless the user names a dead-letter exchange of their own; an
// argument of the user's that gives one of them another value is refused by New,
// named (issue 51).
func TestWorkQueueArgsOfHeldRetries(t *testing.T) {
	cfg := amqpretry.Config{Prefix: "app", Backend: delay.DelayedRetry(2 * time.Second)}
	needed := derived.Of(cfg).WorkQueueArgs
	want := amqp.Table{"x-queue-type": "quorum", "x-delayed-retry-type": "returned", "x-delayed-retry-min": int64(2000), "x-delayed-retry-max": int64(2000),
		"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "app.poison"}
	for _, user := range []amqp.Table{nil, {"x-queue-type": "quorum"}, {"x-delayed-retry-min": int32(2000)}} {
		got, conflicts := backend.MergeWorkQueueArgs(user, needed)
		for k, v := range want {
			if !declare.SameValue(got[k], v) {
				t.Errorf("user %v: %s = %v, want %v", user, k, got[k], v)
			}
		}
		if len(conflicts) != 0 {
			t.Errorf("user %v: conflicts %v", user, conflicts)
		}
	}
	got, _ := backend.MergeWorkQueueArgs(amqp.Table{"x-dead-letter-exchange": "app.dlx"}, needed)
	if got["x-dead-letter-exchange"] != "app.dlx" || got["x-dead-letter-routing-key"] != nil {
		t.Errorf("the user's own dead-letter exchange: %v", got)
	}
	sub := Sub{URI: "amqp://guest:guest@127.0.0.1:1/", QueueName: func(topic string) string { return topic },
		QueueArgs: amqp.Table{"x-delayed-retry-type": "all", "x-delayed-retry-max": int64(60000), "x-dead-letter-routing-key": "mine"}}
	_, err := New(sub, cfg)
	for _, w := range []string{
		`Subscriber: Queue.Arguments: x-delayed-retry-max 60000: a work queue that holds delayed retries needs x-delayed-retry-max 2000, which the subscriber config adds (the delayed-retry backend's delay sets it): leave it out of Queue.Arguments`,
		`Subscriber: Queue.Arguments: x-delayed-retry-type all: a work queue that holds delayed retries needs x-delayed-retry-type "returned", which the subscriber config adds: leave it out of Queue.Arguments`,
	} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("New = %v, want %s", err, w)
		}
	}
	if err != nil && strings.Contains(err.Error(), "x-dead-letter-routing-key") {
		t.Errorf("New refused the user's own dead-letter routing key: %v", err)
	}
}
