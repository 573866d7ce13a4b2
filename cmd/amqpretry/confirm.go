package main

import (
	"bufio"
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/amqpretry/amqpretry/ops"
)

// errDeclined: a destructive move was not confirmed at its prompt (exit status 1).
var errDeclined = errors.New("not confirmed: nothing changed")

const confirmHelp = `It cannot be undone, so it asks first: on a terminal it shows what --dry-run would
show and asks for confirmation (y/N, on stderr); when stdin is not a terminal (a script,
a pipe) it refuses without --yes (exit status 2). --yes confirms in advance; --dry-run
shows what it would do and changes nothing.`

// yesFlag adds --yes to a destructive command.
func yesFlag(c *cobra.Command, yes *bool) {
	c.Flags().BoolVar(yes, "yes", false, "confirm in advance: do it without asking (needed when stdin is not a terminal)")
}

// mayDestroy refuses, before anything is dialled, a destructive move (what it does,
// e.g. "poison purge deletes messages for good") that nobody can confirm: neither
// --yes nor a terminal to ask on.
func (a *app) mayDestroy(what string, yes bool) error {
	if yes || a.terminal {
		return nil
	}
	return usagef("%s: pass --yes to confirm (stdin is not a terminal to ask on), or --dry-run to see what it would do", what)
}

// ask prints question on stderr and reads the answer from stdin: true for y or yes.
// An interrupt while it waits ends the command (exit status 130).
func (a *app) ask(question string) (bool, error) {
	fmt.Fprintf(a.stderr, "%s [y/N] ", question)
	answer := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(a.stdin).ReadString('\n')
		answer <- line
	}()
	select {
	case <-a.ctx.Done():
		fmt.Fprintln(a.stderr)
		return false, a.ctx.Err()
	case line := <-answer:
		switch strings.ToLower(strings.TrimSpace(line)) {
		case "y", "yes":
			return true, nil
		}
		return false, nil
	}
}

// confirmMove runs the move (purge) of opts after the user has confirmed it: with
// --yes at once; otherwise (on a terminal) it first runs it as a dry run, shows that on
// stderr, and asks. The run then acts on what was shown: at most as many messages,
// and, when each shown one has an id, only those. A dry run that matched nothing is
// the command's result: there is nothing to ask. move runs opts, showing its progress
// when told; confirmed tells the run acted on what was shown.
func (a *app) confirmMove(yes bool, opts ops.MoveOptions, move func(opts ops.MoveOptions, progress bool) (ops.MoveResult, error),
	question func(ops.MoveResult) string, show func(ops.MoveResult)) (r ops.MoveResult, confirmed bool, err error) {
	if yes || opts.DryRun {
		r, err = move(opts, true)
		return r, false, err
	}
	dry := opts
	dry.DryRun = true
	preview, err := move(dry, false)
	if err != nil || preview.Matched == 0 {
		return preview, false, err
	}
	show(preview)
	ok, err := a.ask(question(preview))
	if err != nil {
		return preview, false, err
	}
	if !ok {
		return preview, false, errDeclined
	}
	opts.Limit = preview.Matched
	var ids []string
	for _, m := range preview.Messages {
		id := m.UUID
		if id == "" {
			id = m.MessageID
		}
		if id == "" {
			ids = nil
			break
		}
		ids = append(ids, id)
	}
	if len(ids) == len(preview.Messages) {
		opts.IDs = ids
	}
	r, err = move(opts, true)
	return r, true, err
}
