package declare_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/topology"
)

// sample is an exchange, a queue with arguments and a binding between them, under
// prefix, deleted when the test ends.
func sample(t *testing.T, prefix string) topology.Topology {
	t.Helper()
	top := topology.Topology{
		Exchanges: []topology.Exchange{{Name: prefix + ".x", Kind: amqp.ExchangeDirect}},
		Queues:    []topology.Queue{{Name: prefix + ".q", Args: amqp.Table{declare.MessageTTLArg: int64(60000)}}},
		Bindings:  []topology.Binding{{Exchange: prefix + ".x", Destination: prefix + ".q", Key: "k"}},
	}
	brokertest.CleanupTopology(t, top)
	return top
}

// onChannel runs fn on a new channel of conn, closed afterwards.
func onChannel(t *testing.T, conn *amqp.Connection, fn func(ch *amqp.Channel) error) error {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	return fn(ch)
}

func TestEnsureModes(t *testing.T) {
	conn := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	top := sample(t, prefix)
	ensure := func(mode topology.Mode) error {
		return onChannel(t, conn, func(ch *amqp.Channel) error { return top.Apply(ch, mode) })
	}
	if err := ensure(topology.ModeNone); err != nil {
		t.Fatalf("none: %v", err)
	}
	err := ensure(topology.ModeVerify)
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), `exchange "`+prefix+`.x"`) {
		t.Fatalf("verify before declare: %v, want ErrMissing naming the exchange", err)
	}
	if err := ensure(""); err != nil {
		t.Fatalf("declare (the zero mode): %v", err)
	}
	if err := ensure(topology.ModeDeclare); err != nil {
		t.Fatalf("declare again, idempotent: %v", err)
	}
	if err := ensure(topology.ModeVerify); err != nil {
		t.Fatalf("verify after declare: %v", err)
	}
	if err := ensure("bogus"); err == nil || !strings.Contains(err.Error(), `"bogus"`) {
		t.Fatalf("unknown mode: %v, want an error naming it", err)
	}
}

func TestVerifyNamesWhatIsMissing(t *testing.T) {
	conn := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	top := sample(t, prefix)
	verify := func(top topology.Topology) error {
		return onChannel(t, conn, func(ch *amqp.Channel) error { return top.Apply(ch, topology.ModeVerify) })
	}
	if err := onChannel(t, conn, func(ch *amqp.Channel) error {
		return (topology.Topology{Exchanges: top.Exchanges}).Apply(ch, topology.ModeDeclare)
	}); err != nil {
		t.Fatal(err)
	}
	err := verify(top)
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), `queue "`+prefix+`.q"`) || !amqperr.IsCode(err, amqp.NotFound) {
		t.Fatalf("missing queue: %v", err)
	}
	// Bindings cannot be read: Verify asserts them, and names the one whose end is gone.
	gone := topology.Topology{Bindings: []topology.Binding{{Exchange: prefix + ".x", Destination: prefix + ".gone", Key: "k"}}}
	err = verify(gone)
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), `binding of "`+prefix+`.gone" to exchange "`+prefix+`.x" with key "k"`) {
		t.Fatalf("binding to a missing queue: %v", err)
	}
	// Verify declares nothing.
	if err := verify(topology.Topology{Queues: top.Queues}); err == nil {
		t.Fatal("the queue exists after Verify")
	}
}

