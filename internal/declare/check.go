package declare

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/topology"
)

// CheckOptions configures Check.
type CheckOptions struct {
	// CompareArgs compares the arguments of each exchange and queue that exists: Check
	// redeclares it with the expected arguments on a throwaway channel, which changes
	// nothing when they are equal and is refused (406, naming the argument) when they
	// differ. That needs configure permission: where it is refused (403), the finding
	// is topology.VerdictUnchecked. It runs only after a passive declaration found the
	// object, so it never creates one (unless it is deleted in between).
	CompareArgs bool
	// Bind asserts each binding (idempotent; needs write permission on the destination
	// and read permission on the source). Without it bindings are
	// topology.VerdictUnchecked: AMQP 0-9-1 has no way to read them.
	Bind bool
	// Kind, if set, replaces the kind of the queue findings ("work queue").
	Kind string
}

// Check checks every declaration of t on conn and reports on each, opening a throwaway
// channel per check (a failed check closes its channel). It returns an error only when
// it cannot check at all; the problems are in the findings.
func Check(conn *amqp.Connection, t topology.Topology, opts CheckOptions) ([]topology.Finding, error) {
	var out []topology.Finding
	for _, e := range t.Exchanges {
		f, err := checkOne(conn, opts, topology.Finding{Kind: "exchange", Name: e.Name},
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
	kind := "queue"
	if opts.Kind != "" {
		kind = opts.Kind
	}
	for _, q := range t.Queues {
		f, err := checkOne(conn, opts, topology.Finding{Kind: kind, Name: q.Name},
			func(ch *amqp.Channel) error {
				_, err := ch.QueueDeclarePassive(q.Name, true, false, false, false, q.Args)
				return err
			},
			func(ch *amqp.Channel) error {
				_, err := ch.QueueDeclare(q.Name, true, false, false, false, q.Args)
				return err
			})
		if err != nil {
			return out, err
		}
		out = append(out, f)
	}
	for _, b := range t.Bindings {
		f := topology.Finding{Kind: "binding", Name: b.Destination, Source: b.Exchange, Key: b.Key}
		if !opts.Bind {
			f.Status = topology.VerdictUnchecked
			out = append(out, f)
			continue
		}
		err := withChannel(conn, func(ch *amqp.Channel) error {
			return topology.Topology{Bindings: []topology.Binding{b}}.Apply(ch, topology.ModeDeclare)
		})
		switch {
		case err == nil:
			f.Status = topology.VerdictOK
		case amqperr.IsCode(err, amqp.NotFound):
			f.Status, f.Detail = topology.VerdictMissing, amqperr.Reason(err)
		case isChannelErr(err):
			f.Status, f.Detail = topology.VerdictError, amqperr.Reason(err)
		default:
			return out, err
		}
		out = append(out, f)
	}
	return out, nil
}

// checkOne checks one exchange or queue: exists (passive), then the same arguments
// (active, when asked to and allowed).
func checkOne(conn *amqp.Connection, opts CheckOptions, f topology.Finding, passive, active func(*amqp.Channel) error) (topology.Finding, error) {
	err := withChannel(conn, passive)
	switch {
	case err == nil:
		f.Status = topology.VerdictOK
	case amqperr.IsCode(err, amqp.NotFound):
		f.Status, f.Detail = topology.VerdictMissing, amqperr.Reason(err)
		return f, nil
	case isChannelErr(err):
		f.Status, f.Detail = topology.VerdictError, amqperr.Reason(err)
		return f, nil
	default:
		return f, err
	}
	if !opts.CompareArgs {
		return f, nil
	}
	err = withChannel(conn, active)
	switch {
	case err == nil:
	case amqperr.IsCode(err, amqp.PreconditionFailed):
		f.Status, f.Detail = topology.VerdictMismatch, amqperr.Reason(err)
		if m := amqperr.InequivalentArg.FindStringSubmatch(amqperr.Reason(err)); m != nil {
			f.Arg = m[1]
		}
	case amqperr.IsCode(err, amqp.AccessRefused):
		f.Status, f.Detail = topology.VerdictUnchecked, amqperr.Reason(err)
	case isChannelErr(err):
		f.Status, f.Detail = topology.VerdictError, amqperr.Reason(err)
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
