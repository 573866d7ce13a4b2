package topology

import (
	"errors"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Topology is a set of declarations, applied in order: exchanges, queues, then
// bindings, so that a binding always finds both of its ends. Every exchange and queue
// is durable.
type Topology struct {
	Exchanges []Exchange `json:"exchanges"`
	Queues    []Queue    `json:"queues"`
	Bindings  []Binding  `json:"bindings"`
}

// Exchange is one durable exchange.
type Exchange struct {
	Name string     `json:"name"`
	Kind string     `json:"kind"` // direct, fanout, topic, headers, x-delayed-message
	Args amqp.Table `json:"args,omitempty"`
}

// Queue is one durable queue.
type Queue struct {
	Name string     `json:"name"`
	Args amqp.Table `json:"args,omitempty"`
	// Role is what the library keeps in the queue: "delay" (retries waiting out a
	// delay), "parking" (dead letters that found no work queue), "poison" (messages
	// that failed for good), "work" (an application queue the retries come back
	// to) or "behind" (the messages waiting behind a blocked order key). It is not declared; "" in a topology of the user's own.
	Role string `json:"role,omitempty"`
}

// Binding binds a queue (or, with ToExchange, an exchange) to an exchange.
type Binding struct {
	Exchange    string     `json:"exchange"`
	Destination string     `json:"destination"`
	Key         string     `json:"key"`
	Args        amqp.Table `json:"args,omitempty"`
	ToExchange  bool       `json:"to_exchange,omitempty"`
}

// Mode says what the library does with the topology it needs. The zero value is
// ModeDeclare.
//
// ModeVerify is for least-privilege deployments: a user with read and write but no
// configure permission on the vhost cannot declare queues or exchanges, not even ones
// that exist with the same arguments. An administrator creates the topology once
// (`amqpretry topology apply ...`), and the application runs in ModeVerify.
type Mode string

// Values of Mode.
const (
	// ModeDeclare declares every exchange, queue and binding, idempotently, and
	// declares a deleted one again when a hand-off finds it gone. Needs configure
	// permission on every name.
	ModeDeclare Mode = "declare"
	// ModeVerify declares no exchange or queue: it checks each passively (which needs
	// no configure permission) and fails, naming the object and the command that
	// creates it, when one is missing. Bindings cannot be read in AMQP 0-9-1, so it
	// asserts them (queue.bind needs read and write permission, not configure).
	ModeVerify Mode = "verify"
	// ModeNone declares and checks nothing: whatever is missing shows up as errors
	// when messages move (a returned publish, a parked retry).
	ModeNone Mode = "none"
)

var (
	// ErrMissing is wrapped when an exchange or queue that must exist does not, or a
	// binding cannot be made because one of its ends does not exist.
	ErrMissing = errors.New("not found")
	// ErrMismatch is wrapped when an exchange or queue exists with other arguments
	// than the ones asked for (AMQP 406 PRECONDITION_FAILED).
	ErrMismatch = errors.New("declared with different arguments")
)

// Verdict is the outcome of checking one declaration: the state of a Finding.
type Verdict string

// Values of Verdict.
const (
	// VerdictOK: the object exists (with the same arguments, when they were compared).
	VerdictOK Verdict = "ok"
	// VerdictMissing: the object does not exist (or, for a binding, one of its ends).
	VerdictMissing Verdict = "missing"
	// VerdictMismatch: the object exists with other arguments; Finding.Arg names the
	// one the broker complained about.
	VerdictMismatch Verdict = "mismatch"
	// VerdictUnchecked: the object exists but its arguments could not be compared (no
	// configure permission), or a binding was not asserted.
	VerdictUnchecked Verdict = "unchecked"
	// VerdictError: the check itself failed (for example access refused).
	VerdictError Verdict = "error"
)

// Finding is what a check found about one exchange, queue, binding or work queue.
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
	// Members and Online, for a quorum queue when the check could count them (ops
	// VerifyOptions.Counts): its members and those online. Fewer online than members
	// means a node is down or a member has not started.
	Members int `json:"members,omitempty"`
	Online  int `json:"members_online,omitempty"`
	// Fix is how to repair it, when the usual fix (apply) cannot: a work queue of
	// another type than delayed retries need, whose type cannot change.
	Fix string `json:"fix,omitempty"`
}
