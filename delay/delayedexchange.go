package delay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/topology"
)

// delayedExchange hands each message to the rabbitmq_delayed_message_exchange plugin:
// one exchange of type x-delayed-message keeps the message for its x-delay header
// (milliseconds), then routes it as a direct exchange by its routing key, the name of
// the queue that failed, which is bound there under its own name.
//
//	<prefix>.delayed   x-delayed-message exchange (x-delayed-type direct)
//
// A delay rounds UP to whole milliseconds, at least 1 ms (the plugin delivers an
// x-delay of 0 or less at once); past 2^32-1 ms (about 49.7 days), which the plugin
// would silently deliver at once, it is refused. The plugin keeps waiting messages on
// ONE node, unreplicated; it routes them fire-and-forget when they come due, so retries
// due while the broker stops are lost, and so are those due to a queue deleted
// meanwhile. It returns every mandatory publish, so the backend publishes
// non-mandatory and proves the route another way: before its first publish to a
// queue it binds the queue to the exchange (an error if the queue does not exist). The
// plugin cannot run on RabbitMQ 4.3 or later (metadata in Khepri only).
type delayedExchange struct {
	env   backend.Env
	names names.Names

	mu    sync.Mutex
	bound map[string]bool // queues bound to the exchange by this backend
}

// maxPluginDelay is the longest delay the plugin honours (an Erlang timer's maximum).
const maxPluginDelay = (1<<32 - 1) * time.Millisecond

// DelayedExchange ("delayed-exchange") hands a retry to the
// rabbitmq_delayed_message_exchange plugin: 1 ms steps up to 49.7 days, stored on one
// node. The plugin cannot run on RabbitMQ 4.3 or later. It has no settings.
func DelayedExchange() Backend { return delayedExchangeValue{} }

// delayedExchangeValue is DelayedExchange as configured.
type delayedExchangeValue struct{ lib }

// Name is "delayed-exchange".
func (delayedExchangeValue) Name() string { return "delayed-exchange" }

func (b delayedExchangeValue) String() string { return b.Name() }

// Open opens the backend.
func (delayedExchangeValue) Open(s backend.Setup) (backend.Backend, error) {
	return &delayedExchange{env: s.Env, names: names.Names{Prefix: s.Prefix}, bound: map[string]bool{}}, nil
}

// The traits the delayed exchange implements.
var (
	_ backend.Sealed      = (*delayedExchange)(nil)
	_ backend.VersionGate = (*delayedExchange)(nil)
	_ backend.Preparer    = (*delayedExchange)(nil)
)

func (b *delayedExchange) Name() string { return delayedExchangeValue{}.Name() }

// SealedIn: the plugin offers no way to read, bring back or drop what it keeps in the
// exchange.
func (b *delayedExchange) SealedIn() topology.Exchange { return b.Topology().Exchanges[0] }

// Requirement is the plugin, which RabbitMQ 4.3 and later cannot run.
func (b *delayedExchange) Requirement() (name, role string) { return pluginName, "plugin" }

// countExpr counts what the plugin keeps for one exchange (%[1]s its vhost, %[2]s its
// name, as Erlang binaries), with its own rabbit_delayed_message:messages_delayed; it
// prints an error tag when the plugin does not run.
const countExpr = `case code:ensure_loaded(rabbit_delayed_message) of
  {module, _} ->
    case erlang:function_exported(rabbit_delayed_message, messages_delayed, 1) of
      true ->
        case rabbit_exchange:lookup(rabbit_misc:r(%[1]s, exchange, %[2]s)) of
          {ok, X} -> io:format("amqpretry-result ~p~n", [rabbit_delayed_message:messages_delayed(X)]);
          _ -> io:format("amqpretry-error exchange_not_found~n")
        end;
      false -> io:format("amqpretry-error plugin_has_no_count~n")
    end;
  _ -> io:format("amqpretry-error plugin_not_running~n")
end,
ok.`

// countExprFor is countExpr for exchange x of vhost.
func countExprFor(vhost, x string) string {
	return fmt.Sprintf(countExpr, backend.ErlBinary(vhost), backend.ErlBinary(x))
}

// CountSealed is how many messages the plugin keeps for exchange x, as the plugin
// itself reports: an error where it does not run, never a guess.
func (b *delayedExchange) CountSealed(ctx context.Context, eval backend.Eval, vhost, x string) (int, error) {
	out, err := eval(ctx, countExprFor(vhost, x))
	if err != nil {
		return 0, err
	}
	return readCount(out)
}

// readCount reads what countExpr printed (rabbitmqctl may print warnings around it).
func readCount(out []byte) (int, error) {
	for _, line := range strings.Split(string(out), "\n") {
		line = strings.TrimSpace(line)
		if why, ok := strings.CutPrefix(line, "amqpretry-error "); ok {
			switch why {
			case "plugin_not_running":
				why = "the " + pluginName + " plugin does not run on this node (not enabled, or RabbitMQ 4.3+, which cannot run it): its messages, if any, are out of reach"
			case "plugin_has_no_count":
				why = "this version of the " + pluginName + " plugin has no messages_delayed"
			case "exchange_not_found":
				why = "the exchange does not exist"
			}
			return 0, errors.New(why)
		}
		if r, ok := strings.CutPrefix(line, "amqpretry-result "); ok {
			if n, err := strconv.Atoi(r); err == nil {
				return n, nil
			}
		}
	}
	return 0, fmt.Errorf("rabbitmqctl eval printed %q", strings.TrimSpace(string(out)))
}

// CheckVersion refuses RabbitMQ 4.3 and later, where the plugin cannot run.
func (b *delayedExchange) CheckVersion(v string) error {
	if version.NoPlugins(v) {
		return b.errPluginMissing(v, nil)
	}
	return nil
}

