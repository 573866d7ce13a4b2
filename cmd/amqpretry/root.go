package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/format"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/ops"
)

// app has what every command shares: the output, the broker URI and the common
// flags.
type app struct {
	ctx            context.Context
	stdout, stderr io.Writer
	uri            string
	// stdin answers the confirmation of a destructive move, asked only when terminal
	// (stdin is a terminal).
	stdin    io.Reader
	terminal bool

	json        bool
	verbose     bool // --verbose, where a command has it: every name listed
	unlisted    bool // teardown without rabbitmqctl: no binding listed
	backend     string
	prefix      string
	tiers       durationList
	levels      int
	heldRetries int
	retryDelay  time.Duration
	poisonQueue string
	flags       *pflag.FlagSet // the persistent flags, to tell which were set

	// ran is set once a command's own code runs: an error before that is cobra's (an
	// unknown command or flag, a bad value, wrong arguments, exclusive flags), a usage
	// error.
	ran bool
}

// usageError marks an error in the command line: exit status 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// errFlagged marks a run that worked and found something wrong (exit status 1),
// already reported on the output.
var errFlagged = errors.New("flagged")

const exitHelp = `Exit status, the same for every command:
  0    all is well
  1    an error, or something flagged: status found a problem, verify found the
       topology incomplete, a redrive (or its dry run) left unroutable messages,
       teardown found nothing to remove or refused, blocked release refused, a move
       that asks first (purge, teardown, blocked release) not confirmed at its prompt
  2    usage error: unknown command or flag, bad value, missing --all, a move that
       asks first (purge, teardown, blocked release) without --yes when stdin is not
       a terminal
  130  interrupted (Ctrl-C, SIGTERM): a redrive or purge stops between two messages

The broker URI comes from AMQP_URI (default ` + defaultURI + `);
its password is never printed. An amqps:// URI takes the CA and a client certificate
as query parameters: ?cacertfile=ca.pem&certfile=c.pem&keyfile=c.key, and
&auth_mechanism=external for SASL EXTERNAL.`

// run runs the command line args with the process's stdin and returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runWith(ctx, args, os.Stdin, isTerminal(os.Stdin), stdout, stderr)
}

// runWith is run with stdin, a terminal or not (where a destructive move asks for
// confirmation).
func runWith(ctx context.Context, args []string, stdin io.Reader, terminal bool, stdout, stderr io.Writer) int {
	a := &app{ctx: ctx, stdout: stdout, stderr: stderr, uri: os.Getenv(uriEnv), stdin: stdin, terminal: terminal}
	if a.uri == "" {
		a.uri = defaultURI
	}
	root := a.root()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	cmd, err := root.ExecuteContextC(ctx)
	path := "amqpretry"
	if cmd != nil {
		path = cmd.CommandPath()
	}
	var usage usageError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, errFlagged):
		return exitFailed
	case errors.Is(err, context.Canceled) || ctx.Err() != nil:
		fmt.Fprintln(stderr, "amqpretry: interrupted")
		return exitInterrupted
	case errors.As(err, &usage) || !a.ran:
		fmt.Fprintf(stderr, "amqpretry: %s\nRun '%s --help' for usage.\n", a.redact(err.Error()), path)
		return exitUsage
	}
	a.fail(err)
	return exitFailed
}

// root builds the command tree.
func (a *app) root() *cobra.Command {
	defaults := amqpretry.Config{}.WithDefaults()
	root := &cobra.Command{
		Use:   "amqpretry",
		Short: "Operate the broker side of amqpretry: status, topology, poison and parking queues",
		Long: `amqpretry operates the broker side of amqpretry: the status of the delay, parking,
poison and work queues; the topology the library needs (plan, apply, verify); and the
poison and parking queues (list, show, redrive, purge); the retries waiting in the delay
backend (waiting list, retry-now, purge); the blocked order keys (blocked list,
release); and teardown of a backend's storage.

The common flags describe the application's retry configuration (amqpretry.Config);
their defaults are the library's. --json gives machine-readable output everywhere.

` + exitHelp,
		Version:       buildVersion(),
		SilenceErrors: true,
		SilenceUsage:  true,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usagef("unknown command %q (known: %s)", args[0], strings.Join(subNames(cmd), ", "))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			return usagef("a command is needed: %s", strings.Join(subNames(cmd), ", "))
		},
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.SetVersionTemplate("amqpretry {{.Version}}\n")
	pf := root.PersistentFlags()
	a.flags = pf
	pf.BoolVar(&a.json, "json", false, "machine-readable output (JSON, snake_case keys)")
	pf.StringVar(&a.backend, "backend", defaults.Backend.Name(), "delay backend, by the name delay.Parse takes (one with something on the broker)")
	pf.StringVar(&a.prefix, "prefix", defaults.Prefix, "prefix of every queue and exchange the library declares")
	pf.Var(&a.tiers, "tiers", "ttl-tiers: the ladder of delays, comma-separated (default: the library's ladder)")
	pf.IntVar(&a.levels, "levels", 0, "binary-levels: number of levels, delays up to 2^levels - 1 s (0: the library's default)")
	pf.IntVar(&a.heldRetries, "held-retries", 0, "retries RabbitMQ 4.3+ holds in the work queue itself before the backend takes the next")
	// The flag's old name: a hidden, deprecated alias, so that scripts keep working.
	pf.DurationVar(&a.retryDelay, "retry-delay", 0, "delay of the retries held in the work queue (held-retries, delayed-retry backend; 0: the library's default)")
	pf.StringVar(&a.poisonQueue, "poison-queue", "", "poison queue (default <prefix>.poison: "+defaults.PoisonQueue+")")

	root.AddCommand(a.statusCmd(), a.topologyCmd(), a.poisonCmd(), a.parkingCmd(), a.waitingCmd(), a.blockedCmd(), a.teardownCmd(), a.versionCmd(), a.consoleCmd())
	a.wire(root)
	return root
}

