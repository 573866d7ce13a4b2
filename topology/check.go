package topology

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
)

// Check checks every declaration of t on conn, one by one, and reports on each
// (Finding), where Apply in ModeVerify stops at the first problem. It declares
// nothing that does not exist. Each check runs on a throwaway channel of conn, which a
// failed check closes; conn survives them all. Check returns an error only when it
// cannot check at all (conn is closed, say): the problems are in the findings.
//
//   - An exchange or queue is declared passively: VerdictMissing when it does not
//     exist. Then its arguments are compared by declaring it again with t's: that
//     changes nothing when they are equal, and is refused (VerdictMismatch, naming the
//     argument) when they differ. Comparing needs configure permission: without it the
//     finding is VerdictUnchecked.
//   - A queue whose Role is "work" is reported as a "work queue". One that t gives no
//     arguments is the application's: it is checked to exist only.
//   - A binding is asserted (idempotent) when bind is true, which needs write
//     permission on its destination and read permission on its exchange. Otherwise it
//     is VerdictUnchecked: AMQP 0-9-1 has no way to read bindings.
func (t Topology) Check(conn *amqp.Connection, bind bool) ([]Finding, error) {
	var out []Finding
	for _, e := range t.Exchanges {
		f, err := checkOne(conn, true, Finding{Kind: "exchange", Name: e.Name},
			func(ch *amqp.Channel) error {
				return ch.ExchangeDeclarePassive(e.Name, e.Kind, true, false, false, false, e.Args)
			},
			func(ch *amqp.Channel) error {
				return ch.ExchangeDeclare(e.Name, e.Kind, true, false, false, false, e.Args)
			})
		if err != nil {
			return out, err
		}
		out = append(out, f)
	}
	for _, q := range t.Queues {
		kind, compare := "queue", true
		if q.Role == "work" {
			kind, compare = "work queue", q.Args != nil
		}
		f, err := checkOne(conn, compare, Finding{Kind: kind, Name: q.Name},
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
		if err != nil {
			return out, err
		}
		out = append(out, f)
	}
	for _, b := range t.Bindings {
		f := Finding{Kind: "binding", Name: b.Destination, Source: b.Exchange, Key: b.Key}
		if !bind {
			f.Status = VerdictUnchecked
			out = append(out, f)
			continue
		}
		f, err := checkOne(conn, false, f, b.bind, nil)
		if err != nil {
			return out, err
		}
		out = append(out, f)
	}
	return out, nil
}

// queueTypeArg is the queue argument naming its type (internal/declare's QueueTypeArg,
// which imports this package).
const queueTypeArg = "x-queue-type"

// typeDiffers returns the broker's refusal when the existing queue q is of another type
// than q gives, nil otherwise. The broker names only the first argument that differs,
// and a queue of the wrong type differs in more than its type: the type is asked alone
// first, on a channel of its own (a refusal closes it).
func typeDiffers(conn *amqp.Connection, q Queue) error {
	t, ok := q.Args[queueTypeArg]
	if !ok || len(q.Args) == 1 {
		return nil
	}
	err := withChannel(conn, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(q.Name, true, false, false, false, amqp.Table{queueTypeArg: t})
		return err
	})
	if err == nil {
		return nil
	}
	if m := amqperr.InequivalentArg.FindStringSubmatch(amqperr.Reason(err)); m != nil && m[1] == queueTypeArg {
		return err
	}
	return nil
}

// checkOne checks one exchange or queue: exists (passive), then the same arguments
// (active, when compare is true and the broker allows it). For a binding, passive is
// the assertion itself.
func checkOne(conn *amqp.Connection, compare bool, f Finding, passive, active func(*amqp.Channel) error) (Finding, error) {
	err := withChannel(conn, passive)
	switch {
	case err == nil:
		f.Status = VerdictOK
	case amqperr.IsCode(err, amqp.NotFound):
		f.Status, f.Detail = VerdictMissing, amqperr.Reason(err)
		return f, nil
	case isChannelErr(err):
		f.Status, f.Detail = VerdictError, amqperr.Reason(err)
		return f, nil
	default:
		return f, err
	}
	if !compare {
		return f, nil
	}
	err = withChannel(conn, active)
	switch {
	case err == nil:
	case amqperr.IsCode(err, amqp.PreconditionFailed):
		f.Status, f.Detail = VerdictMismatch, amqperr.Reason(err)
		if m := amqperr.InequivalentArg.FindStringSubmatch(amqperr.Reason(err)); m != nil {
			f.Arg = m[1]
		}
	case amqperr.IsCode(err, amqp.AccessRefused):
		f.Status, f.Detail = VerdictUnchecked, amqperr.Reason(err)
	case isChannelErr(err):
		f.Status, f.Detail = VerdictError, amqperr.Reason(err)
	default:
		return f, err
	}
	return f, nil
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
