package topology

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Verify checks t on ch without declaring any exchange or queue: each one is declared
// passively, which needs no configure permission and fails (404, wrapped in
// ErrMissing) when it does not exist. A passive declaration does not compare arguments;
// Check does, where it may. Bindings cannot be checked in AMQP 0-9-1, so Verify asserts
// them: queue.bind and exchange.bind are idempotent and need only write permission on
// the destination and read permission on the source. A binding whose exchange or queue
// is missing fails with ErrMissing. Verify stops at the first problem, which has closed
// ch.
func Verify(ch *amqp.Channel, t Topology) error {
	for _, e := range t.Exchanges {
		if err := ch.ExchangeDeclarePassive(e.Name, e.Kind, true, false, false, false, e.Args); err != nil {
			return checkError("exchange", e.Name, err)
		}
	}
	for _, q := range t.Queues {
		if _, err := ch.QueueDeclarePassive(q.Name, true, false, false, false, q.Args); err != nil {
			return checkError("queue", q.Name, err)
		}
	}
	for _, b := range t.Bindings {
		if err := bind(ch, b); err != nil {
			return bindError(b, err)
		}
	}
	return nil
}

func bind(ch *amqp.Channel, b Binding) error {
	if b.ToExchange {
		return ch.ExchangeBind(b.Destination, b.Key, b.Exchange, false, b.Args)
	}
	return ch.QueueBind(b.Destination, b.Key, b.Exchange, false, b.Args)
}

// checkError names the object; a 404 wraps ErrMissing.
func checkError(kind, name string, err error) error {
	if isCode(err, amqp.NotFound) {
		return fmt.Errorf("%s %q: %w: %w", kind, name, ErrMissing, err)
	}
	return fmt.Errorf("check %s %q: %w", kind, name, err)
}

func bindError(b Binding, err error) error {
	if isCode(err, amqp.NotFound) {
		return fmt.Errorf("binding of %q to exchange %q with key %q: %w (its exchange or queue does not exist): %w", b.Destination, b.Exchange, b.Key, ErrMissing, err)
	}
	return fmt.Errorf("bind %q to exchange %q with key %q: %w", b.Destination, b.Exchange, b.Key, err)
}

func isCode(err error, code int) bool {
	var amqpErr *amqp.Error
	return errors.As(err, &amqpErr) && amqpErr.Code == code
}

// Status is the outcome of checking one declaration.
type Status string

// Values of Status.
const (
	// StatusOK: the object exists (with the same arguments, when they were compared).
	StatusOK Status = "ok"
	// StatusMissing: the object does not exist (or, for a binding, one of its ends).
	StatusMissing Status = "missing"
	// StatusMismatch: the object exists with other arguments; Finding.Arg names the one
	// the broker complained about.
	StatusMismatch Status = "mismatch"
	// StatusUnchecked: the object could not be checked (a binding when CheckOptions.Bind
	// is false); Finding.Detail says why.
	StatusUnchecked Status = "unchecked"
	// StatusError: the check itself failed (for example access refused).
	StatusError Status = "error"
)

// Finding is what Check found out about one exchange, queue or binding.
type Finding struct {
	// Kind is "exchange", "queue" or "binding".
	Kind string `json:"kind"`
	// Name is the exchange or queue; for a binding, its destination.
	Name string `json:"name"`
	// Source and Key describe a binding: the exchange it binds to and its routing key.
	Source string `json:"source,omitempty"`
	Key    string `json:"key,omitempty"`
	// Status is the outcome.
	Status Status `json:"status"`
	// ArgsCompared tells whether the arguments were compared (an exchange or queue that
	// exists, checked with CheckOptions.CompareArgs and configure permission).
	ArgsCompared bool `json:"args_compared,omitempty"`
	// Arg is the argument that differs, for StatusMismatch, as the broker names it
	// ("x-message-ttl", "type", "durable").
	Arg string `json:"arg,omitempty"`
	// Detail is the broker's reason, or a note.
	Detail string `json:"detail,omitempty"`
}

// Problem tells whether the finding should fail a verification.
func (f Finding) Problem() bool {
	return f.Status == StatusMissing || f.Status == StatusMismatch || f.Status == StatusError
}

// String describes the finding in one line.
func (f Finding) String() string {
	what := fmt.Sprintf("%s %q", f.Kind, f.Name)
	if f.Kind == "binding" {
		what = fmt.Sprintf("binding of %q to exchange %q with key %q", f.Name, f.Source, f.Key)
	}
	s := what + ": " + string(f.Status)
	if f.Arg != "" {
		s += ", argument " + f.Arg + " differs"
	}
	if f.Detail != "" {
		s += " (" + f.Detail + ")"
	}
	return s
}

// Report is the outcome of Check: one finding per declaration, in the order of the
// Topology.
type Report struct {
	// Findings, one per declaration.
	Findings []Finding `json:"findings"`
}

