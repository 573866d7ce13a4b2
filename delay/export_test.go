package delay

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/backend"
)

// Spec is a backend by name with flat settings, for the tests' tables: the value Parse
// gives for Name, opened with the settings as the Config's deprecated fields.
type Spec struct {
	Name       string
	Prefix     string
	Tiers      []time.Duration
	Levels     int
	RetryDelay time.Duration
	Memory     message.Publisher
}

func (s Spec) open(env backend.Env) (backend.Backend, error) {
	v, err := Parse(s.Name)
	if err != nil {
		return nil, err
	}
	return Open(v, backend.Setup{Prefix: s.Prefix, Env: env, Legacy: backend.Legacy{Tiers: s.Tiers, Levels: s.Levels, RetryDelay: s.RetryDelay, Memory: s.Memory}})
}

// New opens the backend s names, parking through env.
func New(s Spec, env backend.Env) (backend.Backend, error) { return s.open(env) }

// Lookup opens the backend s names, for planning and sizing.
func Lookup(s Spec) (backend.Backend, error) { return s.open(backend.Env{}) }
