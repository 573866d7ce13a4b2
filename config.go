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
	// Backend names the delay backend (package delay): delay.TTLTiers ("ttl-tiers"),
	// delay.BinaryLevels ("binary-levels"), delay.DelayedExchange ("delayed-exchange"),
	// delay.DelayedRetry ("delayed-retry"), delay.DeliveryTime ("delivery-time", over
	// AMQP 1.0: the transport of package github.com/amqpretry/amqpretry/amqp1) or
	// delay.Memory ("memory"). A name read from configuration converts with
	// delay.Backend(s): switching backends is a change of this string only.
	// Default: delay.TTLTiers.
	Backend delay.Backend
	// Prefix starts the name of every queue and exchange the library declares, so
	// that several applications can share a vhost. Default: "amqpretry".
	Prefix string
	// Tiers is the ladder of ttl-tiers: one queue per delay, each a whole number of
	// milliseconds from 1ms to ten years. Default (nil): 34 tiers about 25% apart,
	// 1s 1.25s 1.6s 2s 2.5s 3.15s 4s 5s 6.3s 8s, the same times 10 and 100 (10s to
	// 8m20s), then 10m 15m 20m 30m 45m 1h. An empty, non-nil list is refused. A
	// delay longer than the longest tier (the policy's, or a RetryAfter) waits the
	// longest tier, then is parked again when it comes back, as often as it takes
	// until it is due: never early.
	Tiers []time.Duration
	// Levels is the number of levels of binary-levels, which holds delays up to
	// 2^Levels - 1 s: 1 to 29. Change Prefix with it: New refuses a prefix that holds
	// a ladder of other Levels (docs/switching-backends.md). Default: 28 (about 8.5 years).
	Levels int
	// HeldRetries is how many retries, from the first, RabbitMQ 4.3+ holds in the
	// work queue itself (held retries), DelayedRetryDelay apart, before Backend takes the next ones:
	// no copy, no publish (its delayed retry of quorum queues). The work queues must be
	// quorum queues; the subscriber config gets the queue arguments it needs. With
	// Backend "delayed-retry" every retry is held this way and this field is unused.
	// Not with Policy.Immediate. Default: 0.
	//
	// After them Backend's retries follow the policy's schedule started again from its
	// first delay (InitialInterval, or Delays[0]), as after Policy.Immediate. A delay
	// of the error's own (RetryAfter, or Classify's) skips them: that retry goes to
	// Backend at once, which keeps its delay. A held retry carries nothing new on the
	// wire: when it comes back, this process writes the envelope it kept into the
	// message's metadata (middleware.ReadEnvelope gives its attempt, error and Due, so
	// lateness is time.Since(env.Due) as on a copy); after a restart it has none.
	HeldRetries int
	// DelayedRetryDelay is the constant delay of the retries RabbitMQ holds in the
	// work queue (its x-delayed-retry-min and -max), a whole number of milliseconds.
	// With Backend "delayed-retry" alone, a longer delay of the error's own (a
	// RetryAfter) is never cut short: the retry is held again, as many times as it
	// takes (logged at WARN, or INFO), so it comes back at the first multiple of this
	// delay past the one asked for; this process keeps count, so after a restart it
	// comes back after one delay. It is the policy's one delay there: leave the
	// Policy's schedule fields zero (a Multiplier or Jitter set is refused, see
	// Policy). Default: 1s.
	DelayedRetryDelay time.Duration

	// Policy says how many attempts and how long apart. See Policy for its defaults.
	Policy Policy
	// Outage says when a work queue's handlers are judged to fail because something
	// they depend on is down (consecutive failures, a failure ratio, or an error marked
	// Unavailable), so that its messages wait, spending no attempt, until a probe
	// succeeds, instead of being retried to the poison queue. On by default; see
	// Outage for its defaults, and Outage.Off.
	Outage Outage
	// Classify decides, for any error, whether to poison the message now and whether
	// to replace the policy's delay. It receives DecisionOf the error in
	// ClassifyParams.Default: its marks (Permanent, RetryAfter), and Permanent for an
	// error of a payload that can never decode (encoding/json's *json.SyntaxError and
	// *json.UnmarshalTypeError, any error of google.golang.org/protobuf; see
	// DecisionOf). Default: that decision. To retry decode errors too, return
	// Default with Permanent false for them (ExampleConfig_retryDecodeErrors). A
	// handler's panic comes as an error wrapping ErrPanicked.
	Classify func(ClassifyParams) Decision
	// PoisonQueue receives the messages that failed for good, with their failure
	// envelope (middleware.Envelope). Declared as a quorum queue, replicated like the
	// delay queues. Default: "<Prefix>.poison".
	PoisonQueue string
	// ConfirmTimeout bounds the wait for each publisher confirm. Default: 10s.
	ConfirmTimeout time.Duration
	// Topology says what the library does with the queues, exchanges and bindings it
	// needs: declare them (topology.ModeDeclare), only check them, for a user without
	// configure permission (topology.ModeVerify), or nothing (topology.ModeNone).
	// Default: topology.ModeDeclare.
	Topology topology.Mode
	// HandoffAttempts is how many hand-offs of one message may fail in a row (broker
	// trouble, a message the broker refuses, a mis-wired subscriber) before it is
	// poisoned instead (ReasonHandoffFailed). Between failures the
	// middleware pauses, 100ms doubling to 5s, so nothing is redelivered at wire
	// speed. Default: 5.
	HandoffAttempts int

	// Observe, if set, is told every delivery, success, retry, poisoning and failed
	// hand-off (Event), on the handler's goroutine: the metrics module's
	// Metrics.Observe, for example. Default: nil.
	Observe func(Event)
	// RetryLogEvery samples the INFO line logged per scheduled retry: 0 or 1 logs
	// every one, N one in N, a negative value none. Poisonings and failed hand-offs
	// are always logged. Default: 0.
	RetryLogEvery int
	// Memory is where the memory backend publishes a retry when its delay is over,
	// with the queue as topic; in-process (no broker URI), also where poisoned
	// messages go, and, if it is a message.Subscriber (a GoChannel), what
	// AddHandler subscribes to. Required for the memory backend.
	Memory message.Publisher
	// Logger receives snake_case fields; poisonings and failed hand-offs are logged at
	// ERROR (poisonings at WARN where the logger has a Warn method). Default:
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	if c.Backend == "" {
		c.Backend = delay.TTLTiers
	}
	if c.Prefix == "" {
		c.Prefix = names.DefaultPrefix
	}
	if c.Tiers == nil {
		c.Tiers = backend.DefaultTiers()
	}
	if c.Levels == 0 {
		c.Levels = backend.DefaultLevels
	}
	if c.DelayedRetryDelay == 0 {
		c.DelayedRetryDelay = backend.DefaultRetryDelay
	}
	if c.Backend == delay.DelayedRetry {
		c.HeldRetries = 0
	}
	c.Policy = c.Policy.withDefaults()
	c.Outage = c.Outage.withDefaults()
	if c.PoisonQueue == "" {
		c.PoisonQueue = names.Names{Prefix: c.Prefix}.Poison()
	}
	if c.ConfirmTimeout == 0 {
		c.ConfirmTimeout = backend.DefaultConfirmTimeout
	}
	if c.Topology == "" {
		c.Topology = topology.ModeDeclare
	}
	if c.HandoffAttempts == 0 {
		c.HandoffAttempts = defaultHandoffAttempts
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	return c
}