// wire makes the flag errors of c and its subcommands usage errors, and records when
// a command's own code starts (after cobra has checked its arguments and flags).
func (a *app) wire(c *cobra.Command) {
	c.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	// While parsing, pflag writes only the notice of a deprecated flag name there (it
	// returns errors); cobra would copy it to stdout, ahead of the --json output.
	c.Flags().SetOutput(a.stderr)
	if run := c.RunE; run != nil {
		c.RunE = func(cmd *cobra.Command, args []string) error {
			a.ran = true
			return run(cmd, args)
		}
	}
	for _, sub := range c.Commands() {
		a.wire(sub)
	}
}

// group is a command that only has subcommands.
func group(use, short string, subs ...*cobra.Command) *cobra.Command {
	c := &cobra.Command{
		Use:   use,
		Short: short,
		Long:  short + ".\n\n" + exitHelp,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usagef("%s: unknown command %q (known: %s)", cmd.CommandPath(), args[0], strings.Join(subNames(cmd), ", "))
			}
			return usagef("%s needs a command: %s", cmd.CommandPath(), strings.Join(subNames(cmd), ", "))
		},
	}
	c.AddCommand(subs...)
	return c
}

func subNames(c *cobra.Command) []string {
	var out []string
	for _, s := range c.Commands() {
		if s.IsAvailableCommand() {
			out = append(out, s.Name())
		}
	}
	return out
}

// noArgs refuses positional arguments, as a usage error.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usagef("%s takes no arguments, got %q", cmd.CommandPath(), args)
	}
	return nil
}

func (a *app) versionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version of the command and of the library it is built with",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if a.json {
				return a.emit(map[string]string{"version": buildVersion()})
			}
			fmt.Fprintf(a.stdout, "amqpretry %s\n", buildVersion())
			return nil
		},
	}
}

// release is the release this source is, CHANGELOG.md's newest (a test checks it): the
// version printed when the build has no module version of its own (go build or go run
// in a checkout, which Go calls "(devel)").
const release = "v0.1.0"

// buildVersion is the module version of the command and of the library it was built
// with.
func buildVersion() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return release
	}
	if info.Main.Version == "" || info.Main.Version == "(devel)" {
		info.Main.Version = release
	}
	lib := "(devel)"
	for _, d := range info.Deps {
		if d.Path == "github.com/amqpretry/amqpretry" {
			lib = d.Version
			if d.Replace != nil {
				lib = d.Replace.Path
			}
		}
	}
	if lib == "" {
		lib = "(workspace)"
	}
	return fmt.Sprintf("%s (library %s, %s)", info.Main.Version, lib, info.GoVersion)
}

// retryConfig is the application's retry configuration from the common flags: the
// command knows the broker side only.
func (a *app) retryConfig() (amqpretry.Config, error) {
	// The backend's settings from its flags: it takes those it has.
	settings := delay.Settings{Levels: a.levels, Delay: a.retryDelay}
	if a.flags.Changed("tiers") {
		settings.Tiers = a.tiers
	}
	b, err := delay.Parse(a.backend, settings)
	if err != nil {
		return amqpretry.Config{}, usagef("%s", flagNames(err.Error()))
	}
	cfg := amqpretry.Config{
		Backend: delay.HeldRetries(a.heldRetries, a.retryDelay, b), Prefix: a.prefix, PoisonQueue: a.poisonQueue,
	}
	// Plan checks what decides the topology, and refuses a backend with nothing on the
	// broker (memory).
	if _, err := cfg.Plan(); err != nil {
		return cfg, usagef("invalid retry configuration: %s", flagNames(strings.TrimPrefix(err.Error(), "invalid config: ")))
	}
	return cfg, nil
}

