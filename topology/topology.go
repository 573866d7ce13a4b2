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