// Problems returns the findings that fail the verification.
func (r Report) Problems() []Finding {
	var out []Finding
	for _, f := range r.Findings {
		if f.Problem() {
			out = append(out, f)
		}
	}
	return out
}

// Err returns nil when no finding is a problem, else an error naming each problem, which
// wraps ErrMissing and ErrMismatch where they apply.
func (r Report) Err() error {
	var errs []error
	for _, f := range r.Problems() {
		switch f.Status {
		case StatusMissing:
			errs = append(errs, fmt.Errorf("%s: %w", f, ErrMissing))
		case StatusMismatch:
			errs = append(errs, fmt.Errorf("%s: %w", f, ErrMismatch))
		default:
			errs = append(errs, errors.New(f.String()))
		}
	}
	return errors.Join(errs...)
}

// CheckOptions configures Check.
type CheckOptions struct {
	// CompareArgs compares the arguments of each exchange and queue that exists: Check
	// redeclares it with the expected arguments on a throwaway channel, which changes
	// nothing when they are equal and is refused (406, naming the argument) when they
	// differ. That needs configure permission: where it is refused (403), the finding
	// says the arguments were not compared. It runs only after a passive declaration
	// found the object, so it never creates one (unless it is deleted in between).
	CompareArgs bool
	// Bind asserts each binding (idempotent; needs write permission on the destination
	// and read permission on the source). Without it bindings are reported as
	// StatusUnchecked: AMQP 0-9-1 has no way to read them.
	Bind bool
}

// Check checks every declaration of t on conn and reports on each, opening a throwaway
// channel per check (a failed check closes its channel). It returns an error only when
// it cannot open a channel; the problems are in the Report (see Report.Err).
func Check(conn *amqp.Connection, t Topology, opts CheckOptions) (Report, error) {
	var r Report
	for _, e := range t.Exchanges {
		f, err := checkOne(conn, opts, "exchange", e.Name,
			func(ch *amqp.Channel) error {
				return ch.ExchangeDeclarePassive(e.Name, e.Kind, true, false, false, false, e.Args)
			},
			func(ch *amqp.Channel) error {
				return ch.ExchangeDeclare(e.Name, e.Kind, true, false, false, false, e.Args)
			})
		if err != nil {
			return r, err
		}
		r.Findings = append(r.Findings, f)
	}
	for _, q := range t.Queues {
		f, err := checkOne(conn, opts, "queue", q.Name,
			func(ch *amqp.Channel) error {
				_, err := ch.QueueDeclarePassive(q.Name, true, false, false, false, q.Args)
				return err
			},
			func(ch *amqp.Channel) error {
				_, err := ch.QueueDeclare(q.Name, true, false, false, false, q.Args)
				return err
			})
		if err != nil {
			return r, err
		}
		r.Findings = append(r.Findings, f)
	}
	for _, b := range t.Bindings {
		f := Finding{Kind: "binding", Name: b.Destination, Source: b.Exchange, Key: b.Key}
		if !opts.Bind {
			f.Status, f.Detail = StatusUnchecked, "AMQP 0-9-1 cannot read bindings; assert them with Bind"
			r.Findings = append(r.Findings, f)
			continue
		}
		err := withChannel(conn, func(ch *amqp.Channel) error { return bind(ch, b) })
		switch {
		case err == nil:
			f.Status = StatusOK
		case isCode(err, amqp.NotFound):
			f.Status, f.Detail = StatusMissing, reason(err)
		case isChannelErr(err):
			f.Status, f.Detail = StatusError, reason(err)
		default:
			return r, err
		}
		r.Findings = append(r.Findings, f)
	}
	return r, nil
}

// checkOne checks one exchange or queue: exists (passive), then the same arguments
// (active, when asked to and allowed).
func checkOne(conn *amqp.Connection, opts CheckOptions, kind, name string, passive, active func(*amqp.Channel) error) (Finding, error) {
	f := Finding{Kind: kind, Name: name}
	err := withChannel(conn, passive)
	switch {
	case err == nil:
		f.Status = StatusOK
	case isCode(err, amqp.NotFound):
		f.Status, f.Detail = StatusMissing, reason(err)
		return f, nil
	case isChannelErr(err):
		f.Status, f.Detail = StatusError, reason(err)
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
		f.ArgsCompared = true
	case isCode(err, amqp.PreconditionFailed):
		f.ArgsCompared, f.Status, f.Detail = true, StatusMismatch, reason(err)
		if m := inequivalentArg.FindStringSubmatch(reason(err)); m != nil {
			f.Arg = m[1]
		}
	case isCode(err, amqp.AccessRefused):
		f.Detail = "exists; arguments not compared: no configure permission"
	case isChannelErr(err):
		f.Status, f.Detail = StatusError, reason(err)
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

func reason(err error) string {
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) {
		return amqpErr.Reason
	}
	return err.Error()
}
