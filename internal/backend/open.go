package backend

import (
	"errors"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// Opener is what every delay.Backend value is underneath (package delay's unexported
// types, which alone implement it: delay.Backend is sealed). The middleware, the
// Config and ops open a configured backend by asserting it to Opener (Open below),
// never by asking its type.
type Opener interface {
	// Name is the backend's name, as delay.Parse takes it.
	Name() string
	// Open validates the settings (errors name the argument at fault) and opens the
	// backend under s.Prefix, parking through s.Env. Use the function Open, which also
	// checks the prefix and the names.
	Open(s Setup) (Backend, error)
	// Backends lists every backend of package delay, each with its default settings,
	// the default first: what ops looks for under a prefix, whatever was configured.
	Backends() []Opener
}

// Fronted is implemented by a backend value that has RabbitMQ 4.3 hold the first n
// retries in the work queue (held, a backend that keeps the delivery) before then takes
// the next ones (delay.HeldRetries). Its own Open validates its arguments and opens
// then.
type Fronted interface {
	Front() (n int, held, then Opener)
}

// Open validates value's settings and s.Prefix and opens value, a delay.Backend,
// parking through s.Env (without a hand-off it only plans and sizes). Errors name the
// configuration field at fault.
func Open(value any, s Setup) (Backend, error) {
	if value == nil {
		return nil, errors.New("Backend: nil; leave it nil in amqpretry.Config for the default, or use delay.Parse")
	}
	o, ok := value.(Opener)
	if !ok {
		return nil, fmt.Errorf("Backend: %v is not one of package delay's backends", value)
	}
	if s.Env.Logger == nil {
		s.Env.Logger = watermill.NopLogger{}
	}
	if strings.ContainsAny(s.Prefix, "*# ") {
		return nil, fmt.Errorf("Prefix: %q must not contain '*', '#' or spaces", s.Prefix)
	}
	opened, err := o.Open(s)
	if err != nil {
		return nil, err
	}
	for _, name := range allNames(opened.Topology()) {
		if len(name) > names.MaxBytes {
			return nil, fmt.Errorf("Prefix: makes the name %q %d bytes long, over AMQP's %d", name, len(name), names.MaxBytes)
		}
	}
	return opened, nil
}

func allNames(t topology.Topology) []string {
	var out []string
	for _, e := range t.Exchanges {
		out = append(out, e.Name)
	}
	for _, q := range t.Queues {
		out = append(out, q.Name)
	}
	return out
}

// Prepare readies b on the broker at start-up, as mode says: it refuses a backend the
// broker's version cannot run (VersionGate), then declares (or, in topology.ModeVerify,
// checks) b's publishing side, through b's own Prepare if it has one (Preparer). A
// backend that keeps retries in this process needs nothing there.
func Prepare(b Backend, h Handoff, mode topology.Mode) error {
	if _, ok := b.(InProcess); ok {
		return nil
	}
	if g, ok := b.(VersionGate); ok {
		if err := g.CheckVersion(h.Version()); err != nil {
			return err
		}
	}
	if p, ok := b.(Preparer); ok {
		return p.Prepare(h, mode)
	}
	return Ensure(b, h, mode)
}

// Ensure declares (or checks) b's publishing side, as mode says.
func Ensure(b Backend, h Handoff, mode topology.Mode) error {
	if err := h.Ensure(mode, b.Topology()); err != nil {
		return fmt.Errorf("%s topology (mode %s): %w", b.Name(), mode, err)
	}
	return nil
}

// All lists every backend of package delay, each with its defaults, the default first,
// from value, any of them (a configured delay.Backend): what ops looks for under a
// prefix, whatever was configured before. Empty for a value that is none of them.
func All(value any) []Opener {
	if o, ok := value.(Opener); ok {
		return o.Backends()
	}
	return nil
}
