package delay

import (
	"cmp"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
)

// Capabilities is what the capability check found out about the broker.
type Capabilities struct {
	// Version is the broker's version from its server properties ("3.13.7"), or "" if
	// it sent none.
	Version string
	// DelayedMessagePlugin tells whether the rabbitmq_delayed_message_exchange plugin
	// is enabled.
	DelayedMessagePlugin bool
}

// pluginName is the delayed-message plugin, as rabbitmq-plugins names it.
const pluginName = "rabbitmq_delayed_message_exchange"

// probeExchange exists in every vhost, as a direct exchange, and cannot be deleted.
const probeExchange = "amq.direct"

// Probe reads the broker's version from the hand-off connection's server properties
// and tests whether the delayed-message plugin is enabled. The test redeclares the
// built-in exchange amq.direct with type x-delayed-message, on a short-lived connection
// of its own: a broker with the plugin knows the type and refuses the redeclaration
// (406 "inequivalent arg 'type'", a channel error); one without refuses the unknown
// type, with a connection error on 3.x (503 COMMAND_INVALID, which would have closed
// the hand-off connection) and a channel error on 4.x (406 "unknown exchange type"). Either way
// nothing is declared. The broker checks the type before permissions, so the answer is
// clear even for a user who may not configure amq.direct, except with the plugin
// enabled (403): an error means Probe could not tell. Version is set all the same.
func Probe(h *Handoff) (Capabilities, error) {
	conn, err := h.Connection()
	if err != nil {
		return Capabilities{}, err
	}
	var c Capabilities
	c.Version, _ = conn.Properties["version"].(string)
	c.DelayedMessagePlugin, err = probePlugin(h)
	return c, err
}

func probePlugin(h *Handoff) (bool, error) {
	conn, err := h.dial()
	if err != nil {
		return false, err
	}
	defer conn.Close() //nolint:errcheck // the 503 has closed it already
	ch, err := conn.Channel()
	if err != nil {
		return false, fmt.Errorf("open probe channel: %w", err)
	}
	err = ch.ExchangeDeclare(probeExchange, topology.ExchangeDelayedMessage, true, false, false, false,
		amqp.Table{topology.DelayedTypeArg: amqp.ExchangeDirect})
	var amqpErr *amqp.Error
	switch {
	case pluginMissing(err):
		return false, nil
	case err == nil, errors.As(err, &amqpErr) && amqpErr.Code == amqp.PreconditionFailed:
		return true, nil
	}
	return false, fmt.Errorf("probe for the %s plugin on exchange %q: %w", pluginName, probeExchange, err)
}

// pluginMissing tells whether err is the broker refusing exchange type
// x-delayed-message as unknown: 503 COMMAND_INVALID on RabbitMQ 3.x, 406
// PRECONDITION_FAILED on 4.x. A real clash with an existing exchange is a 406 too, but
// reads "inequivalent arg 'type'".
func pluginMissing(err error) bool {
	var amqpErr *amqp.Error
	return errors.As(err, &amqpErr) &&
		(amqpErr.Code == amqp.CommandInvalid || amqpErr.Code == amqp.PreconditionFailed) &&
		strings.Contains(amqpErr.Reason, "unknown exchange type '"+topology.ExchangeDelayedMessage+"'")
}

// checkBroker is the capability check New runs for a RabbitMQ backend: it logs the
// broker's version, whether the plugin is enabled and the backend chosen, warns about a
// version that loses retries, and returns what Probe found (an error if it could not
// tell about the plugin).
func checkBroker(cfg Config) (Capabilities, error) {
	probe := Probe
	if cfg.Topology.OrDefault() != topology.ModeDeclare {
		probe = func(*Handoff) (Capabilities, error) { return checkBrokerPassive(cfg) }
	}
	c, err := probe(cfg.Handoff)
	plugin := "not enabled"
	switch {
	case err != nil:
		plugin = "unknown: " + err.Error()
	case c.DelayedMessagePlugin:
		plugin = "enabled"
	}
	fields := watermill.LogFields{
		"delay_backend":          cfg.Backend,
		"delay_prefix":           cfg.Prefix,
		"rabbitmq_version":       c.Version,
		"delayed_message_plugin": plugin,
	}
	if w := versionWarning(c.Version); w != "" {
		cfg.Logger.Error("RabbitMQ version loses retries", errors.New(w), fields)
	}
	cfg.Logger.Info("Delay backend chosen", fields)
	return c, err
}

// version is the leading major.minor.patch of a RabbitMQ version.
type version struct{ major, minor, patch int }

var versionPattern = regexp.MustCompile(`^(\d+)\.(\d+)(?:\.(\d+))?`)

// parseVersion reads "3.13.7", "4.0.0-rc.1" or "4.0.0+2" (the suffix is ignored, a
// missing patch is 0).
func parseVersion(s string) (version, bool) {
	m := versionPattern.FindStringSubmatch(s)
	if m == nil {
		return version{}, false
	}
	n := func(s string) int { i, _ := strconv.Atoi(s); return i }
	return version{n(m[1]), n(m[2]), n(m[3])}, true
}

func (v version) compare(major, minor, patch int) int {
	return cmp.Or(cmp.Compare(v.major, major), cmp.Compare(v.minor, minor), cmp.Compare(v.patch, patch))
}

// versionWarning warns about RabbitMQ 3.13.0 to 3.13.2, whose dead-letter cycle
// detection can drop a message that was rejected on the way (rabbitmq-server #11159,
// fixed in 3.13.3): a retry that went through the delay queues may be lost.
func versionWarning(s string) string {
	v, ok := parseVersion(s)
	if !ok || v.compare(3, 13, 0) < 0 || v.compare(3, 13, 2) > 0 {
		return ""
	}
	return fmt.Sprintf("RabbitMQ %s: dead-letter cycle detection can drop dead-lettered messages, retries among them (rabbitmq-server #11159); upgrade to 3.13.3 or later", s)
}
