package declare

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/topology"
)

// The outcomes of checking one declaration (ops.Verdict's values).
const (
	OK        = "ok"        // exists (with the same arguments, when compared)
	Missing   = "missing"   // does not exist (for a binding: one of its ends)
	Mismatch  = "mismatch"  // exists with other arguments; Outcome.Arg names one
	Unchecked = "unchecked" // exists, arguments not compared (no configure permission)
	Failed    = "error"     // the check itself failed (access refused, say)
)

// Outcome is what checking one exchange, queue or binding found: Status is one of the
// constants above, Arg the argument the broker named in a mismatch, Detail its reply.
type Outcome struct{ Status, Arg, Detail string }

// CheckExchange checks exchange e on conn: exists (passive), then, when compare is
// true, the same arguments (declared again with e's on a throwaway channel: a no-op
// when equal, a 406 naming the argument when not; it needs configure permission). It
// creates nothing that does not exist. An error means it could not check at all.
func CheckExchange(conn *amqp.Connection, e topology.Exchange, compare bool) (Outcome, error) {
	return checkOne(conn, compare,
		func(ch *amqp.Channel) error {
			return ch.ExchangeDeclarePassive(e.Name, e.Kind, true, false, false, false, e.Args)
		},
		func(ch *amqp.Channel) error {
			return ch.ExchangeDeclare(e.Name, e.Kind, true, false, false, false, e.Args)
		})
}

// CheckQueue is CheckExchange for queue q. A queue of another type than q gives is
// reported as a mismatch on x-queue-type, whatever else differs.
func CheckQueue(conn *amqp.Connection, q topology.Queue, compare bool) (Outcome, error) {
	return checkOne(conn, compare,
		func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclarePassive(q.Name, true, false, false, false, q.Args)
			return err
		},
		func(ch *amqp.Channel) error {
			if err := typeDiffers(conn, q); err != nil {
				return err
			}
			_, err := ch.QueueDeclare(q.Name, true, false, false, false, q.Args)
			return err
		})
}

// CheckBinding asserts binding b (idempotent: it needs write permission on its
// destination and read on its exchange): Missing when one of its ends does not exist.
func CheckBinding(conn *amqp.Connection, b topology.Binding) (Outcome, error) {
	return checkOne(conn, false, func(ch *amqp.Channel) error {
		if b.ToExchange {
			return ch.ExchangeBind(b.Destination, b.Key, b.Exchange, false, b.Args)
		}
		return ch.QueueBind(b.Destination, b.Key, b.Exchange, false, b.Args)
	}, nil)
}

// typeDiffers returns the broker's refusal when the existing queue q is of another type
// than q gives, nil otherwise. The broker names only the first argument that differs,
// and a queue of the wrong type differs in more than its type: the type is asked alone
// first, on a channel of its own (a refusal closes it).
func typeDiffers(conn *amqp.Connection, q topology.Queue) error {
	t, ok := q.Args[QueueTypeArg]
	if !ok || len(q.Args) == 1 {
		return nil
	}
	err := withChannel(conn, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(q.Name, true, false, false, false, amqp.Table{QueueTypeArg: t})
		return err
	})
	if err == nil {
		return nil
	}
	if m := amqperr.InequivalentArg.FindStringSubmatch(amqperr.Reason(err)); m != nil && m[1] == QueueTypeArg {
		return err
	}
	return nil
}

// checkOne checks one exchange or queue: exists (passive), then the same arguments
// (active, when compare is true and the broker allows it). For a binding, passive is
// the assertion itself. Each runs on a throwaway channel, which a failed check closes;
// conn survives them all.
func checkOne(conn *amqp.Connection, compare bool, passive, active func(*amqp.Channel) error) (Outcome, error) {
	var o Outcome
	err := withChannel(conn, passive)
	switch {
	case err == nil:
		o.Status = OK
	case amqperr.IsCode(err, amqp.NotFound):
		return Outcome{Status: Missing, Detail: amqperr.Reason(err)}, nil
	case isChannelErr(err):
		return Outcome{Status: Failed, Detail: amqperr.Reason(err)}, nil
	default:
		return o, err
	}
	if !compare {
		return o, nil
	}
	err = withChannel(conn, active)
	switch {
	case err == nil:
	case amqperr.IsCode(err, amqp.PreconditionFailed):
		o.Status, o.Detail = Mismatch, amqperr.Reason(err)
		if m := amqperr.InequivalentArg.FindStringSubmatch(amqperr.Reason(err)); m != nil {
			o.Arg = m[1]
		}
	case amqperr.IsCode(err, amqp.AccessRefused):
		o.Status, o.Detail = Unchecked, amqperr.Reason(err)
	case isChannelErr(err):
		o.Status, o.Detail = Failed, amqperr.Reason(err)
	default:
		return o, err
	}
	return o, nil
}

// withChannel runs fn on a new channel of conn and closes it. An error opening the
// channel is returned as is (it is not an *amqp.Error channel exception).
func withChannel(conn *amqp.Connection, fn func(*amqp.Channel) error) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open check channel: %w", err)
	}
	err = fn(ch)
	_ = ch.Close() // already closed by the broker after a failed check
	return err
}

// isChannelErr tells whether err is a channel exception of the broker (the connection
// survives it).
func isChannelErr(err error) bool {
	var amqpErr *amqp.Error
	return errors.As(err, &amqpErr) && amqpErr.Server && amqpErr.Code >= 400 && amqpErr.Code < 500
}