// backendArg is a backend constructor's argument named in a validation error, as
// "delay.<Constructor>(<argument>):".
var backendArg = regexp.MustCompile(`delay\.[A-Za-z]+\((n|delay|then)\):`)

// flagNames names the flags behind the amqpretry.Config fields (and the backend
// constructors' arguments) in a validation error.
func flagNames(s string) string {
	s = backendArg.ReplaceAllStringFunc(s, func(m string) string {
		return map[string]string{"n": "--held-retries:", "delay": "--retry-delay:", "then": "--backend:"}[backendArg.FindStringSubmatch(m)[1]]
	})
	return strings.NewReplacer("Backend:", "--backend:", "Prefix:", "--prefix:", "Tiers:", "--tiers:", "Tiers[", "--tiers[",
		"Levels:", "--levels:", "HeldRetries:", "--held-retries:", "DelayedRetryDelay:", "--retry-delay:",
		"PoisonQueue:", "--poison-queue:").Replace(s)
}

// applyCommand is the command line that creates what cfg needs for the queues.
func applyCommand(cfg amqpretry.Config, queues []string) string {
	return cfg.ApplyCommand(queues...)
}

// open validates the common flags and connects.
func (a *app) open() (*ops.Ops, amqpretry.Config, error) { return a.openWith(nil) }

// openWith is open with rabbitmqctl (ops.Config.Rabbitmqctl), if ctl is not nil.
func (a *app) openWith(ctl ctlRunner) (*ops.Ops, amqpretry.Config, error) {
	cfg, err := a.retryConfig()
	if err != nil {
		return nil, cfg, err
	}
	o, err := ops.New(ops.Config{URI: a.uri, Retry: cfg, Rabbitmqctl: ctl})
	return o, cfg, err
}

// redact hides the URI's password in s.
func (a *app) redact(s string) string { return redactString(s, a.uri) }

// fail prints err, redacted, as JSON on stdout or as text on stderr.
func (a *app) fail(err error) {
	msg := a.redact(err.Error())
	if a.json {
		_ = json.NewEncoder(a.stdout).Encode(map[string]string{"error": msg})
		return
	}
	fmt.Fprintln(a.stderr, "amqpretry:", msg)
}

// emit writes v as indented JSON.
func (a *app) emit(v any) error {
	enc := json.NewEncoder(a.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func (a *app) printf(format string, args ...any) { fmt.Fprintf(a.stdout, format, args...) }

// durationList is a comma-separated list of durations (--tiers).
type durationList []time.Duration

func (d *durationList) String() string {
	parts := make([]string, len(*d))
	for i, t := range *d {
		parts[i] = format.Configured(t)
	}
	return strings.Join(parts, ",")
}

func (d *durationList) Set(s string) error {
	var out []time.Duration
	for _, p := range strings.Split(s, ",") {
		t, err := time.ParseDuration(strings.TrimSpace(p))
		if err != nil {
			return fmt.Errorf("want durations such as 1s,30s,10m: %w", err)
		}
		out = append(out, t)
	}
	*d = out
	return nil
}

func (d *durationList) Type() string { return "durations" }

// boundedInt is an int flag that refuses values below min.
type boundedInt struct {
	v   *int
	min int
}

func (b boundedInt) String() string {
	if b.v == nil {
		return "0"
	}
	return strconv.Itoa(*b.v)
}

func (b boundedInt) Set(s string) error {
	n, err := strconv.Atoi(s)
	if err != nil {
		return fmt.Errorf("want a whole number: %q", s)
	}
	if n < b.min {
		return fmt.Errorf("%d is below %d", n, b.min)
	}
	*b.v = n
	return nil
}

func (b boundedInt) Type() string { return "int" }

// nonNegativeDuration is a duration flag that refuses negative values.
type nonNegativeDuration struct{ v *time.Duration }

func (d nonNegativeDuration) String() string {
	if d.v == nil {
		return "0s"
	}
	return d.v.String()
}

func (d nonNegativeDuration) Set(s string) error {
	t, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("want a duration such as 90s or 2h: %q", s)
	}
	if t < 0 {
		return fmt.Errorf("%s is negative", t)
	}
	*d.v = t
	return nil
}

func (d nonNegativeDuration) Type() string { return "duration" }
