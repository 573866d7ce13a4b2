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
show and asks for confirmation (y/N, on stderr): y or yes goes on, any other answer
changes nothing (exit status 1); when stdin is not a terminal (a script, a pipe) it
refuses without --yes (exit status 2), before it connects. --yes confirms in advance;
--dry-run shows what it would do and changes nothing.`

// shownNames is how many names of queues or exchanges a line lists before "… and N
// more"; --verbose lists them all.
const shownNames = 3

// nameList lists names on one line: with --verbose all of them, else the first few
// and how many more.
func (a *app) nameList(names []string) string {
	if a.verbose || len(names) <= shownNames+1 {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s, … and %d more", strings.Join(names[:shownNames], ", "), len(names)-shownNames)
}

// verboseFlag adds --verbose to a command whose output names queues or exchanges.
func (a *app) verboseFlag(c *cobra.Command) {
	c.Flags().BoolVar(&a.verbose, "verbose", false, fmt.Sprintf("name every queue and exchange (default: the first %d of a list, and how many more)", shownNames))
}

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

// confirmFirst asks before a destructive run, on a terminal (mayDestroy has refused
// the run already when there is none to ask on, unless --yes): it runs preview (the
// run as a dry run); a preview that fails, or that has nothing to do (nothing, when
// set), is the command's result, with nothing to ask (proceed false). Otherwise it
// shows the preview (show prints it on stderr) and asks question: proceed tells the
// answer was yes; any other answer is errDeclined (exit status 1), nothing changed.
// It is the one prompt of every destructive command (purge, teardown, blocked release).
func confirmFirst[R any](a *app, preview func() (R, error), nothing func(R) bool, show func(R), question func(R) string) (r R, proceed bool, err error) {
	r, err = preview()
	if err != nil || nothing != nil && nothing(r) {
		return r, false, err
	}
	show(r)
	ok, err := a.ask(question(r))
	if err != nil {
		return r, false, err
	}
	if !ok {
		return r, false, errDeclined
	}
	return r, true, nil
}

// confirmMove runs the move (purge) of opts after the user has confirmed it: with
// --yes at once; otherwise (on a terminal) it first runs it as a dry run, shows that on
// stderr, and asks (confirmFirst). The run then acts on what was shown: at most as
// many messages, and, when each shown one has an id, only those. A dry run that
// matched nothing is the command's result: there is nothing to ask. move runs opts,
// showing its progress when told; confirmed tells the run acted on what was shown.
func (a *app) confirmMove(yes bool, opts ops.MoveOptions, move func(opts ops.MoveOptions, progress bool) (ops.MoveResult, error),
	question func(ops.MoveResult) string, show func(ops.MoveResult)) (r ops.MoveResult, confirmed bool, err error) {
	if yes || opts.DryRun {
		r, err = move(opts, true)
		return r, false, err
	}
	dry := opts
	dry.DryRun = true
	preview, proceed, err := confirmFirst(a, func() (ops.MoveResult, error) { return move(dry, false) },
		func(r ops.MoveResult) bool { return r.Matched == 0 }, show, question)
	if !proceed {
		return preview, false, err
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
