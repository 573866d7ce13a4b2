package amqpretry

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// Config configures the retry: where a failed message waits, how often it is retried,
// and where it goes when it fails for good. Every zero field means its default, given
// once, in the field's comment. The transport package of your watermill-amqp major
// (wamqp3.New or wamqp2.New) takes it, with the subscriber config.
type Config struct {
	// Backend keeps the retries: a value of package delay, with its own settings, named
	// "ttl-tiers", "binary-levels", "delayed-exchange", "delayed-retry", "delivery-time"
	// (amqp1) or "memory"; delay.Parse gives one by name. Default: delay.TTLTiers().
	Backend delay.Backend
	// Prefix starts the name of every queue and exchange the library declares, so
	// that several applications can share a vhost. Default: "amqpretry".
	Prefix string
	// Policy says how many attempts and how long apart. See Policy for its defaults.
	Policy Policy
	// Outage says when a work queue's handlers are judged to fail because something they
	// depend on is down, so that its messages wait, spending no attempt, until a probe
	// succeeds (docs/outage.md). On by default; see Outage.
	Outage Outage
	// Dedup is how long a message handled (or poisoned) is remembered, by its work queue
	// and UUID, so that a duplicate is acked without running the handler; a failure is
	// never remembered (package doc, Duplicates; docs/dedup.md). Default: 0, off.
	Dedup time.Duration
	// DedupStore is where Dedup remembers; one of your own (the pgdedup module's table)
	// survives restarts and serves every instance. Default: nil, this process's memory,
	// up to 100,000 messages, the oldest forgotten first.
	DedupStore DedupStore
	// Classify decides, for any error (a panic wraps ErrPanicked), whether to poison the
	// message now and whether to replace the policy's delay, given DecisionOf the error
	// as ClassifyParams.Default (ExampleConfig_retryDecodeErrors). Default: that decision.
	Classify func(ClassifyParams) Decision
	// PoisonQueue receives the messages that failed for good, with their failure
	// envelope (middleware.Envelope). Declared as a quorum queue, replicated like the
	// delay queues. Default: "<Prefix>.poison".
	PoisonQueue string
	// Topology says what the library does with the queues, exchanges and bindings it
	// needs: declare them (ModeDeclare), only check them, for a user without configure
	// permission (ModeVerify), or nothing (ModeNone). Default: topology.ModeDeclare.
	Topology topology.Mode

	// OrderKey, if set, names the key ("" for none) whose messages are handled in order:
	// while one of key K waits for its retry, K's later ones wait behind it. Needs one
	// active consumer per work queue and ModeDeclare (docs/ordering.md). Default: nil.
	OrderKey func(*message.Message) string
	// BlockOnPoison keeps a key blocked when its message is poisoned, until an operator
	// releases it (`amqpretry blocked release`); by default the messages behind it run.
	BlockOnPoison bool

	// Observe, if set, is told every delivery, success, retry, poisoning and failed
	// hand-off (Event), on the handler's goroutine: the metrics module's
	// Metrics.Observe, for example. Default: nil.
	Observe func(Event)
	// Logger receives snake_case fields: each scheduled retry at DEBUG, poisonings and
	// failed hand-offs at ERROR (poisonings at WARN where the logger has a Warn
	// method). Default: watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	if c.Backend == nil {
		c.Backend = delay.TTLTiers()
	}
	if c.Prefix == "" {
		c.Prefix = names.DefaultPrefix
	}
	c.Policy = c.Policy.withDefaults()
	c.Outage = c.Outage.withDefaults()
	if c.PoisonQueue == "" {
		c.PoisonQueue = names.Names{Prefix: c.Prefix}.Poison()
	}
	if c.Topology == "" {
		c.Topology = topology.ModeDeclare
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	return c
}

// Validate reports every invalid field, each named; zero fields are checked as their
// defaults. It touches nothing on the broker: an invalid config has no side effects.
// It also refuses a policy the backend cannot keep: a delay longer than it keeps
// (binary-levels past 2^Levels - 1 s, delayed-exchange past the plugin's 49.7 days),
// naming the field to change, or, on a backend of one constant delay (delayed-retry),
// a schedule value that delay would ignore. On ttl-tiers a delay longer than the
// longest tier is not refused: the retry is parked again when it comes back, until it
// is due, so it never comes back early.
func (c Config) Validate() error { return c.WithDefaults().invalid(c.derive(), c) }