const defaultHandoffAttempts = 5

// Validate reports every invalid field, each named; zero fields are checked as their
// defaults. It touches nothing on the broker: an invalid config has no side effects.
// It also refuses a policy the backend cannot keep: a delay longer than it holds
// (binary-levels past 2^Levels - 1 s, delayed-exchange past the plugin's 49.7 days),
// naming the field to change, or, on delayed-retry, a schedule value its one constant
// delay would ignore. On ttl-tiers a delay longer than the longest tier is not
// refused: the retry is parked again when it comes back, until it is due, so it never
// comes back early.
func (c Config) Validate() error {
	user := c.Policy
	c = c.WithDefaults()
	b, errs := c.topologyErrors()
	if c.Backend == delay.Memory && c.Memory == nil {
		errs = append(errs, errors.New("Memory: required for the memory backend"))
	}
	if err := c.Policy.validate(); err != nil {
		errs = append(errs, err)
	} else if b != nil {
		errs = append(errs, c.fits(b, user)...)
	}
	if err := c.Outage.validate(); err != nil {
		errs = append(errs, err)
	}
	if c.HeldRetries > 0 && c.Policy.Immediate > 0 {
		errs = append(errs, errors.New("HeldRetries: not with Policy.Immediate: retry either in this process or in the broker"))
	}
	if c.ConfirmTimeout < 0 {
		errs = append(errs, fmt.Errorf("ConfirmTimeout: %s is negative", c.ConfirmTimeout))
	}
	if c.HandoffAttempts < 0 {
		errs = append(errs, fmt.Errorf("HandoffAttempts: %d is negative", c.HandoffAttempts))
	}
	errs = append(errs, c.unusedNegatives()...)
	if !slices.Contains([]topology.Mode{topology.ModeDeclare, topology.ModeVerify, topology.ModeNone}, c.Topology) {
		errs = append(errs, fmt.Errorf("Topology: unknown mode %q (known: %s, %s, %s)", c.Topology, topology.ModeDeclare, topology.ModeVerify, topology.ModeNone))
	}
	return errors.Join(errs...)
}

