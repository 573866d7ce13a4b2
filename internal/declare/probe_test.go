package declare_test

import (
	"errors"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/topology"
)

// TestQueueArgsReadsEveryArgument: RabbitMQ's refusal of a declaration names one
// argument; QueueArgs reads all of them, of each type, a value the refusal's 255 bytes
// cut short included (from the likely values), and creates nothing.
func TestQueueArgsReadsEveryArgument(t *testing.T) {
	conn := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	queue := prefix + strings.Repeat(".long-name", 4) // the refusal cut short within the routing key
	target := queue + ".poison"
	brokertest.Cleanup(t, []string{queue, prefix + ".missing"}, nil)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	want := amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int64(7), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": target}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, want); err != nil {
		t.Fatal(err)
	}
	got, ok := declare.QueueArgs(conn, queue, amqp.Table{"x-dead-letter-routing-key": target})
	if !ok || !declare.SameArgs(got, want) {
		t.Errorf("QueueArgs = %v, %v; want %v", got, ok, want)
	}
	if _, ok := declare.QueueArgs(conn, queue, nil); ok {
		t.Error("read a value cut short without a likely value")
	}
	if got, ok := declare.QueueArgs(conn, prefix+".missing", nil); ok {
		t.Errorf("a missing queue: %v", got)
	}
	if _, err := ch.QueueDeclarePassive(prefix+".missing", true, false, false, false, nil); err == nil {
		t.Error("QueueArgs created the missing queue")
	}
}

// TestHintNamesAStrayPoisonQueue: a work queue whose declaration clashes and that has a
// poison queue's arguments was left by a config whose PoisonQueue named it: the hint
// says so and gives the command that deletes it (issue 51). Without a connection to
// read it over, the hint is the clash's.
func TestHintNamesAStrayPoisonQueue(t *testing.T) {
	conn := brokertest.Dial(t)
	queue := brokertest.Prefix(t) + ".orders"
	brokertest.Cleanup(t, []string{queue}, nil)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, declare.ReviewQueue(queue, "poison").Args); err != nil {
		t.Fatal(err)
	}
	_, clash := ch.QueueDeclare(queue, true, false, false, false, nil) // the work queue as watermill-amqp declares it
	f := declare.Fix{Mode: topology.ModeDeclare, PoisonQueue: "app.poison", Apply: func(...string) string { return "amqpretry topology apply" },
		Conn: func() (*amqp.Connection, error) { return conn, nil }}
	err = f.Hint(clash, queue)
	for _, want := range []string{`work queue "` + queue + `"`, "a poison queue's arguments", `PoisonQueue was "` + queue + `"`, "`rabbitmqctl delete_queue " + queue + "`"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("hint %q does not say %s", err, want)
		}
	}
	if !errors.Is(err, topology.ErrMismatch) {
		t.Errorf("hint %v does not wrap ErrMismatch", err)
	}
	f.Conn = nil
	if err := f.Hint(clash, queue); strings.Contains(err.Error(), "delete_queue") {
		t.Errorf("hint without a connection %q names a stray it could not read", err)
	}
}

func TestFormatArgs(t *testing.T) {
	got := declare.FormatArgs(amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(5), "x-dead-letter-exchange": ""})
	if want := `x-dead-letter-exchange: "", x-delivery-limit: 5, x-queue-type: "quorum"`; got != want {
		t.Errorf("FormatArgs = %s, want %s", got, want)
	}
	if !declare.IsReviewQueue(amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(1_000_000)}) {
		t.Error("a review queue's arguments, the limit of another width, not recognised")
	}
	if declare.IsReviewQueue(amqp.Table{"x-queue-type": "quorum"}) {
		t.Error("a quorum queue taken for a review queue")
	}
}