func TestDeclareMismatchNamesTheArgument(t *testing.T) {
	conn := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	top := sample(t, prefix)
	if err := onChannel(t, conn, func(ch *amqp.Channel) error { return top.Apply(ch, topology.ModeDeclare) }); err != nil {
		t.Fatal(err)
	}
	clash := topology.Topology{Queues: []topology.Queue{{Name: prefix + ".q", Args: amqp.Table{declare.MessageTTLArg: int64(1000)}}}}
	err := onChannel(t, conn, func(ch *amqp.Channel) error { return clash.Apply(ch, topology.ModeDeclare) })
	if !errors.Is(err, topology.ErrMismatch) || !amqperr.IsCode(err, amqp.PreconditionFailed) ||
		!strings.Contains(err.Error(), `declare queue "`+prefix+`.q"`) || !strings.Contains(err.Error(), "argument x-message-ttl differs") {
		t.Fatalf("clash: %v, want ErrMismatch naming the queue and the argument", err)
	}
	kind := topology.Topology{Exchanges: []topology.Exchange{{Name: prefix + ".x", Kind: amqp.ExchangeFanout}}}
	err = onChannel(t, conn, func(ch *amqp.Channel) error { return kind.Apply(ch, topology.ModeDeclare) })
	if !errors.Is(err, topology.ErrMismatch) || !strings.Contains(err.Error(), `declare exchange "`+prefix+`.x"`) || !strings.Contains(err.Error(), "argument type differs") {
		t.Fatalf("exchange kind clash: %v", err)
	}
}

func TestMergeAndUnique(t *testing.T) {
	a := topology.Topology{
		Exchanges: []topology.Exchange{{Name: "x", Kind: "direct"}},
		Queues:    []topology.Queue{{Name: "q", Args: amqp.Table{"a": int64(1)}}},
		Bindings:  []topology.Binding{{Exchange: "x", Destination: "q", Key: "k"}},
	}
	b := topology.Topology{
		Exchanges: []topology.Exchange{{Name: "x", Kind: "direct"}, {Name: "x", Kind: "fanout"}},
		Queues:    []topology.Queue{{Name: "q", Args: amqp.Table{"a": int64(1)}}, {Name: "q", Args: amqp.Table{"a": int64(2)}}, {Name: "r"}},
		Bindings:  []topology.Binding{{Exchange: "x", Destination: "q", Key: "k"}, {Exchange: "x", Destination: "q", Key: "k", ToExchange: true}},
	}
	m := declare.Merge(a, b)
	if len(m.Exchanges) != 3 || len(m.Queues) != 4 || len(m.Bindings) != 3 || m.Queues[3].Name != "r" {
		t.Fatalf("Merge: %+v", m)
	}
	u := declare.Unique(m)
	want := topology.Topology{
		Exchanges: []topology.Exchange{{Name: "x", Kind: "direct"}, {Name: "x", Kind: "fanout"}},
		Queues:    []topology.Queue{{Name: "q", Args: amqp.Table{"a": int64(1)}}, {Name: "q", Args: amqp.Table{"a": int64(2)}}, {Name: "r"}},
		Bindings:  []topology.Binding{{Exchange: "x", Destination: "q", Key: "k"}, {Exchange: "x", Destination: "q", Key: "k", ToExchange: true}},
	}
	if !reflect.DeepEqual(u, want) {
		t.Errorf("Unique =\n%+v\nwant\n%+v (the first of each, in order; differing ones kept)", u, want)
	}
	if got := declare.Merge(); !reflect.DeepEqual(got, topology.Topology{}) {
		t.Errorf("Merge() = %+v", got)
	}
}

func TestIsCode(t *testing.T) {
	notFound := &amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no queue 'q'", Server: true}
	if amqperr.IsCode(errors.New("x"), amqp.NotFound) || amqperr.IsCode(nil, amqp.NotFound) || !amqperr.IsCode(errors.Join(errors.New("a"), notFound), amqp.NotFound) {
		t.Error("IsCode misjudges")
	}
}

