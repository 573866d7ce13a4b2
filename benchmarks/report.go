package main

import (
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/amqpretry/amqpretry/delay"
)

// report is everything a run measured: the JSON figures and the details behind them,
// for the table and the plot.
type report struct {
	results  Results
	sz       sizes
	mode     string
	broker   string // RabbitMQ version
	elapsed  time.Duration
	tp       *throughputDetail
	rp       *retryPathDetail
	ceil     *ceilingDetail
	lateness []namedLateness
	// latenessSkipped are the backends that could not be built.
	latenessSkipped []string
	headOfLine      []namedValue
	rss             *rssDetail
	order           *orderFigures
	failures        []error
}

// plotted tells whether a scenario of the plot ran.
func (r *report) plotted() bool {
	return r.tp != nil || r.ceil != nil || r.rp != nil || len(r.lateness)+len(r.latenessSkipped) > 0 || len(r.headOfLine) > 0
}

type namedLateness struct {
	name string
	d    *latenessDetail
}

type namedValue struct {
	name  string
	value float64
}

func (r *report) noteFailure(err error) { r.failures = append(r.failures, err) }

// latenessGoal is the p99 goal per backend, in ms; 0 means none.
func latenessGoal(backend string) float64 {
	switch backend {
	case delay.TTLTiers().Name(), delay.DelayedExchange().Name():
		return 100
	case delay.BinaryLevels(0).Name():
		return 1000
	}
	return 0
}

func met(ok bool) string {
	if ok {
		return "yes"
	}
	return "NO"
}

