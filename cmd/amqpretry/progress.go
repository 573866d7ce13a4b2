package main

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/amqpretry/amqpretry/ops"
)

// progress reports a long redrive or purge on stderr: a progress bar on a terminal, a
// line of counts a second otherwise; nothing for a run shorter than a second.
type progress struct {
	w     io.Writer
	tty   bool
	doing string
	verb  string
	start time.Time
	last  time.Time
	r     ops.MoveResult
	bar   *progressbar.ProgressBar
}

func newProgress(w io.Writer, doing, verb string) *progress {
	return &progress{w: w, tty: isTerminal(w), doing: doing, verb: verb, start: time.Now()}
}

// isTerminal tells whether f (stdin, stderr) is a terminal: not merely a character
// device, which /dev/null is too.
func isTerminal(f any) bool {
	file, ok := f.(*os.File)
	return ok && term.IsTerminal(int(file.Fd()))
}

// update takes the result so far (ops.MoveOptions.Progress).
func (p *progress) update(r ops.MoveResult) {
	p.r = r
	if time.Since(p.start) < time.Second {
		return
	}
	every := time.Second
	if p.tty {
		every = 100 * time.Millisecond
	}
	if time.Since(p.last) >= every {
		p.last = time.Now()
		if p.tty {
			p.draw()
		} else {
			p.line()
		}
	}
}

func (p *progress) draw() {
	if p.bar == nil {
		p.bar = progressbar.NewOptions(p.r.Depth,
			progressbar.OptionSetWriter(p.w),
			progressbar.OptionSetDescription(p.doing),
			progressbar.OptionShowCount(),
			progressbar.OptionSetWidth(30),
			progressbar.OptionOnCompletion(func() { fmt.Fprintln(p.w) }),
		)
	}
	p.bar.Describe(fmt.Sprintf("%s: %d %s, %d skipped, %d unroutable", p.doing, p.r.Done, p.verb, p.r.Skipped, p.r.Unroutable))
	_ = p.bar.Set(p.r.Scanned)
}

func (p *progress) line() {
	r := p.r
	fmt.Fprintf(p.w, "progress: %d/%d scanned, %d %s, %d skipped, %d unroutable\n", r.Scanned, r.Depth, r.Done, p.verb, r.Skipped, r.Unroutable)
}

// done prints the last state of a run that showed progress.
func (p *progress) done() {
	switch {
	case p.bar != nil:
		p.draw()
		if !p.bar.IsFinished() {
			_ = p.bar.Exit() // keeps the bar where the run stopped; a newline
		}
	case !p.last.IsZero():
		p.line()
	}
}
