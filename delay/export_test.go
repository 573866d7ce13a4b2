package delay

import (
	"slices"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/names"
)

// AddBackend adds a line to the table of backends for the test: a backend defined in a
// test is wired as any other. The returned func removes it.
func AddBackend(name Backend, open func(s backend.Spec, env backend.Env, n names.Names) (backend.Backend, error)) (remove func()) {
	backends = append(backends, entry{name: name, open: open})
	return func() {
		backends = slices.DeleteFunc(backends, func(e entry) bool { return e.name == name })
	}
}