func (r *report) table() string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "figure\tvalue\tgoal\tmet\tmeasured")
	if r.tp != nil {
		for i, t := range r.tp.sets {
			name, vsName := "healthy_throughput_ratio", "vs_inprocess_retry"
			goal, vsGoal := ">= 0.8", ">= 100"
			ok, vsOK := met(t.healthyRatio() >= 0.8), met(t.vsInprocess() >= 100)
			if i > 0 { // not the figure: shown for comparison
				name = fmt.Sprintf("  same, %d handlers (not in JSON)", t.handlers)
				vsName = name
				goal, vsGoal, ok, vsOK = "", "", "", ""
			}
			fmt.Fprintf(w, "%s\t%.3f\t%s\t%s\t%.0f msg/s never-failing with 10%% failing twice vs %.0f msg/s without failures (%d msgs, %d handler(s), prefetch 1)\n",
				name, t.healthyRatio(), goal, ok, t.healthyRate, t.noFailRate, t.n, t.handlers)
			scaled := ""
			if t.inprocN != t.n {
				scaled = fmt.Sprintf("; in-process side scaled to %d msgs, same 10%% mix", t.inprocN)
			}
			fmt.Fprintf(w, "%s\t%.1f\t%s\t%s\tsteady state (messages %.0f%%-%.0f%% done), median of %d rounds %s: broker retry %s msg/s vs Watermill middleware.Retry %s msg/s (%d handler(s)%s); whole runs, round 1: %.0f vs %.1f msg/s, ratio %.1f\n",
				vsName, t.vsInprocess(), vsGoal, vsOK, 100*steadyFrom, 100*steadyTo, len(t.oursSteady), spread(t.vsInprocessRounds(), 1),
				joinf(t.oursSteady, 0), joinf(t.inprocSteady, 1), t.handlers, scaled, t.oursHandledRate, t.inprocHandledRate, t.vsInprocessWhole())
			if i == 0 {
				fmt.Fprintf(w, "  the same with the ceiling middleware\t%.1f\t\t\tits bound: steady-state msg/s of the ceiling middleware in the same rounds %s over in-process (median of the rounds' ratios)\n",
					t.ceilingVsInprocess(), joinf(t.ceilSteady, 0))
			}
		}
	}
	if r.ceil != nil {
		for _, row := range r.ceil.rows {
			fmt.Fprintf(w, "healthy_ceiling_ratio %s\t%.3f\t>= 0.9\t%s\thealthy msg/s, means of %d rounds: ours %.0f vs ceiling %.0f (per round: %s vs %s); plain amqp091-go consumer %.0f (%s) (%d msgs, 1 handler, %s handler work)\n",
				row.key(), row.ratio(), met(row.ratio() >= 0.9), len(row.ours), mean(row.ours), mean(row.ceiling),
				joinf(row.ours, 0), joinf(row.ceiling, 0), mean(row.plain), joinf(row.plain, 0), row.n, row.work)
		}
	}
	if v := r.results.RetryPathRatio; v != nil && r.rp != nil {
		fmt.Fprintf(w, "retry_path_ratio\t%.3f\t>= 0.9\t%s\t%.0f retries scheduled/s vs %.0f/s raw amqp091-go confirmed publish+consume+ack into a tier-like queue (medians of %d rounds, %d msgs, %d consumers, 1 confirm channel)\n",
			*v, met(*v >= 0.9), r.rp.oursRate, r.rp.rawRate, len(r.rp.rawRates), r.rp.n, r.rp.concurrency)
		fmt.Fprintf(w, "  vs raw into a classic queue (not in JSON)\t%.3f\t\t\t%.0f/s raw amqp091-go into a plain durable classic queue\n",
			r.rp.oursRate/r.rp.classicRate, r.rp.classicRate)
		fmt.Fprintf(w, "  vs router + ceiling middleware (not in JSON)\t%.3f\t\t\t%.0f/s the same router with the ceiling middleware (per round: ours %s, ceiling %s, raw %s); router + ceiling vs raw %.3f\n",
			r.rp.oursRate/r.rp.ceilingRate, r.rp.ceilingRate, joinf(r.rp.oursRates, 0), joinf(r.rp.ceilingRates, 0), joinf(r.rp.rawRates, 0), r.rp.ceilingRate/r.rp.rawRate)
		fmt.Fprintf(w, "  vs router + ceiling carrying our envelope (not in JSON)\t%.3f\t\t\t%.0f/s the same, each copy with our copy's %d headers (%d bytes on the wire), mandatory, with a MessageId (per round: %s); it vs router + ceiling %.3f (what the envelope costs), vs raw %.3f\n",
			r.rp.oursRate/r.rp.envelopeRate, r.rp.envelopeRate, r.rp.envelopeN, r.rp.envelopeBytes, joinf(r.rp.envelopeRates, 0), r.rp.envelopeRate/r.rp.ceilingRate, r.rp.envelopeRate/r.rp.rawRate)
	}
	for _, name := range benchBackends() {
		key := "lateness_ms " + name
		switch v := r.results.LatenessMS[name].(type) {
		case quantiles:
			goal, ok := "-", "-"
			if g := latenessGoal(name); g > 0 {
				goal, ok = fmt.Sprintf("p99 <= %.0f", g), met(v.P99 <= g)
			}
			fmt.Fprintf(w, "%s\tp99 %.1f\t%s\t%s\tp50 %.1f, p95 %.1f, max %.1f ms over %d retries of 1-10 s\n",
				key, v.P99, goal, ok, v.P50, v.P95, v.Max, r.sz.latenessN)
		case skipped:
			fmt.Fprintf(w, "%s\tskipped\t\t\t%s\n", key, short(v.Skipped))
		case map[string]string:
			fmt.Fprintf(w, "%s\tfailed\t\t\t%s\n", key, short(v["error"]))
		}
	}
	keys := append(benchBackends(), baselineKey(r.sz.baselineDelay))
	for _, name := range keys {
		key := "head_of_line_ms " + name
		switch v := r.results.HeadOfLineMS[name].(type) {
		case float64:
			fmt.Fprintf(w, "%s\t%.1f\t-\t-\t1 s retry behind %d retries of %s\n", key, v, r.sz.holLong, tierName(r.longFor(name)))
		case skipped:
			fmt.Fprintf(w, "%s\tskipped\t\t\t%s\n", key, short(v.Skipped))
		case map[string]string:
			fmt.Fprintf(w, "%s\tfailed\t\t\t%s\n", key, short(v["error"]))
		}
	}
	if v := r.results.RSSGrowthMB; v != nil && r.rss != nil {
		fmt.Fprintf(w, "rss_growth_mb\t%.1f\t< 20\t%s\tVmRSS %.1f -> %.1f MiB after GC, %d retries waiting in ttl-tiers\n",
			*v, met(*v < 20), r.rss.before, r.rss.after, r.rss.n)
	}
	if r.order != nil {
		orderTable(func(format string, a ...any) { fmt.Fprintf(w, format, a...) }, r.order)
	}
	_ = w.Flush()
	fmt.Fprintf(&b, "\n%s mode, RabbitMQ %s, %d CPUs, run time %s\n", r.mode, r.broker, numCPU(), r.elapsed.Round(time.Second))
	if r.tp != nil {
		for _, t := range r.tp.sets {
			fmt.Fprintf(&b, "%d handler(s): no-failure runs %.0f and %.0f msg/s; mean gap between failed attempts 1->2, 2->3: broker retry %s, %s (includes the queue ahead of the retry); in-process %s, %s (policy 100 ms, 200 ms)\n",
				t.handlers, t.noFailRates[0], t.noFailRates[1],
				t.oursGaps[0].Round(time.Millisecond), t.oursGaps[1].Round(time.Millisecond),
				t.inprocGaps[0].Round(time.Millisecond), t.inprocGaps[1].Round(time.Millisecond))
		}
	}
	for _, err := range r.failures {
		fmt.Fprintf(&b, "failure: %v\n", err)
	}
	return b.String()
}

// joinf formats xs with the given digits, separated by slashes.
func joinf(xs []float64, digits int) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = strconv.FormatFloat(x, 'f', digits, 64)
	}
	return strings.Join(parts, "/")
}

// spread says how far the values of xs lie from their median, in percent.
func spread(xs []float64, digits int) string {
	m := median(xs)
	lo, hi := slices.Min(xs), slices.Max(xs)
	return fmt.Sprintf("%s (%+.1f%% .. %+.1f%% of the median)", joinf(xs, digits), 100*(lo/m-1), 100*(hi/m-1))
}

func (r *report) longFor(key string) time.Duration {
	if key == baselineKey(r.sz.baselineDelay) {
		return r.sz.baselineDelay
	}
	return r.sz.holLongDelay
}

// short cuts a reason for the table, without the quoted names; the JSON keeps it whole.
func short(s string) string {
	const n = 140
	s = quoted.ReplaceAllString(s, `"…"`)
	if len(s) <= n {
		return s
	}
	return s[:n] + "… (full text in the JSON)"
}

var quoted = regexp.MustCompile(`"[^"]*"`)
