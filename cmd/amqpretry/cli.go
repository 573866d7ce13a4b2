package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/ops"
)

// defaultURI is the broker URI when AMQP_URI is unset.
const defaultURI = ops.DefaultURI

// cli holds what every command shares.
type cli struct {
	ctx            context.Context
	stdout, stderr io.Writer
	uri            string

	// common flags
	json        bool
	backend     string
	prefix      string
	tiers       string
	levels      int
	poisonQueue string
}

// flags returns a FlagSet with the common flags.
func (c *cli) flags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet("amqpretry "+name, flag.ContinueOnError)
	fs.SetOutput(c.stderr)
	fs.BoolVar(&c.json, "json", false, "machine-readable output (JSON)")
	fs.StringVar(&c.backend, "backend", delay.BackendTTLTiers, "delay backend: ttl-tiers, binary-levels or delayed-exchange")
	fs.StringVar(&c.prefix, "prefix", delay.DefaultPrefix, "prefix of every queue and exchange")
	fs.StringVar(&c.tiers, "tiers", "", "ttl-tiers: comma-separated tiers (default 1s,5s,30s,2m,10m,1h)")
	fs.IntVar(&c.levels, "levels", delay.DefaultLevels, "binary-levels: number of levels")
	fs.StringVar(&c.poisonQueue, "poison-queue", "", "poison queue (default <prefix>.poison)")
	return fs
}

// parse parses args with fs, allowing flags after positional arguments.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var rest []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, fmt.Errorf("%w: %w", errUsage, err)
		}
		if fs.NArg() == 0 {
			return rest, nil
		}
		rest = append(rest, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

// config builds the ops configuration from the common flags.
func (c *cli) config() (ops.Config, error) {
	cfg := ops.Config{
		URI:         c.uri,
		Delay:       delay.Config{Backend: c.backend, Prefix: c.prefix, Levels: c.levels},
		PoisonQueue: c.poisonQueue,
	}
	if c.tiers != "" {
		for _, s := range strings.Split(c.tiers, ",") {
			d, err := time.ParseDuration(strings.TrimSpace(s))
			if err != nil {
				return cfg, fmt.Errorf("%w: --tiers: %w", errUsage, err)
			}
			cfg.Delay.Tiers = append(cfg.Delay.Tiers, d)
		}
	}
	if err := cfg.Validate(); err != nil {
		return cfg, fmt.Errorf("%w: %w", errUsage, err)
	}
	return cfg, nil
}

// open connects.
func (c *cli) open() (*ops.Ops, error) {
	cfg, err := c.config()
	if err != nil {
		return nil, err
	}
	return ops.New(cfg)
}

// redact hides the URI's password in s.
func (c *cli) redact(s string) string { return ops.RedactIn(s, c.uri) }

// fail prints err, redacted, as JSON or text.
func (c *cli) fail(err error) {
	msg := c.redact(err.Error())
	if c.json {
		_ = json.NewEncoder(c.stdout).Encode(map[string]string{"error": msg})
		return
	}
	fmt.Fprintln(c.stderr, "amqpretry:", msg)
}

// emit writes v as indented JSON.
func (c *cli) emit(v any) error {
	enc := json.NewEncoder(c.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// printf writes to stdout.
func (c *cli) printf(format string, args ...any) { fmt.Fprintf(c.stdout, format, args...) }

// filterFlags adds the filter flags to fs.
func filterFlags(fs *flag.FlagSet, f *ops.Filter) {
	fs.StringVar(&f.Queue, "queue", "", "only messages that failed on this queue")
	fs.StringVar(&f.Reason, "reason", "", "only this poison reason: permanent, max-attempts, delay-too-long")
	fs.StringVar(&f.Error, "error", "", "only messages whose error contains this text")
	fs.DurationVar(&f.OlderThan, "older-than", 0, "only messages that failed longer ago than this")
	fs.DurationVar(&f.NewerThan, "newer-than", 0, "only messages that failed more recently than this")
	fs.Func("id", "only this message (Watermill UUID or AMQP message id); repeat for more", func(s string) error {
		f.IDs = append(f.IDs, s)
		return nil
	})
}

// rateFlag parses "N/s", "N/m" or "N" (per second).
type rateFlag float64

func (r *rateFlag) String() string { return strconv.FormatFloat(float64(*r), 'f', -1, 64) + "/s" }

func (r *rateFlag) Set(s string) error {
	per := time.Second
	switch {
	case strings.HasSuffix(s, "/s"):
		s = strings.TrimSuffix(s, "/s")
	case strings.HasSuffix(s, "/m"):
		s, per = strings.TrimSuffix(s, "/m"), time.Minute
	}
	n, err := strconv.ParseFloat(s, 64)
	if err != nil || n < 0 {
		return fmt.Errorf("want N/s or N/m with N >= 0, got %q", s)
	}
	*r = rateFlag(n / per.Seconds())
	return nil
}

// isTerminal tells whether w is a character device (a TTY).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// progress reports a long run on stderr: a bar on a TTY, a line of counts per second
// otherwise.
type progress struct {
	w     io.Writer
	tty   bool
	verb  string
	start time.Time
	last  time.Time
	p     ops.Progress
}

func (c *cli) progress(verb string) *progress {
	return &progress{w: c.stderr, tty: isTerminal(c.stderr), verb: verb, start: time.Now()}
}

// update redraws the bar at most every 100 ms, or prints counts at most every second;
// nothing for a run shorter than that.
func (p *progress) update(pr ops.Progress) {
	p.p = pr
	every := time.Second
	if p.tty {
		every = 100 * time.Millisecond
	}
	since := p.last
	if since.IsZero() {
		since = p.start
	}
	if time.Since(since) < every {
		return
	}
	p.last = time.Now()
	p.draw(false)
}

func (p *progress) draw(final bool) {
	pr := p.p
	if p.tty {
		const width = 30
		filled := 0
		if pr.Depth > 0 {
			filled = min(width, pr.Scanned*width/pr.Depth)
		}
		fmt.Fprintf(p.w, "\r[%s%s] %d/%d scanned, %d %s, %d skipped, %d unroutable ",
			strings.Repeat("#", filled), strings.Repeat(".", width-filled), pr.Scanned, pr.Depth, pr.Done, p.verb, pr.Skipped, pr.Unroutable)
		if final {
			fmt.Fprintln(p.w)
		}
		return
	}
	if pr.Scanned == 0 && !final {
		return
	}
	fmt.Fprintf(p.w, "progress: %d/%d scanned, %d %s, %d skipped, %d unroutable\n", pr.Scanned, pr.Depth, pr.Done, p.verb, pr.Skipped, pr.Unroutable)
}

// done prints the last state of a run that printed progress.
func (p *progress) done() {
	if !p.last.IsZero() {
		p.draw(true)
	}
}

// ago formats the time since t.
func ago(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339) + " (" + short(time.Since(t)) + " ago)"
}

// short formats d briefly.
func short(d time.Duration) string {
	switch {
	case d < 0:
		return "-" + short(-d)
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	case d < 24*time.Hour:
		return d.Round(time.Second).String()
	}
	return fmt.Sprintf("%dd%s", d/(24*time.Hour), (d % (24 * time.Hour)).Round(time.Minute))
}

// clip cuts s to n runes.
func clip(s string, n int) string {
	r := []rune(strings.ReplaceAll(s, "\n", " "))
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}
