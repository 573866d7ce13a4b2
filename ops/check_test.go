package ops

import (
	"reflect"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/topology"
)

// TestCheck: check reports on each declaration without creating any; compares the
// arguments of what exists (not those of a work queue given none); asserts bindings
// only when asked; and its failed checks never close the connection.
func TestCheck(t *testing.T) {
	conn := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	top := topology.Topology{
		Exchanges: []topology.Exchange{{Name: prefix + ".x", Kind: amqp.ExchangeDirect}},
		Queues:    []topology.Queue{{Name: prefix + ".q", Args: amqp.Table{"x-message-ttl": int64(60000)}, Role: "work"}},
		Bindings:  []topology.Binding{{Exchange: prefix + ".x", Destination: prefix + ".q", Key: "k"}},
	}
	brokertest.CleanupTopology(t, top)
	onChannel := func(fn func(ch *amqp.Channel) error) error {
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		defer ch.Close()
		return fn(ch)
	}

	findings, err := check(conn, top, true)
	if err != nil {
		t.Fatal(err)
	}
	want := []Finding{
		{Kind: "exchange", Name: prefix + ".x", Status: VerdictMissing},
		{Kind: "work queue", Name: prefix + ".q", Status: VerdictMissing},
		{Kind: "binding", Name: prefix + ".q", Source: prefix + ".x", Key: "k", Status: VerdictMissing},
	}
	for i, f := range findings {
		if !strings.Contains(f.Detail, "NOT_FOUND") {
			t.Errorf("%s %s: detail %q, want the broker's reply", f.Kind, f.Name, f.Detail)
		}
		findings[i].Detail = ""
	}
	if !reflect.DeepEqual(findings, want) {
		t.Fatalf("before declare:\n%+v\nwant\n%+v", findings, want)
	}
	// check never creates what it checks.
	if err := onChannel(func(ch *amqp.Channel) error {
		return (topology.Topology{Queues: top.Queues}).Apply(ch, topology.ModeVerify)
	}); err == nil {
		t.Fatal("check created the queue")
	}

	if err := onChannel(func(ch *amqp.Channel) error { return top.Apply(ch, topology.ModeDeclare) }); err != nil {
		t.Fatal(err)
	}
	findings, err = check(conn, top, true)
	if err != nil {
		t.Fatal(err)
	}
	for i := range want {
		want[i].Status = VerdictOK
	}
	if !reflect.DeepEqual(findings, want) {
		t.Fatalf("after declare:\n%+v\nwant\n%+v", findings, want)
	}

	// Other arguments: a mismatch naming the argument; a work queue given no
	// arguments is only checked to exist.
	other := topology.Topology{Queues: []topology.Queue{{Name: prefix + ".q", Args: amqp.Table{"x-message-ttl": int64(1000)}}}}
	findings, err = check(conn, other, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(findings) != 1 || findings[0].Kind != "queue" || findings[0].Status != VerdictMismatch || findings[0].Arg != "x-message-ttl" || !strings.Contains(findings[0].Detail, "PRECONDITION_FAILED") {
		t.Fatalf("mismatch: %+v", findings)
	}
	bare := topology.Topology{Queues: []topology.Queue{{Name: prefix + ".q", Role: "work"}}}
	findings, err = check(conn, bare, false)
	if err != nil || len(findings) != 1 || findings[0].Status != VerdictOK {
		t.Fatalf("a work queue given no arguments: %+v, %v", findings, err)
	}
	// Bindings are not asserted unless asked.
	findings, err = check(conn, topology.Topology{Bindings: top.Bindings}, false)
	if err != nil || len(findings) != 1 || findings[0].Status != VerdictUnchecked {
		t.Fatalf("binding without bind: %+v, %v", findings, err)
	}
	// The connection survives every failed check.
	if conn.IsClosed() {
		t.Fatal("a check closed the connection")
	}
}
