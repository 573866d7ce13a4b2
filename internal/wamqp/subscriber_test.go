package wamqp

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
)

// TestNewValidatesEveryField: New names every invalid field of the subscriber config
// and of the Config, and connects to nothing before they are valid.
func TestNewValidatesEveryField(t *testing.T) {
	sub := Sub{
		URI:             "amqp://guest:secret@127.0.0.1:1/", // nothing listens: never dialled
		NoRequeueOnNack: true,
		MarshalerType:   "mypkg.Marshaler",
		QueueArgs:       amqp.Table{"x-queue-type": "classic"},
	}
	_, err := New(sub, amqpretry.Config{HeldRetries: 2, Policy: amqpretry.Policy{MaxAttempts: -2}, HandoffAttempts: -1})
	for _, want := range []string{
		"invalid config", "Subscriber: Queue.GenerateName: required", "Subscriber: Consume.NoRequeueOnNack", "Subscriber: Marshaler: mypkg.Marshaler",
		"Subscriber: Queue.Arguments: x-queue-type classic", "Policy.MaxAttempts: -2", "HandoffAttempts",
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
	_, err = New(Sub{}, amqpretry.Config{Backend: delay.Memory{}})
	if err == nil || !strings.Contains(err.Error(), "Memory: required for the memory backend") {
		t.Errorf("memory backend without Memory: %v", err)
	}
}

// TestInProcessLeavesTheSubscriberAlone: in-process, the subscriber config needs
// nothing of the Retry; the marshaler still marks deliveries, and the queue arguments
// are left as they are when the work queues hold no retries.
func TestInProcessLeavesTheSubscriberAlone(t *testing.T) {
	w, err := New(Sub{QueueName: func(topic string) string { return topic }}, amqpretry.Config{Backend: delay.Memory{Publisher: discard{}}})
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

type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

// counted is a backend value that counts how often it is opened.
type counted struct {
	delay.Memory
	opens *int
}

func (c counted) Open(s backend.Setup) (backend.Backend, error) {
	*c.opens++
	return c.Memory.Open(s)
}

// TestNewDerivesOnce: the transport's New derives the Config once and hands it down:
// the backend is opened once to plan and validate and once to run, whatever the
// transport, the middleware and the wiring read of it.
func TestNewDerivesOnce(t *testing.T) {
	opens := 0
	w, err := New(Sub{QueueName: func(topic string) string { return topic }}, amqpretry.Config{Backend: counted{delay.Memory{Publisher: discard{}}, &opens}})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Retry.Close()
	_ = w.Marshaler()
	_ = w.WorkQueueArgs(nil)
	if opens != 2 {
		t.Errorf("the backend was opened %d times by New, want 2: once to plan, once to run", opens)
	}
}
