package topology

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Mode says what the library does with the topology it needs: declare it, only check
// it, or leave it alone. The zero value is ModeDeclare.
//
// ModeVerify is for least-privilege deployments: a user with read and write but no
// configure permission on the vhost cannot declare queues or exchanges, not even ones
// that exist with the same arguments. An administrator creates the topology once
// (`amqpretry topology apply ...`), and the application runs in ModeVerify.
type Mode string

// Values of Mode.
const (
	// ModeDeclare declares every exchange, queue and binding, idempotently (default).
	// Needs configure permission on every name.
	ModeDeclare Mode = "declare"
	// ModeVerify declares nothing: it checks every exchange and queue passively (a
	// passive declare, which needs no configure permission) and fails, naming the
	// object, when one is missing. Bindings cannot be checked in AMQP 0-9-1, so
	// ModeVerify asserts them instead (queue.bind and exchange.bind are idempotent and
	// need write permission on the destination and read permission on the source, not
	// configure).
	ModeVerify Mode = "verify"
	// ModeNone declares and checks nothing: whatever is missing shows up as errors
	// when messages move (a returned publish, a parked retry).
	ModeNone Mode = "none"
)

// Modes lists the values Mode accepts (besides "", which means ModeDeclare).
func Modes() []Mode { return []Mode{ModeDeclare, ModeVerify, ModeNone} }

// OrDefault returns m, or ModeDeclare for the zero value.
func (m Mode) OrDefault() Mode {
	if m == "" {
		return ModeDeclare
	}
	return m
}

// Validate returns an error for a value other than "", "declare", "verify" and "none".
func (m Mode) Validate() error {
	switch m {
	case "", ModeDeclare, ModeVerify, ModeNone:
		return nil
	}
	return fmt.Errorf("unknown topology mode %q (known: %s, %s, %s)", string(m), ModeDeclare, ModeVerify, ModeNone)
}

// ParseMode reads a Mode from its name ("" gives ModeDeclare).
func ParseMode(s string) (Mode, error) {
	m := Mode(s)
	if err := m.Validate(); err != nil {
		return "", err
	}
	return m.OrDefault(), nil
}

// ErrMissing is returned (wrapped) when a queue or exchange that ModeVerify checks does
// not exist, or a binding cannot be made because one of its ends does not exist.
var ErrMissing = errors.New("not found")

// Ensure applies t on ch as mode says: ModeDeclare declares it (Declare), ModeVerify
// checks it (Verify), ModeNone does nothing. A failed declaration or check closes ch.
//
// The caller that knows how t is created should wrap an ErrMissing error with the
// command that creates it, for example `amqpretry topology apply --prefix ...`.
func Ensure(ch *amqp.Channel, mode Mode, t Topology) error {
	switch mode.OrDefault() {
	case ModeDeclare:
		return Declare(ch, t)
	case ModeVerify:
		return Verify(ch, t)
	case ModeNone:
		return nil
	}
	return mode.Validate()
}