// Prepare declares (or checks) the exchange, telling a missing plugin apart.
func (b *delayedExchange) Prepare(h backend.Handoff, mode topology.Mode) error {
	switch err := h.Ensure(mode, b.Topology()); {
	case err == nil:
		return nil
	case pluginMissing(err):
		return b.errPluginMissing(h.Version(), err)
	default:
		return fmt.Errorf("%s topology (mode %s): %w", b.Name(), mode, err)
	}
}

func (b *delayedExchange) Caps() backend.Caps {
	return backend.Caps{Keeps: backend.KeepsCopy, Longest: maxPluginDelay, PastLongest: backend.Refuse,
		CarriesEnvelope: true, Text: fmt.Sprintf("1ms steps up to %s (the plugin's 2^32-1 ms), a longer delay is refused", maxPluginDelay),
		Risk: "The delayed-exchange backend may lose retries that come due while the broker stops (the plugin routes them fire-and-forget); ttl-tiers and binary-levels do not"}
}

func (b *delayedExchange) Topology() topology.Topology {
	return topology.Topology{Exchanges: []topology.Exchange{{
		Name: b.names.Delayed(), Kind: declare.ExchangeDelayedMessage,
		Args: amqp.Table{declare.DelayedTypeArg: amqp.ExchangeDirect},
	}}}
}

func (b *delayedExchange) DelayQueues() []backend.DelayQueue { return nil }

// WorkQueue binds queue to the delayed exchange under its own name.
func (b *delayedExchange) WorkQueue(queue string) topology.Topology {
	t := b.Topology()
	t.Bindings = []topology.Binding{b.binding(queue)}
	return t
}

func (b *delayedExchange) binding(queue string) topology.Binding {
	return topology.Binding{Exchange: b.names.Delayed(), Destination: queue, Key: queue}
}

// Effective rounds requested up to whole milliseconds, at least 1 ms, and refuses it
// past 2^32-1 ms.
func (b *delayedExchange) Effective(requested time.Duration) (time.Duration, error) {
	if requested > maxPluginDelay {
		return 0, fmt.Errorf("%s: %w: %s is longer than the plugin's maximum %s (2^32-1 ms)", delayedExchangeValue{}, ErrDelayTooLong, requested, maxPluginDelay)
	}
	return wholeMillis(requested), nil
}

// bind binds queue to the exchange before the first publish to it.
func (b *delayedExchange) bind(queue string) error {
	b.mu.Lock()
	done := b.bound[queue]
	b.mu.Unlock()
	if done {
		return nil
	}
	if err := b.env.Handoff.Ensure(topology.ModeDeclare, topology.Topology{Bindings: []topology.Binding{b.binding(queue)}}); err != nil {
		return fmt.Errorf("%s: queue %q cannot receive from exchange %q (does it exist?): %w", delayedExchangeValue{}, queue, b.names.Delayed(), err)
	}
	b.mu.Lock()
	b.bound[queue] = true
	b.mu.Unlock()
	return nil
}

// Park publishes msg with its delay in x-delay, non-mandatory, once the queue's
// binding is declared.
func (b *delayedExchange) Park(ctx context.Context, queue string, msg *message.Message, effective time.Duration) error {
	if b.env.Handoff == nil {
		return errDetached
	}
	if err := b.bind(queue); err != nil {
		return err
	}
	headers := amqp.Table{keys.XDelay: effective.Milliseconds()}
	owned := func() topology.Topology { return b.WorkQueue(queue) }
	if err := b.env.Handoff.Publish(ctx, b.names.Delayed(), queue, msg, headers, false, owned); err != nil {
		return fmt.Errorf("exchange %s: %w", b.names.Delayed(), err)
	}
	return nil
}

func (b *delayedExchange) Close() error { return nil }

const pluginName = "rabbitmq_delayed_message_exchange"

// errPluginMissing says that the plugin is missing and what to do, for the broker's
// version.
func (b *delayedExchange) errPluginMissing(brokerVersion string, cause error) error {
	if version.NoPlugins(brokerVersion) {
		return fmt.Errorf("%s: %w: RabbitMQ %s cannot run the %s plugin (4.3 and later keep their metadata in Khepri only, which the plugin does not support; it is archived); use %s (any delay, 1 s steps), %s, or %s (4.3 keeps the retry in the work queue, one delay per queue)",
			delayedExchangeValue{}, ErrPluginMissing, brokerVersion, pluginName, binaryLevelsValue{}, ttlTiersValue{}, delayedRetryValue{})
	}
	err := fmt.Errorf("%s: cannot declare exchange %q of type %s: %w on the broker; enable it on every node with `rabbitmq-plugins enable %s`, or use the %s backend, which needs no plugin",
		delayedExchangeValue{}, b.names.Delayed(), declare.ExchangeDelayedMessage, ErrPluginMissing, pluginName, binaryLevelsValue{})
	if cause != nil {
		return fmt.Errorf("%w: %w", err, cause)
	}
	return err
}

// pluginMissing tells whether err is the broker refusing exchange type
// x-delayed-message as unknown: 503 COMMAND_INVALID on RabbitMQ 3.x, 406
// PRECONDITION_FAILED on 4.x. A real clash with an existing exchange is a 406 too, but
// reads "inequivalent arg 'type'".
func pluginMissing(err error) bool {
	var amqpErr *amqp.Error
	return errors.As(err, &amqpErr) &&
		(amqpErr.Code == amqp.CommandInvalid || amqpErr.Code == amqp.PreconditionFailed) &&
		strings.Contains(amqpErr.Reason, "unknown exchange type '"+declare.ExchangeDelayedMessage+"'")
}
