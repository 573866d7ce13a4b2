// Command amqpretry operates the broker side of amqpretry: status of the delay, parking
// and poison queues; the topology (plan, apply, verify); and the poison and parking
// queues (list, show, redrive, purge). It is a thin layer over package ops.
//
// It reads the broker URI from AMQP_URI (default amqp://guest:guest@127.0.0.1:5672/)
// and never prints its password. --json gives machine-readable output everywhere.
//
//	amqpretry status [--check] [--peek auto|always|never] [--stuck-margin 30s]
//	amqpretry topology plan|apply|verify [--queue Q]... [--bind] [--no-compare]
//	amqpretry poison list|show|redrive|purge [filters] [--dry-run] [--rate N/s] [--reset-attempts]
//	amqpretry parking list|redrive [filters] [--dry-run] [--rate N/s]
//
// Every command takes --backend, --prefix, --tiers, --levels and --poison-queue, with
// the library's defaults. Exit status: 0 when all is well, 1 on an error or when
// something is flagged (status --check, verify, unroutable messages), 2 on a usage
// error, 130 when interrupted.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

// Exit statuses.
const (
	exitOK          = 0
	exitFlagged     = 1
	exitUsage       = 2
	exitInterrupted = 130
)

// uriEnv names the environment variable holding the broker URI.
const uriEnv = "AMQP_URI"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

const usage = `usage: amqpretry <command> [flags]

commands:
  status                          depth and oldest message of the delay, parking and poison queues
  topology plan|apply|verify      the declarations the library needs; apply them; check them
  poison list|show|redrive|purge  the poison queue
  parking list|redrive            the parking queue (retries whose work queue was gone)

Run 'amqpretry <command> -h' for its flags. The broker URI comes from AMQP_URI.
`

// errUsage marks a usage error (exit status 2).
var errUsage = errors.New("usage")

// run runs the command line args and returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stderr, usage)
		if len(args) == 0 {
			return exitUsage
		}
		return exitOK
	}
	c := &cli{ctx: ctx, stdout: stdout, stderr: stderr, uri: os.Getenv(uriEnv)}
	if c.uri == "" {
		c.uri = defaultURI
	}
	var err error
	code := exitOK
	switch args[0] {
	case "status":
		code, err = c.status(args[1:])
	case "topology":
		code, err = c.sub("topology", args[1:], map[string]func([]string) (int, error){
			"plan": c.topologyPlan, "apply": c.topologyApply, "verify": c.topologyVerify,
		})
	case "poison":
		code, err = c.sub("poison", args[1:], map[string]func([]string) (int, error){
			"list": c.poisonList, "show": c.poisonShow, "redrive": c.poisonRedrive, "purge": c.poisonPurge,
		})
	case "parking":
		code, err = c.sub("parking", args[1:], map[string]func([]string) (int, error){
			"list": c.parkingList, "redrive": c.parkingRedrive,
		})
	default:
		err = fmt.Errorf("%w: unknown command %q", errUsage, args[0])
	}
	switch {
	case errors.Is(err, flag.ErrHelp):
		return exitOK
	case errors.Is(err, errUsage):
		fmt.Fprintln(stderr, "amqpretry:", c.redact(err.Error()))
		fmt.Fprint(stderr, usage)
		return exitUsage
	case err != nil:
		c.fail(err)
		if code == exitOK {
			code = exitFlagged
		}
	}
	return code
}

// sub dispatches a command with subcommands.
func (c *cli) sub(name string, args []string, subs map[string]func([]string) (int, error)) (int, error) {
	var names []string
	for _, n := range []string{"plan", "apply", "verify", "list", "show", "redrive", "purge"} {
		if _, ok := subs[n]; ok {
			names = append(names, n)
		}
	}
	if len(args) == 0 {
		return exitUsage, fmt.Errorf("%w: amqpretry %s needs a subcommand: %s", errUsage, name, strings.Join(names, ", "))
	}
	fn, ok := subs[args[0]]
	if !ok {
		return exitUsage, fmt.Errorf("%w: amqpretry %s: unknown subcommand %q (known: %s)", errUsage, name, args[0], strings.Join(names, ", "))
	}
	return fn(args[1:])
}
