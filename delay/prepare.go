package delay

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/topology"
)

// Prepare refuses a prefix that has a ladder of other Levels, then declares (or
// checks) the ladder.
func (b *binaryLevels) Prepare(h backend.Handoff, mode topology.Mode) error {
	if mode != topology.ModeNone {
		if err := b.checkLadder(h); err != nil {
			return err
		}
	}
	return backend.Ensure(b, h, mode)
}

// checkLadder refuses a prefix that has a binary-levels ladder of another number of
// levels. The level exchanges keep the bindings of every ladder declared on them, and
// those depend on Levels: a retry waiting in the old ladder, or parked in the new one,
// would also match the other's bindings, and be duplicated, a copy coming back late. A larger ladder leaves queue <prefix>.level.<Levels>; a smaller one has
// level 0's queue but not the top level's exchange (every exchange is declared before
// any queue).
func (b *binaryLevels) checkLadder(h backend.Handoff) error {
	conn, err := h.Connection()
	if err != nil {
		return err
	}
	exists := func(check func(ch *amqp.Channel) error) (bool, error) {
		ch, err := conn.Channel()
		if err != nil {
			return false, fmt.Errorf("open topology channel: %w", err)
		}
		defer ch.Close() //nolint:errcheck // a failed check has closed it already
		switch err := check(ch); {
		case err == nil:
			return true, nil
		case amqperr.IsCode(err, amqp.NotFound):
			return false, nil
		default:
			return false, err
		}
	}
	queue := func(name string) func(*amqp.Channel) error {
		return func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
			return err
		}
	}
	const fix = "the level exchanges' bindings depend on Levels, and sharing them would duplicate retries and bring copies back late: keep Levels, or change Prefix with it (the old ladder keeps delivering its retries until it is empty; remove it then)"
	above := b.names.Level(b.levels)
	if ok, err := exists(queue(above)); err != nil {
		return fmt.Errorf("%s: check queue %q: %w", binaryLevelsValue{}, above, err)
	} else if ok {
		return fmt.Errorf("Levels: %d, but queue %q exists: prefix %q has a binary-levels ladder of more levels: %w: %s", b.levels, above, b.names.Prefix, topology.ErrMismatch, fix)
	}
	bottom, top := b.names.Level(0), b.names.Level(b.levels-1)
	ok, err := exists(queue(bottom))
	if err != nil {
		return fmt.Errorf("%s: check queue %q: %w", binaryLevelsValue{}, bottom, err)
	}
	if !ok {
		return nil
	}
	ok, err = exists(func(ch *amqp.Channel) error {
		return ch.ExchangeDeclarePassive(top, amqp.ExchangeTopic, true, false, false, false, nil)
	})
	if err != nil {
		return fmt.Errorf("%s: check exchange %q: %w", binaryLevelsValue{}, top, err)
	}
	if !ok {
		return fmt.Errorf("Levels: %d, but queue %q exists without exchange %q: prefix %q has a binary-levels ladder of fewer levels: %w: %s", b.levels, bottom, top, b.names.Prefix, topology.ErrMismatch, fix)
	}
	return nil
}

// unsupportedError is the start-up error of a backend that holds retries (name) on
// a broker older than 4.3. It names no fix: that depends on the field that asked for
// the backend (Backend, or HeldRetries), which the middleware names.
func unsupportedError(name, brokerVersion string) error {
	if brokerVersion == "" {
		brokerVersion = "of unknown version"
	}
	why := "it would ignore the work queue's x-delayed-retry-* arguments and redeliver every nacked message at once, a hot loop"
	if name == (deliveryTimeValue{}).Name() {
		why = "it does not hold a delivery settled with x-opt-delivery-time"
	}
	return fmt.Errorf("%s is %w by this broker: retries held in the work queue need RabbitMQ 4.3 or later, and the broker is %s: %s (the copying backends, %s and %s, run on any broker)",
		name, ErrUnsupported, brokerVersion, why, ttlTiersValue{}, binaryLevelsValue{})
}

// needs43 refuses, for a backend that holds retries (name), a broker older than 4.3.
func needs43(name, brokerVersion string) error {
	if version.DelayedRetry(brokerVersion) {
		return nil
	}
	return unsupportedError(name, brokerVersion)
}