// topologyErrors reports every invalid field among those that decide what c declares
// on the broker: the backend and its settings, the names, the held retries; and the
// backend, built once (nil when invalid). c has its defaults.
func (c Config) topologyErrors() (backend.Backend, []error) {
	var errs []error
	b, err := c.backend()
	if err != nil {
		b, errs = nil, append(errs, err)
	}
	if len(c.PoisonQueue) > names.MaxBytes {
		errs = append(errs, fmt.Errorf("PoisonQueue: %q is %d bytes long, over AMQP's %d", c.PoisonQueue, len(c.PoisonQueue), names.MaxBytes))
	}
	if c.HeldRetries < 0 {
		errs = append(errs, fmt.Errorf("HeldRetries: %d is negative", c.HeldRetries))
	}
	if c.HeldRetries > 0 && (c.Backend == delay.Memory || c.Backend == delay.DelayedExchange || c.Backend == delay.DeliveryTime) {
		errs = append(errs, fmt.Errorf("HeldRetries: retries held in the work queue (RabbitMQ 4.3) cannot stand in front of the %s backend", c.Backend))
	}
	if c.HeldRetries > 0 && c.Backend != delay.DelayedRetry { // the backend's own lookup checks it otherwise
		if err := backend.CheckRetryDelay(c.DelayedRetryDelay); err != nil {
			errs = append(errs, err)
		}
	}
	return b, errs
}

// fits refuses a policy the backend cannot keep: a delay it can ask for that the
// backend refuses, or, on delayed-retry, a schedule value set that the queue's one
// constant delay would ignore. user is the policy as given, before defaults.
func (c Config) fits(b backend.Backend, user Policy) []error {
	if c.Backend == delay.DelayedRetry {
		return c.fitsDelayedRetry(user)
	}
	// A delay the backend refuses could never be handed off.
	longest, field := c.Policy.longest(c.HeldRetries)
	if longest <= 0 {
		return nil
	}
	if _, err := b.Effective(longest); err != nil {
		lim := b.Caps()
		fix := fmt.Sprintf("set Policy.MaxInterval to at most %s", lim.Longest)
		if field != "MaxInterval" {
			fix = fmt.Sprintf("shorten Policy.%s to at most %s, or lower Policy.MaxAttempts", field, lim.Longest)
		}
		if lim.Fix != "" {
			fix += ", or " + lim.Fix
		}
		jitter := ""
		if field == "MaxInterval" && c.Policy.Jitter > 0 {
			jitter = ", jitter included"
		}
		return []error{fmt.Errorf("Policy.%s: %w: with %d attempts the policy asks for up to %s%s, longer than the %s the %s backend holds; %s",
			field, delay.ErrDelayTooLong, c.Policy.MaxAttempts, longest, jitter, lim.Longest, c.Backend, fix)}
	}
	return nil
}