// invalid is every invalid field of c, with its defaults, v what it derives; user is
// c as given, before defaults.
func (c Config) invalid(v backend.Derived, user Config) error {
	errs := c.topologyErrors(v)
	if val, ok := v.Backend.(backend.Validator); ok {
		if err := val.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := c.Policy.validate(); err != nil {
		errs = append(errs, err)
	} else if v.Backend != nil {
		errs = append(errs, c.fits(v, user.Policy)...)
	}
	if err := c.Outage.validate(); err != nil {
		errs = append(errs, err)
	}
	if v.HeldRetries > 0 && c.Policy.Immediate > 0 {
		errs = append(errs, errors.New("Policy.Immediate: not with delay.HeldRetries: retry either in this process or in the broker"))
	}
	if c.Dedup < 0 {
		errs = append(errs, fmt.Errorf("Dedup: %s is negative", c.Dedup))
	}
	if c.Dedup == 0 && c.DedupStore != nil {
		errs = append(errs, errors.New("DedupStore: set, but Dedup is 0 (off): set Dedup to how long a handled message is remembered (7 days, say), or leave DedupStore nil"))
	}
	if c.OrderKey != nil && c.Topology != topology.ModeDeclare {
		errs = append(errs, fmt.Errorf("OrderKey: not with topology mode %s: a blocked key's messages wait in a queue declared when it is blocked (%s); use topology mode declare, with configure permission on those names", c.Topology, names.Names{Prefix: c.Prefix}.BehindQueues()))
	}
	if c.OrderKey == nil && c.BlockOnPoison {
		errs = append(errs, errors.New("BlockOnPoison: set without OrderKey, which names the keys it blocks: set OrderKey, or leave BlockOnPoison false"))
	}
	if !slices.Contains([]topology.Mode{topology.ModeDeclare, topology.ModeVerify, topology.ModeNone}, c.Topology) {
		errs = append(errs, fmt.Errorf("Topology: unknown mode %q (known: %s, %s, %s)", c.Topology, topology.ModeDeclare, topology.ModeVerify, topology.ModeNone))
	}
	return errors.Join(errs...)
}

// topologyErrors reports every invalid field among those that decide what c declares
// on the broker: the backend and its settings, the names, the held retries. c has its
// defaults, v is what it derives.
func (c Config) topologyErrors(v backend.Derived) []error {
	var errs []error
	if v.Err != nil {
		errs = append(errs, v.Err)
	}
	if len(c.PoisonQueue) > names.MaxBytes {
		errs = append(errs, fmt.Errorf("PoisonQueue: %q is %d bytes long, over AMQP's %d", c.PoisonQueue, len(c.PoisonQueue), names.MaxBytes))
	}
	return errs
}

// fits refuses a policy the backend cannot keep: a delay it can ask for that the
// backend refuses, or, on a backend of one constant delay, a schedule value set that
// the delay would ignore. user is the policy as given, before defaults.
func (c Config) fits(v backend.Derived, user Policy) []error {
	lim := v.Caps
	if k, ok := v.Backend.(backend.Constant); ok {
		return c.fitsConstant(v.Name, k.OneDelay(), user)
	}
	// A delay the backend refuses could never be handed off.
	longest, at := c.Policy.values().Longest(v.HeldRetries)
	if longest <= 0 {
		return nil
	}
	if _, err := v.Backend.Effective(longest); err != nil {
		// The longest the entry may be: the backend's longest, less the jitter when
		// a longer entry (out of reach) leaves room for it.
		j, most := c.Policy.values().JitterOf(), lim.Longest
		if longest > c.Policy.Delays[at] {
			most = time.Duration(float64(lim.Longest) / (1 + j))
			for most > 0 && backend.Jittered(most, j) > lim.Longest {
				most--
			}
		}
		field := fmt.Sprintf("Delays[%d]", at)
		fix := fmt.Sprintf("shorten Policy.%s to at most %s, or lower Policy.MaxAttempts", field, most)
		if len(user.Delays) == 0 {
			field = "Delays"
			fix = fmt.Sprintf("set Policy.Delays to a schedule of at most %s (Exponential(time.Second, 2, %s)), or lower Policy.MaxAttempts", lim.Longest, lim.Longest)
		}
		if lim.Fix != "" {
			fix += ", or " + lim.Fix
		}
		jitter := ""
		if longest > c.Policy.Delays[at] {
			jitter = ", jitter included"
		}
		return []error{fmt.Errorf("Policy.%s: %w: with %d attempts the policy asks for up to %s%s, longer than the %s the %s backend keeps; %s",
			field, delay.ErrDelayTooLong, c.Policy.MaxAttempts, longest, jitter, lim.Longest, v.Name, fix)}
	}
	return nil
}

// fitsConstant refuses, on a backend (name) that holds every retry of a work queue for
// one constant delay d (delayed-retry, no jitter), a policy value that d would ignore:
// Delays that ask for another delay or a growth, or a positive Jitter. Delays nil, its
// default, and Jitter 0 or negative mean the queue's delay: never refused. user is the
// policy as given, before defaults.
func (c Config) fitsConstant(name string, d time.Duration, user Policy) []error {
	var errs []error
	p := c.Policy
	what := fmt.Sprintf("the %s backend holds every retry of a work queue for one constant delay, every %s (its delay)", name, d)
	copying := "or use a copying Backend (ttl-tiers or binary-levels), behind delay.HeldRetries for the first retries if you want them held"
	if len(user.Delays) > 0 {
		switch {
		case slices.Max(user.Delays) == d && slices.Min(user.Delays) == d:
		case slices.Max(user.Delays) == slices.Min(user.Delays):
			errs = append(errs, fmt.Errorf("Policy.Delays: %v, %s: set its delay to %s instead", user.Delays, what, user.Delays[0]))
		default:
			errs = append(errs, fmt.Errorf("Policy.Delays: %v, %s, and cannot grow it: leave Policy.Delays empty and set its delay, %s", user.Delays, what, copying))
		}
	}
	if user.Jitter > 0 {
		errs = append(errs, fmt.Errorf("Policy.Jitter: %g, %s, and cannot randomise it: set Policy.Jitter to 0 (or -1), %s", user.Jitter, what, copying))
	}
	if p.Immediate > 0 {
		errs = append(errs, fmt.Errorf("Policy.Immediate: %d, the %s backend counts attempts from the broker's deliveries and cannot count retries run in this process: set Policy.Immediate to 0, or use a copying Backend", p.Immediate, name))
	}
	return errs
}

// derive returns what c derives beyond its fields (backend.Derive, the one place each
// fact is computed), defaults applied first. It derives afresh on each call. The
// middleware, its transports and ops derive through internal/derived.Of, which reads
// the same fields.
func (c Config) derive() backend.Derived {
	c = c.WithDefaults()
	return backend.Derive(backend.Input{Backend: c.Backend, Prefix: c.Prefix, PoisonQueue: c.PoisonQueue, Topology: c.Topology,
		Ordered: c.OrderKey != nil, Policy: c.Policy.values(), Apply: c.ApplyCommand})
}

// Plan returns everything c needs on the broker for the given work queues, without a
// broker (only the fields that decide it are checked, not the policy): the backend's exchanges, queues and bindings, the poison queue, and each
// work queue's way back (its binding to the backend's delivery exchange and, with
// delayed retries, the work queue itself with the arguments they need). The `amqpretry
// topology` command applies and checks it.
func (c Config) Plan(workQueues ...string) (topology.Topology, error) {
	v := c.derive()
	c = c.WithDefaults()
	if err := errors.Join(c.topologyErrors(v)...); err != nil {
		return topology.Topology{}, fmt.Errorf("invalid config: %w", err)
	}
	if v.InProcess {
		return topology.Topology{}, fmt.Errorf("invalid config: Backend: the %s backend has nothing on the broker", v.Name)
	}
	t := backend.Plan(v.Backend, workQueues...)
	t.Queues = append(t.Queues, declare.ReviewQueue(c.PoisonQueue, "poison"))
	if args := v.WorkQueueArgs; args != nil {
		for _, q := range workQueues {
			t.Queues = append(t.Queues, topology.Queue{Name: q, Args: args, Role: "work"})
		}
	}
	return declare.Unique(t), nil
}

// ApplyCommand returns the command line of the amqpretry command (module
// github.com/amqpretry/amqpretry/cmd/amqpretry) that declares what Plan(workQueues...)
// returns: `amqpretry topology apply`, with a flag for each setting that differs from
// its default (the backend's own flags) and a --queue for each work
// queue. It does not check c: see Plan.
func (c Config) ApplyCommand(workQueues ...string) string {
	c = c.WithDefaults()
	args := []string{"amqpretry", "topology", "apply", "--backend", c.Backend.Name()}
	if c.Prefix != names.DefaultPrefix {
		args = append(args, "--prefix", c.Prefix)
	}
	v := c.derive()
	if b := v.Backend; b != nil {
		if f, ok := b.(backend.Flagger); ok {
			args = append(args, f.Flags()...)
		}
	}
	if v.HeldRetries > 0 {
		args = append(args, "--held-retries", strconv.Itoa(v.HeldRetries))
		if f, ok := v.Held.(backend.Flagger); ok {
			args = append(args, f.Flags()...)
		}
	}
	if c.PoisonQueue != (names.Names{Prefix: c.Prefix}).Poison() {
		args = append(args, "--poison-queue", c.PoisonQueue)
	}
	for _, q := range workQueues {
		args = append(args, "--queue", q)
	}
	return strings.Join(args, " ")
}
