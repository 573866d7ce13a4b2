package ops

import (
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/topology"
)

// Verdict is the outcome of checking one declaration: the state of a Finding.
type Verdict string

// Values of Verdict.
const (
	// VerdictOK: the object exists (with the same arguments, when they were compared).
	VerdictOK Verdict = declare.OK
	// VerdictMissing: the object does not exist (or, for a binding, one of its ends).
	VerdictMissing Verdict = declare.Missing
	// VerdictMismatch: the object exists with other arguments; Finding.Arg names the
	// one the broker complained about.
	VerdictMismatch Verdict = declare.Mismatch
	// VerdictUnchecked: the object exists but its arguments could not be compared (no
	// configure permission), or a binding was not asserted.
	VerdictUnchecked Verdict = declare.Unchecked
	// VerdictError: the check itself failed (for example access refused).
	VerdictError Verdict = declare.Failed
)

// Finding is what Verify found about one exchange, queue, binding or work queue.
type Finding struct {
	// Kind is "exchange", "queue", "binding" or "work queue".
	Kind string `json:"kind"`
	// Name is the exchange or queue; for a binding, its destination.
	Name string `json:"name"`
	// Source and Key describe a binding: the exchange it binds to and its routing key.
	Source string `json:"source,omitempty"`
	Key    string `json:"key,omitempty"`
	// Status is the outcome (JSON key "status").
	Status Verdict `json:"status"`
	// Arg is the argument that differs, for VerdictMismatch, as the broker names it
	// ("x-message-ttl", "type", "durable").
	Arg string `json:"arg,omitempty"`
	// Detail is the broker's reply text, when there is one.
	Detail string `json:"detail,omitempty"`
	// Members and Online, for a quorum queue when the check could count them
	// (VerifyOptions.Counts): its members and those online. Fewer online than members
	// means a node is down or a member has not started.
	Members int `json:"members,omitempty"`
	Online  int `json:"members_online,omitempty"`
	// Fix is how to repair it, when the usual fix (apply) cannot: a work queue of
	// another type than delayed retries need, whose type cannot change.
	Fix string `json:"fix,omitempty"`
}

// check checks every declaration of t on conn, one by one, and reports on each, where
// Apply in ModeVerify stops at the first problem. It declares nothing that does not
// exist, and its failed checks leave conn open. It returns an error only when it
// cannot check at all (conn is closed, say): the problems are in the findings.
//   - An exchange or queue is declared passively: VerdictMissing when it does not
//     exist. Then its arguments are compared (declare.CheckQueue).
//   - A queue whose Role is "work" is reported as a "work queue". One that t gives no
//     arguments is the application's: it is checked to exist only.
//   - A binding is asserted when bind is true; otherwise it is VerdictUnchecked: AMQP
//     0-9-1 has no way to read bindings.
func check(conn *amqp.Connection, t topology.Topology, bind bool) ([]Finding, error) {
	var out []Finding
	add := func(f Finding, o declare.Outcome, err error) error {
		f.Status, f.Arg, f.Detail = Verdict(o.Status), o.Arg, o.Detail
		if err == nil {
			out = append(out, f)
		}
		return err
	}
	for _, e := range t.Exchanges {
		o, err := declare.CheckExchange(conn, e, true)
		if err := add(Finding{Kind: "exchange", Name: e.Name}, o, err); err != nil {
			return out, err
		}
	}
	for _, q := range t.Queues {
		kind, compare := "queue", true
		if q.Role == "work" {
			kind, compare = "work queue", q.Args != nil
		}
		o, err := declare.CheckQueue(conn, q, compare)
		if err := add(Finding{Kind: kind, Name: q.Name}, o, err); err != nil {
			return out, err
		}
	}
	for _, b := range t.Bindings {
		f := Finding{Kind: "binding", Name: b.Destination, Source: b.Exchange, Key: b.Key}
		o, err := declare.Outcome{Status: declare.Unchecked}, error(nil)
		if bind {
			o, err = declare.CheckBinding(conn, b)
		}
		if err := add(f, o, err); err != nil {
			return out, err
		}
	}
	return out, nil
}