// fitsDelayedRetry refuses, on the delayed-retry backend, a policy value that its one
// constant delay per work queue (DelayedRetryDelay, no jitter) would ignore: a value
// set (not zero) that asks for another delay, a growth or a jitter, even one equal to
// its default elsewhere (Multiplier 2 grows the delay on a copying backend; here it
// would be dropped). A zero field, its default, means the queue's delay: never
// refused. user is the policy as given, before defaults.
func (c Config) fitsDelayedRetry(user Policy) []error {
	var errs []error
	d, p := c.DelayedRetryDelay, c.Policy
	what := fmt.Sprintf("the %s backend holds every retry of a work queue for one constant delay, every %s (DelayedRetryDelay)", c.Backend, d)
	copying := "or use a copying Backend (ttl-tiers or binary-levels), with HeldRetries for the first retries if you want them held"
	if len(user.Delays) > 0 {
		switch {
		case slices.Max(user.Delays) == d && slices.Min(user.Delays) == d:
		case slices.Max(user.Delays) == slices.Min(user.Delays):
			errs = append(errs, fmt.Errorf("Policy.Delays: %v, %s: set DelayedRetryDelay to %s instead", user.Delays, what, user.Delays[0]))
		default:
			errs = append(errs, fmt.Errorf("Policy.Delays: %v, %s, and cannot grow it: leave Policy.Delays empty and set DelayedRetryDelay, %s", user.Delays, what, copying))
		}
	} else {
		if user.InitialInterval != 0 && user.InitialInterval != d {
			errs = append(errs, fmt.Errorf("Policy.InitialInterval: %s, %s: set DelayedRetryDelay to %s instead (or leave Policy.InitialInterval 0)", user.InitialInterval, what, user.InitialInterval))
		}
		if user.Multiplier != 0 && user.Multiplier != 1 {
			errs = append(errs, fmt.Errorf("Policy.Multiplier: %g, %s, and cannot grow it: set Policy.Multiplier to 1 (or 0 for the default), %s", user.Multiplier, what, copying))
		}
		if user.MaxInterval != 0 && user.MaxInterval < d {
			errs = append(errs, fmt.Errorf("Policy.MaxInterval: %s, shorter than the one constant delay the %s backend holds every retry for, %s (DelayedRetryDelay): set DelayedRetryDelay to at most %s (or leave Policy.MaxInterval 0)", user.MaxInterval, c.Backend, d, user.MaxInterval))
		}
		if user.Jitter != 0 && !user.NoJitter {
			errs = append(errs, fmt.Errorf("Policy.Jitter: %g, %s, and cannot randomise it: set Policy.Jitter to 0 or Policy.NoJitter, %s", user.Jitter, what, copying))
		}
	}
	if p.Immediate > 0 {
		errs = append(errs, fmt.Errorf("Policy.Immediate: %d, the %s backend counts attempts from the broker's deliveries and cannot count retries run in this process: set Policy.Immediate to 0, or use a copying Backend", p.Immediate, c.Backend))
	}
	return errs
}

// backend returns the backend c names, for planning and sizing. c has its defaults.
func (c Config) backend() (backend.Backend, error) {
	return delay.Lookup(c.spec())
}

// spec is the backend c names. c has its defaults.
func (c Config) spec() backend.Spec {
	return backend.Spec{Name: string(c.Backend), Prefix: c.Prefix, Tiers: c.Tiers, Levels: c.Levels, RetryDelay: c.DelayedRetryDelay}
}

// Derived returns what c, with its defaults, derives beyond its fields, each fact
// computed here only: the backend it names and what that backend can do, the one held
// in front of it, how to fix a topology error, what its work queues need, and the
// schedule. It is for this module's middleware, transports and ops (its type is
// internal); c has its defaults.
func (c Config) Derived() backend.Derived {
	v := backend.Derived{Backend: c.spec(), WorkQueueArgs: c.workQueueArgs(), Schedule: c.Policy.describe()}
	if b, err := c.backend(); err == nil {
		v.Caps = b.Caps()
	}
	v.Longest, _ = c.Policy.longest(c.HeldRetries)
	if c.HeldRetries > 0 {
		v.Held = &backend.Spec{Name: string(delay.DelayedRetry), RetryDelay: c.DelayedRetryDelay}
		v.Schedule = fmt.Sprintf("%d retries held in the work queue %s apart, then %s", c.HeldRetries, c.DelayedRetryDelay, v.Schedule)
	}
	if c.Backend == delay.DelayedRetry {
		v.Schedule = fmt.Sprintf("every retry held in the work queue %s (DelayedRetryDelay)", c.DelayedRetryDelay)
		v.Longest = c.DelayedRetryDelay
	}
	v.Fix = declare.Fix{Mode: c.Topology, HoldsRetries: v.WorkQueueArgs != nil, RetryDelay: c.DelayedRetryDelay, Backend: string(c.Backend), PoisonQueue: c.PoisonQueue, Apply: c.ApplyCommand}
	return v
}

