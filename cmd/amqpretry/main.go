// Command amqpretry operates the broker side of amqpretry: the status of the delay,
// parking, poison and work queues; the topology (plan, apply, verify); and the poison
// and parking queues (list, show, redrive, purge). It renders what package ops returns.
//
// It reads the broker URI from AMQP_URI (default amqp://guest:guest@127.0.0.1:5672/)
// and never prints its password. Run `amqpretry --help` for the commands, the common
// flags and the exit statuses; README.md beside this file is the operator's guide.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"
)

// Exit statuses, the same in every command (documented in the root command's help).
const (
	exitOK          = 0
	exitFailed      = 1 // an error, or something flagged
	exitUsage       = 2
	exitInterrupted = 130
)

// uriEnv names the environment variable with the broker URI.
const uriEnv = "AMQP_URI"

// defaultURI is the broker URI when AMQP_URI is unset.
const defaultURI = "amqp://guest:guest@127.0.0.1:5672/"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
