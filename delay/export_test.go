package delay

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/backend"
)

// Spec is a backend by name with flat settings, for the tests' tables: the value Parse
// gives for Name with the settings it has among these.
type Spec struct {
	Name       string
	Prefix     string
	Tiers      []time.Duration
	Levels     int
	RetryDelay time.Duration
	Memory     message.Publisher
}

func (s Spec) open(env backend.Env) (backend.Backend, error) {
	v, err := Parse(s.Name, Settings{Tiers: s.Tiers, Levels: s.Levels, Delay: s.RetryDelay, Publisher: s.Memory})
	if err != nil {
		return nil, err
	}
	return backend.Open(v, backend.Setup{Prefix: s.Prefix, Env: env})
}

// nopHandoff is a hand-off that is never reached: any call panics.
type nopHandoff struct{ backend.Handoff }

// New opens the backend s names, parking through env.
func New(s Spec, env backend.Env) (backend.Backend, error) { return s.open(env) }

// Lookup opens the backend s names, for planning and sizing.
func Lookup(s Spec) (backend.Backend, error) { return s.open(backend.Env{}) }