// Plan returns everything c needs on the broker for the given work queues, without a
// broker (only the fields that decide it are checked, not the policy): the backend's exchanges, queues and bindings, the poison queue, and each
// work queue's way back (its binding to the backend's delivery exchange and, with
// delayed retries, the work queue itself with the arguments they need). The `amqpretry
// topology` command applies and checks it.
func (c Config) Plan(workQueues ...string) (topology.Topology, error) {
	c = c.WithDefaults()
	b, errs := c.topologyErrors()
	if err := errors.Join(errs...); err != nil {
		return topology.Topology{}, fmt.Errorf("invalid config: %w", err)
	}
	if c.Backend == delay.Memory {
		return topology.Topology{}, errors.New("invalid config: Backend: the memory backend has nothing on the broker")
	}
	t := backend.Plan(b, workQueues...)
	t.Queues = append(t.Queues, declare.HoldingQueue(c.PoisonQueue, "poison"))
	if args := c.workQueueArgs(); args != nil {
		for _, q := range workQueues {
			t.Queues = append(t.Queues, topology.Queue{Name: q, Args: args, Role: "work"})
		}
	}
	return declare.Unique(t), nil
}

// ApplyCommand returns the command line of the amqpretry command (module
// github.com/amqpretry/amqpretry/cmd/amqpretry) that declares what Plan(workQueues...)
// returns: `amqpretry topology apply`, with a flag for each field that differs from
// its default and a --queue for each work queue. It does not check c: see Plan.
func (c Config) ApplyCommand(workQueues ...string) string {
	c = c.WithDefaults()
	args := []string{"amqpretry", "topology", "apply", "--backend", string(c.Backend)}
	if c.Prefix != names.DefaultPrefix {
		args = append(args, "--prefix", c.Prefix)
	}
	switch {
	case c.Backend == delay.TTLTiers && !slices.Equal(c.Tiers, backend.DefaultTiers()):
		tiers := make([]string, len(c.Tiers))
		for i, t := range c.Tiers {
			tiers[i] = names.Tier(t)
		}
		args = append(args, "--tiers", strings.Join(tiers, ","))
	case c.Backend == delay.BinaryLevels && c.Levels != backend.DefaultLevels:
		args = append(args, "--levels", strconv.Itoa(c.Levels))
	}
	if c.HeldRetries > 0 && c.Backend != delay.DelayedRetry {
		args = append(args, "--held-retries", strconv.Itoa(c.HeldRetries))
	}
	if c.workQueueArgs() != nil && c.DelayedRetryDelay != backend.DefaultRetryDelay {
		args = append(args, "--retry-delay", c.DelayedRetryDelay.String())
	}
	if c.PoisonQueue != (names.Names{Prefix: c.Prefix}).Poison() {
		args = append(args, "--poison-queue", c.PoisonQueue)
	}
	for _, q := range workQueues {
		args = append(args, "--queue", q)
	}
	return strings.Join(args, " ")
}

// workQueueArgs are the arguments every work queue needs, or nil: when the work
// queues hold retries (the delayed-retry backend, or held retries in front of
// another), a quorum queue that holds returned deliveries for DelayedRetryDelay. It is
// the one place that decides whether they do. c has its defaults.
func (c Config) workQueueArgs() map[string]any {
	if c.Backend != delay.DelayedRetry && c.HeldRetries == 0 {
		return nil
	}
	return backend.WorkQueueArgs(c.DelayedRetryDelay)
}

// unusedNegatives refuses a negative value in a backend setting that c's backend does
// not use: it is ignored, but it is a mistake all the same (a backend checks the
// settings it uses itself, in topologyErrors). c has its defaults.
func (c Config) unusedNegatives() []error {
	var errs []error
	if c.Backend != delay.TTLTiers {
		for i, t := range c.Tiers {
			if t < 0 {
				errs = append(errs, fmt.Errorf("Tiers[%d]: %s, must not be negative (the %s backend does not use Tiers: leave it nil)", i, t, c.Backend))
			}
		}
	}
	if c.Backend != delay.BinaryLevels && c.Levels < 0 {
		errs = append(errs, fmt.Errorf("Levels: %d, must not be negative (the %s backend does not use Levels: leave it 0)", c.Levels, c.Backend))
	}
	if c.Backend != delay.DelayedRetry && c.HeldRetries == 0 && c.DelayedRetryDelay < 0 {
		errs = append(errs, fmt.Errorf("DelayedRetryDelay: %s, must not be negative (the %s backend without HeldRetries does not use it: leave it 0)", c.DelayedRetryDelay, c.Backend))
	}
	return errs
}
