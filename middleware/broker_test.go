package middleware

import (
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/topology"
)

// TestVerifyModeNamesWhatIsMissing: in topology mode verify a Retry declares nothing:
// its start and the subscriber's topology builder (BindWorkQueue) name what is missing
// and the command that creates it; in mode none BindWorkQueue touches nothing.
func TestVerifyModeNamesWhatIsMissing(t *testing.T) {
	conn := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	orders := prefix + ".orders"
	cfg := amqpretry.Config{Prefix: prefix, Backend: delay.TTLTiers(time.Second, 2*time.Second), Topology: topology.ModeVerify}
	plan, err := cfg.Plan()
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, plan)
	brokertest.Cleanup(t, []string{orders}, nil)
	apply := "amqpretry topology apply --backend ttl-tiers --prefix " + prefix + " --tiers 1s,2s"

	// Before apply: Start names what is missing and the command.
	_, err = startTest(cfg.WithDefaults(), Transport{URI: brokertest.URI()})
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), "`"+apply+"`") {
		t.Fatalf("verify mode before apply: %v", err)
	}

	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := plan.Apply(ch, topology.ModeDeclare); err != nil {
		t.Fatal(err)
	}
	r, err := startTest(cfg.WithDefaults(), Transport{URI: brokertest.URI()})
	if err != nil {
		t.Fatalf("verify mode after apply: %v", err)
	}
	defer r.close()

	// The work queue was never declared: its binding cannot be made.
	err = r.bind(ch, orders)
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), `binding of "`+orders+`"`) ||
		!strings.Contains(err.Error(), "`"+apply+" --queue "+orders+"`") {
		t.Fatalf("builder verify on a missing queue: %v", err)
	}
	if r.isBound(orders) {
		t.Error("a queue that could not be bound is recorded as bound")
	}
	ch, err = conn.Channel() // the failed binding closed the other
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(orders, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	// Verify mode asserts the binding (queue.bind needs no configure permission).
	if err := r.bind(ch, orders); err != nil || !r.isBound(orders) {
		t.Fatalf("builder verify on an existing queue: %v (bound: %v)", err, r.isBound(orders))
	}

	none := cfg
	none.Topology = topology.ModeNone
	rn, err := startTest(none.WithDefaults(), Transport{URI: brokertest.URI()})
	if err != nil {
		t.Fatal(err)
	}
	defer rn.close()
	if err := rn.bind(nil, "whatever"); err != nil || !rn.isBound("whatever") {
		t.Fatalf("mode none: %v", err)
	}
}

// TestStartWarnsAboutTheDeliveryLimit: with a quorum work queue whose delivery
// limit is below the policy's attempts, Start warns (RabbitMQ before 4.3 counts a nack
// with requeue against the limit).
func TestStartWarnsAboutTheDeliveryLimit(t *testing.T) {
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	logs := &countingLogger{}
	cfg := amqpretry.Config{Prefix: prefix, Backend: delay.TTLTiers(time.Second), Logger: logs}
	plan, err := cfg.Plan()
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, plan)
	r, err := startTest(cfg.WithDefaults(), Transport{URI: brokertest.URI(), QueueArgs: amqp.Table{declare.QueueTypeArg: declare.QueueTypeQuorum, declare.DeliveryLimitArg: int64(2)}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.close()
	if v := r.handoff.Version(); workQueueWarning(v, amqp.Table{declare.QueueTypeArg: declare.QueueTypeQuorum, declare.DeliveryLimitArg: int64(2)}, 5) != "" && logs.errors == 0 {
		t.Errorf("RabbitMQ %s: no warning logged for a delivery limit of 2 with 5 attempts", v)
	}
}