// TestLeastPrivilege: a user with read and write but no configure permission cannot
// declare, not even what exists with the same arguments; it can verify, bind, and
// check, where the arguments it cannot compare are VerdictUnchecked.
func TestLeastPrivilege(t *testing.T) {
	skipShort(t)
	lpURI := brokertest.RestrictedUser(t)
	admin := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	top := sample(t, prefix)

	lp, err := amqp.Dial(lpURI)
	if err != nil {
		t.Fatal(err)
	}
	defer lp.Close()

	// Before the administrator declares: Verify names what is missing.
	err = onChannel(t, lp, func(ch *amqp.Channel) error { return top.Apply(ch, topology.ModeVerify) })
	if !errors.Is(err, topology.ErrMissing) {
		t.Fatalf("verify before apply: %v", err)
	}
	if err := onChannel(t, admin, func(ch *amqp.Channel) error { return top.Apply(ch, topology.ModeDeclare) }); err != nil {
		t.Fatal(err)
	}

	// Declaring is refused, even what exists with the same arguments...
	err = onChannel(t, lp, func(ch *amqp.Channel) error { return top.Apply(ch, topology.ModeDeclare) })
	if !amqperr.IsCode(err, amqp.AccessRefused) || !strings.Contains(err.Error(), "403") {
		t.Fatalf("declare without configure permission: %v, want 403 ACCESS_REFUSED", err)
	}
	// ...but Verify passes, binding included (queue.bind needs write on the queue and
	// read on the exchange).
	if err := onChannel(t, lp, func(ch *amqp.Channel) error { return top.Apply(ch, topology.ModeVerify) }); err != nil {
		t.Fatalf("verify after apply: %v", err)
	}

	var got []declare.Outcome
	for _, check := range []func() (declare.Outcome, error){
		func() (declare.Outcome, error) { return declare.CheckExchange(lp, top.Exchanges[0], true) },
		func() (declare.Outcome, error) { return declare.CheckQueue(lp, top.Queues[0], true) },
		func() (declare.Outcome, error) { return declare.CheckBinding(lp, top.Bindings[0]) },
	} {
		o, err := check()
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, o)
	}
	want := []declare.Outcome{{Status: declare.Unchecked}, {Status: declare.Unchecked}, {Status: declare.OK}}
	for i, o := range got {
		if i < 2 && !strings.Contains(o.Detail, "ACCESS_REFUSED") {
			t.Errorf("check %d: detail %q, want the refusal", i, o.Detail)
		}
		got[i].Detail = ""
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("least-privilege check:\n%+v\nwant\n%+v", got, want)
	}
	// A missing object is still missing, whatever the permissions.
	if o, err := declare.CheckQueue(lp, topology.Queue{Name: prefix + ".absent"}, false); err != nil || o.Status != declare.Missing {
		t.Fatalf("missing queue, least privilege: %+v, %v", o, err)
	}
	if lp.IsClosed() {
		t.Fatal("a refused check closed the connection")
	}
}

// TestRefusalsThatAreNotMismatches: the broker refuses a declaration it cannot make (an
// exchange type no plugin provides, an invalid argument) with 406 on RabbitMQ 4.x too;
// that is no clash with an existing declaration, and the error must not send an
// operator to delete anything.
func TestRefusalsThatAreNotMismatches(t *testing.T) {
	conn := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	for _, tt := range []struct {
		name string
		top  topology.Topology
		want string
	}{
		{"unknown exchange type", topology.Topology{Exchanges: []topology.Exchange{{Name: prefix + ".x", Kind: "x-no-such-type"}}},
			`declare exchange "` + prefix + `.x"`},
		{"invalid argument", topology.Topology{Queues: []topology.Queue{{Name: prefix + ".q", Args: amqp.Table{declare.MessageTTLArg: int64(-1)}}}},
			`declare queue "` + prefix + `.q"`},
	} {
		brokertest.CleanupTopology(t, tt.top)
		c := conn
		if tt.name == "unknown exchange type" { // a connection error on RabbitMQ 3.x: a connection of its own
			c = brokertest.Dial(t)
		}
		err := onChannel(t, c, func(ch *amqp.Channel) error { return tt.top.Apply(ch, topology.ModeDeclare) })
		if err == nil || errors.Is(err, topology.ErrMismatch) || strings.Contains(err.Error(), "delete it") || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want an error naming the object, not a mismatch", tt.name, err)
		}
	}
}

// skipShort skips a test that waits on the broker for seconds in the quick loop
// (go test -short); the test script runs it.
func skipShort(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("waits on the broker for seconds: not in -short")
	}
}
