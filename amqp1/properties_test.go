package amqp1

import (
	"testing"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// TestNonStringProperties: application properties of any type become metadata text;
// none makes the Subscriber refuse or requeue a delivery. A body that cannot be a
// payload is rejected once, and the messages behind it flow. Also what RabbitMQ makes
// of 0-9-1 headers that are not strings.
func TestNonStringProperties(t *testing.T) {
	uri := requireBroker(t)
	queue := queueName(t, "properties")
	ctx := testContext(t, 30*time.Second)

	sub, err := NewSubscriber(SubscriberConfig{URI: uri}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(queue); err != nil {
		t.Fatal(err)
	}

	// Over AMQP 1.0, straight from go-amqp.
	conn, err := dialTest(ctx, uri, "amqp1-test-"+runID+"-properties")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	session, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	sender, err := session.NewSender(ctx, QueueAddress(queue), nil)
	if err != nil {
		t.Fatal(err)
	}
	ts := time.Date(2026, 1, 2, 3, 4, 5, 6000000, time.UTC)
	send := func(m *amqp.Message) {
		t.Helper()
		if err := sender.Send(ctx, m, nil); err != nil {
			t.Fatal(err)
		}
	}
	send(&amqp.Message{Value: map[string]any{"not": "a payload"}}) // rejected
	send(&amqp.Message{
		Data:       [][]byte{[]byte("one"), []byte("two")},
		Properties: &amqp.MessageProperties{MessageID: "id-from-message-id"},
		ApplicationProperties: map[string]any{
			"s": "text", "i": int64(-5), "u": uint32(7), "b": true, "f": 1.5,
			"t": ts, "bin": []byte{1, 2, 3}, "null": nil,
		},
	})
	send(&amqp.Message{Value: "a string value"})

	// Over AMQP 0-9-1, headers of every type, as RabbitMQ converts them.
	ch091 := dial091(t, uri)
	err = ch091.PublishWithContext(ctx, "", queue, false, false, amqp091.Publishing{
		Body: []byte("from 0-9-1"),
		Headers: amqp091.Table{
			uuidKey:    "uuid-091",
			"i32":      int32(42),
			"table":    amqp091.Table{"a": "b"},
			"array":    []any{"a", int32(1)},
			"x-custom": "x",
		},
	})
	if err != nil {
		t.Fatal(err)
	}

	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	var got []*message.Message
	for len(got) < 3 {
		select {
		case msg := <-messages:
			msg.Ack()
			got = append(got, msg)
		case <-ctx.Done():
			t.Fatalf("received %d of 3", len(got))
		}
	}
	select {
	case msg := <-messages:
		t.Fatalf("unexpected message %q (payload %q): the rejected one came back?", msg.UUID, msg.Payload)
	case <-time.After(300 * time.Millisecond):
	}

	m := got[0]
	if m.UUID != "id-from-message-id" || string(m.Payload) != "onetwo" {
		t.Errorf("got UUID %q payload %q", m.UUID, m.Payload)
	}
	want := map[string]string{
		"s": "text", "i": "-5", "u": "7", "b": "true", "f": "1.5",
		"t": "2026-01-02T03:04:05.006Z", "bin": "AQID", "null": "",
	}
	for k, v := range want {
		if m.Metadata.Get(k) != v {
			t.Errorf("metadata %q = %q, want %q", k, m.Metadata.Get(k), v)
		}
	}
	if string(got[1].Payload) != "a string value" || got[1].UUID != "" {
		t.Errorf("amqp-value message: UUID %q payload %q", got[1].UUID, got[1].Payload)
	}
	m = got[2]
	t.Logf("0-9-1 headers as metadata: %v; annotations: %v", m.Metadata, Annotations(m))
	if m.UUID != "uuid-091" || string(m.Payload) != "from 0-9-1" || m.Metadata.Get("i32") != "42" {
		t.Errorf("0-9-1 message: UUID %q payload %q metadata %v", m.UUID, m.Payload, m.Metadata)
	}
	// RabbitMQ (4.3.6) moves x- headers to message annotations and leaves out the
	// headers that are tables or arrays (application properties carry simple values).
	if Annotations(m)["x-custom"] != "x" || m.Metadata.Get("x-custom") != "" {
		t.Errorf("x-custom: metadata %q, annotation %#v", m.Metadata.Get("x-custom"), Annotations(m)["x-custom"])
	}
	for _, k := range []string{"table", "array"} {
		if _, ok := m.Metadata[k]; ok {
			t.Errorf("header %q reached the metadata: %q", k, m.Metadata[k])
		}
	}
}

func dial091(t *testing.T, uri string) *amqp091.Channel {
	t.Helper()
	conn, err := amqp091.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	return ch
}
