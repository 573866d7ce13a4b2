package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// RabbitMQ 4.3 (issue 16 §5, -broker43 URI): a failed delivery settled by a confirmed
// copy (what every copying backend does) against one RabbitMQ 4.3 holds in the work
// queue itself (a quorum queue with x-delayed-retry-type=returned: nack with requeue,
// the broker keeps the message aside for x-delayed-retry-min and redelivers it).
//
// Every work queue of this suite is a quorum queue with x-delayed-retry-type=returned,
// -min and -max 1 ms (native43Delay) unless a scenario says otherwise, whatever
// settles the failures on it, so that queue type and arguments are the same on both
// sides of every ratio. Messages are prefilled (confirmed) before the consumer starts;
// a run's rate is its messages over the time from the first handler call (or delivery)
// to the last success.
//
//   - raw loop: one serial amqp091-go consumer at prefetch 1 and 50, 3,000 messages each
//     failing once. copy: on the first delivery publish a copy back to the queue on a
//     confirm channel of a second connection, wait for the confirm, ack; ack the copy.
//     native: nack the first delivery with requeue, ack it when it comes back.
//     native-always: nack every delivery; the rate is nacks per second (the retry
//     path without any success).
//   - library: one Watermill router, wamqp3 (watermill-amqp v3, Consume.Qos.PrefetchCount
//     1 or 50), the same messages. delayed-retry: Config{Backend:
//     delay.DelayedRetry(1ms)}; two-stage: Config{Backend: delay.HeldRetries(1, 1ms, ttl-tiers with one
//     1 ms tier)}; ttl-tiers: the copying backend, one 1 ms tier; ceiling-copy:
//     the ceiling middleware of ceiling.go (a confirmed copy to the same tier, nothing
//     else) with the ttl-tiers subscriber; ceiling-envelope: the same carrying the
//     envelope of one of our copies, mandatory and with a MessageId as ours are
//     (envelope43: ttl-tiers ÷ it is our code's cost without the envelope's bytes);
//     only with -kinds43, ceiling-packed: the same envelope as one JSON header
//     (packed43), and ceiling-lean: an envelope of three fields (lean43), what a
//     smaller envelope on the wire would cost;
//     ceiling-native: a middleware that only nacks a failed message (what the
//     delayed-retry backend's hand-off is), no other code.
//     Mixes: storm (every message fails once), storm2 (twice: two-stage's second retry
//     is copied), healthy (every tenth fails twice; the never-failing messages' rate),
//     always (every call fails; retries settled per second).
//   - vs_inprocess_retry: the throughput scenario's mix (every tenth message fails
//     twice) at prefetch 50, one handler: delayed-retry with a 100 ms delay against
//     Watermill's middleware.Retry (100 ms, x2), steady-state handled msg/s, median of
//     the rounds' ratios.
//   - lateness: 1,000 messages published at 200 a second, each failing once, held 1 s
//     (delayed-retry, prefetch 50); lateness is what the middleware observes
//     (amqpretry.EventDelivered: arrival minus the nack time plus the delay).
//   - concurrency: 1, 4 and 16 handlers (one subscription each, prefetch 1): the
//     healthy and storm mixes, ttl-tiers against ceiling-copy and delayed-retry against
//     ceiling-native.

const native43Delay = time.Millisecond

// native43N is the messages of every run of the suite (-n43); handlers43 and
// prefetch43 the handler counts of the concurrency step and the prefetches of the
// prefetch step (-handlers43, -prefetch43).
var (
	native43N  = 3000
	handlers43 = []int{1, 4, 16}
	prefetch43 = []int{1, 50}
	// kinds43 restricts the prefetch step to these "kind/mix" (and "raw", the raw
	// loops), -kinds43 (parseKinds43); nil runs the raw loops and prefetchKinds43.
	kinds43 []string
	// prefetchKinds43 are the prefetch step's kinds; namedKinds43 run only when
	// -kinds43 names them.
	prefetchKinds43 = []string{
		"delayed-retry/storm", "two-stage/storm", "two-stage/storm2", "ttl-tiers/storm",
		"ceiling-copy/storm", "ceiling-envelope/storm", "ceiling-native/storm", "delayed-retry/always",
	}
	namedKinds43 = []string{"ceiling-packed/storm", "ceiling-lean/storm"}
)

// parseKinds43 reads -kinds43: nil for "", else the kinds named, each "raw" or one of
// prefetchKinds43 and namedKinds43; an unknown one is refused, naming those.
func parseKinds43(s string) ([]string, error) {
	if s == "" {
		return nil, nil
	}
	known := slices.Concat([]string{"raw"}, prefetchKinds43, namedKinds43)
	var out []string
	for _, k := range strings.Split(s, ",") {
		k = strings.TrimSpace(k)
		if !slices.Contains(known, k) {
			return nil, fmt.Errorf("-kinds43: unknown kind %q; use some of %s", k, strings.Join(known, ","))
		}
		out = append(out, k)
	}
	return out, nil
}

// results43 is the JSON of the 4.3 suite.
type results43 struct {
	Broker string `json:"broker"`
	// RawLoop: per prefetch ("1", "50"), per mode, msg/s (median of the rounds).
	RawLoop map[string]map[string]float64 `json:"raw_loop_msg_per_s"`
	// NativeOverCopy: per prefetch, raw native ÷ raw copy.
	NativeOverCopy map[string]float64 `json:"raw_native_over_copy"`
	// Library: per prefetch, per "kind/mix", msg/s (always: retries/s), medians.
	Library map[string]map[string]float64 `json:"library_msg_per_s"`
	// LibraryOverRawNative: per prefetch, per "kind/mix", ÷ the raw native loop
	// (storm: native; always: native-always).
	LibraryOverRawNative map[string]map[string]float64 `json:"library_over_raw_native"`
	// CPUPer1000: per prefetch, per "kind/mix", the CPU milliseconds per 1,000
	// messages of this process ("client") and of the broker ("broker", with
	// -broker43pid), medians of the rounds (cpu.go).
	CPUPer1000 map[string]map[string]map[string]float64 `json:"cpu_ms_per_1000,omitempty"`
	// CopyStormRounds: per prefetch, the rounds' ratios of ttl-tiers/storm over
	// ceiling-copy/storm and over ceiling-envelope/storm, each against the run next
	// to it in the same round; CopyStorm their medians.
	CopyStormRounds map[string]map[string][]float64 `json:"copy_storm_ratio_rounds,omitempty"`
	CopyStorm       map[string]map[string]float64   `json:"copy_storm_ratio,omitempty"`
	// VsInprocessRetry: delayed-retry (100 ms) ÷ Watermill's middleware.Retry at
	// prefetch 50, steady state, median of the rounds.
	VsInprocessRetry       *float64  `json:"vs_inprocess_retry"`
	VsInprocessRetryRounds []float64 `json:"vs_inprocess_retry_rounds"`
	// VsInprocessRetryCeiling: the same with the native ceiling (a router whose
	// middleware only nacks) in place of ours, in the same rounds: its bound.
	VsInprocessRetryCeiling *float64 `json:"vs_inprocess_retry_ceiling"`
	// VsInprocessRates: per round, ours/ceiling/in-process steady-state msg/s.
	VsInprocessRates []string `json:"vs_inprocess_rates"`
	// NativeLatenessMS: arrival of a held retry minus its due time (nack + 1 s).
	NativeLatenessMS *quantiles `json:"native_lateness_ms"`
	// RawNativeLatenessMS: the same workload on a raw amqp091-go consumer (nack time
	// plus the delay to the redelivery): the broker's own precision. TimerLatenessMS:
	// a Go timer of the same delay in this process, at the same pace: what the machine
	// alone adds.
	RawNativeLatenessMS *quantiles `json:"raw_native_lateness_ms"`
	TimerLatenessMS     *quantiles `json:"timer_lateness_ms"`
	// Concurrency: per handlers ("1", "4", "16"), per "kind/mix", msg/s (medians), and
	// the ratios ours ÷ ceiling.
	Concurrency map[string]map[string]float64 `json:"concurrency_msg_per_s"`
	// ConcurrencyRatio: the median of the rounds' ratios, each ours ÷ its ceiling run
	// next to it in the same round (ConcurrencyRatioRounds).
	ConcurrencyRatio       map[string]map[string]float64   `json:"concurrency_ratio"`
	ConcurrencyRatioRounds map[string]map[string][]float64 `json:"concurrency_ratio_rounds"`
	// RetryPath: the existing retry-path experiment (16 handlers, ttl-tiers) on this
	// broker in the same run.
	RetryPath   map[string]float64 `json:"retry_path"`
	Rounds      int                `json:"rounds"`
	LoadAverage []string           `json:"load_average"`
	Goals       []goal43           `json:"goals"`
}

type goal43 struct {
	Figure string  `json:"figure"`
	Value  float64 `json:"value"`
	Goal   string  `json:"goal"`
	Met    bool    `json:"met"`
}

// samples collects the rounds of one figure.
type samples map[string][]float64

func (s samples) add(k string, v float64) { s[k] = append(s[k], v) }

func (s samples) medians() map[string]float64 {
	out := map[string]float64{}
	for k, v := range s {
		out[k] = round(median(v), 1)
	}
	return out
}

// run43 runs the 4.3 suite against e's broker.
func run43(ctx context.Context, e *env, rounds int, only string) (*results43, string, error) {
	want := func(name string) bool {
		if only == "" {
			return true
		}
		for _, s := range strings.Split(only, ",") {
			if strings.TrimSpace(s) == name {
				return true
			}
		}
		return false
	}
	res := &results43{Broker: e.brokerVersion(), Rounds: rounds, RawLoop: map[string]map[string]float64{},
		NativeOverCopy: map[string]float64{}, Library: map[string]map[string]float64{}, LibraryOverRawNative: map[string]map[string]float64{},
		Concurrency: map[string]map[string]float64{}, ConcurrencyRatio: map[string]map[string]float64{},
		CPUPer1000: map[string]map[string]map[string]float64{}, CopyStormRounds: map[string]map[string][]float64{}, CopyStorm: map[string]map[string]float64{},
		ConcurrencyRatioRounds: map[string]map[string][]float64{}}
	var log strings.Builder
	say := func(format string, args ...any) {
		line := fmt.Sprintf(format, args...)
		fmt.Print(line)
		log.WriteString(line)
	}
	res.LoadAverage = append(res.LoadAverage, loadAverage())
	var errs []error
	step := func(name string, f func() error) {
		if !want(name) || ctx.Err() != nil {
			return
		}
		t0 := time.Now()
		say("== %s (load average %s)\n", name, loadAverage())
		if err := f(); err != nil {
			say("   FAILED: %v\n", err)
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
			e.reg.markUnsure()
		}
		say("   (%s)\n", time.Since(t0).Round(100*time.Millisecond))
		if err := e.cleanup(false); err != nil {
			errs = append(errs, fmt.Errorf("%s: cleanup: %w", name, err))
		}
	}

	// Raw loop and library, prefetch 1 and 50, the kinds alternating within a round,
	// in ABBA order.
	step("prefetch", func() error {
		runs := func(k string) bool {
			if kinds43 == nil {
				return k == "raw" || slices.Contains(prefetchKinds43, k)
			}
			return slices.Contains(kinds43, k)
		}
		kinds := slices.Concat(prefetchKinds43, namedKinds43)
		for _, prefetch := range prefetch43 {
			raw, lib, client, broker := samples{}, samples{}, samples{}, samples{}
			ratios := samples{}
			for r := range rounds {
				if runs("raw") {
					for _, mode := range []string{"copy", "native", "native-always"} {
						rate, err := e.rawLoop43(ctx, mode, prefetch, native43N, r)
						if err != nil {
							return fmt.Errorf("raw %s, prefetch %d: %w", mode, prefetch, err)
						}
						raw.add(mode, rate)
					}
				}
				order := slices.Clone(kinds)
				if r%2 == 1 {
					slices.Reverse(order) // ABBA: no kind always runs first
				}
				for _, k := range order {
					if !runs(k) {
						continue
					}
					kind, mix, _ := strings.Cut(k, "/")
					rate, cpu, err := e.router43(ctx, run43opts{kind: kind, mix: mix, prefetch: prefetch, handlers: 1, n: native43N, round: r})
					if err != nil {
						return fmt.Errorf("%s, prefetch %d: %w", k, prefetch, err)
					}
					lib.add(k, rate)
					if c, b := cpu.per1000(native43N); c > 0 {
						client.add(k, c)
						if b > 0 {
							broker.add(k, b)
						}
					}
				}
				if ours, c := lib["ttl-tiers/storm"], lib["ceiling-copy/storm"]; len(ours) > r && len(c) > r {
					ratios.add("over_ceiling_copy", last(ours)/last(c))
					if ce := lib["ceiling-envelope/storm"]; len(ce) > r {
						ratios.add("over_ceiling_envelope", last(ours)/last(ce))
						ratios.add("ceiling_envelope_over_copy", last(ce)/last(c))
					}
				}
				line := fmt.Sprintf("   prefetch %d, round %d:", prefetch, r+1)
				if runs("raw") {
					line += fmt.Sprintf(" raw copy %.0f, native %.0f, native-always %.0f msg/s;", last(raw["copy"]), last(raw["native"]), last(raw["native-always"]))
				}
				say("%s %s\n", line, lastOf(lib))
				if len(client) > 0 {
					say("     CPU ms per 1,000 messages, client: %s\n", lastOf(client))
				}
				if len(broker) > 0 {
					say("     CPU ms per 1,000 messages, broker: %s\n", lastOf(broker))
				}
			}
			p := fmt.Sprint(prefetch)
			res.Library[p] = lib.medians()
			if len(raw) > 0 {
				res.RawLoop[p] = raw.medians()
				res.NativeOverCopy[p] = round(res.RawLoop[p]["native"]/res.RawLoop[p]["copy"], 2)
			}
			if len(client) > 0 {
				res.CPUPer1000[p] = map[string]map[string]float64{}
				for k, v := range client.medians() {
					res.CPUPer1000[p][k] = map[string]float64{"client": v}
				}
				for k, v := range broker.medians() {
					res.CPUPer1000[p][k]["broker"] = v
				}
			}
			if len(ratios) > 0 {
				res.CopyStormRounds[p] = map[string][]float64{}
				res.CopyStorm[p] = map[string]float64{}
				for k, v := range ratios {
					for _, x := range v {
						res.CopyStormRounds[p][k] = append(res.CopyStormRounds[p][k], round(x, 3))
					}
					res.CopyStorm[p][k] = round(median(v), 3)
				}
			}
			over := map[string]float64{}
			for k, v := range res.Library[p] {
				ref := res.RawLoop[p]["native"]
				if strings.HasSuffix(k, "/always") {
					ref = res.RawLoop[p]["native-always"]
				}
				if ref > 0 {
					over[k] = round(v/ref, 3)
				}
			}
			res.LibraryOverRawNative[p] = over
		}
		return nil
	})

	// The existing retry-path experiment (retrypath.go: 16 handlers, ttl-tiers copies,
	// raw loop, router + ceiling) on this broker, in the same run.
	step("retrypath", func() error {
		rep := &report{}
		if err := runRetryPath(ctx, e, rep); err != nil {
			return err
		}
		res.RetryPath = map[string]float64{
			"ours_retries_per_s": round(rep.rp.oursRate, 0), "raw_per_s": round(rep.rp.rawRate, 0),
			"router_ceiling_per_s": round(rep.rp.ceilingRate, 0), "ceiling_with_envelope_per_s": round(rep.rp.envelopeRate, 0),
			"retry_path_ratio": round(rep.rp.oursRate/rep.rp.rawRate, 3), "ours_over_router_ceiling": round(rep.rp.oursRate/rep.rp.ceilingRate, 3),
		}
		return nil
	})

	step("vsinprocess", func() error {
		var ratios, ceilRatios []float64
		for r := range rounds + 1 {
			ours, err := e.router43stats(ctx, run43opts{kind: "delayed-retry", mix: "healthy", prefetch: 50, handlers: 1, n: e.sz.throughputN, round: r, delay: 100 * time.Millisecond})
			if err != nil {
				return err
			}
			inproc, err := e.router43stats(ctx, run43opts{kind: "inprocess", mix: "healthy", prefetch: 50, handlers: 1, n: e.sz.inprocessN, round: r})
			if err != nil {
				return err
			}
			ceil, err := e.router43stats(ctx, run43opts{kind: "ceiling-native", mix: "healthy", prefetch: 50, handlers: 1, n: e.sz.throughputN, round: r, delay: 100 * time.Millisecond})
			if err != nil {
				return err
			}
			ratio, ceilRatio := ours.steadyRate()/inproc.steadyRate(), ceil.steadyRate()/inproc.steadyRate()
			ratios, ceilRatios = append(ratios, ratio), append(ceilRatios, ceilRatio)
			res.VsInprocessRates = append(res.VsInprocessRates, fmt.Sprintf("%.0f/%.0f/%.1f", ours.steadyRate(), ceil.steadyRate(), inproc.steadyRate()))
			say("   round %d: delayed-retry %.0f msg/s, native ceiling %.0f msg/s, Watermill middleware.Retry %.1f msg/s (steady state): ratios %.1f, ceiling %.1f\n",
				r+1, ours.steadyRate(), ceil.steadyRate(), inproc.steadyRate(), ratio, ceilRatio)
		}
		for _, x := range ratios {
			res.VsInprocessRetryRounds = append(res.VsInprocessRetryRounds, round(x, 1))
		}
		res.VsInprocessRetry = ptr(round(median(ratios), 1))
		res.VsInprocessRetryCeiling = ptr(round(median(ceilRatios), 1))
		return nil
	})

	step("lateness", func() error {
		q, err := e.lateness43(ctx, 1000, 200, time.Second)
		if err != nil {
			return err
		}
		res.NativeLatenessMS = &q
		say("   held retries (1 s), lateness: p50 %.1f, p95 %.1f, p99 %.1f, max %.1f ms\n", q.P50, q.P95, q.P99, q.Max)
		raw, err := e.rawLateness43(ctx, 1000, 200, time.Second)
		if err != nil {
			return err
		}
		res.RawNativeLatenessMS = &raw
		say("   raw amqp091-go, nack to redelivery minus 1 s: p50 %.1f, p95 %.1f, p99 %.1f, max %.1f ms\n", raw.P50, raw.P95, raw.P99, raw.Max)
		tq := timerLateness(1000, 200, time.Second)
		res.TimerLatenessMS = &tq
		say("   a Go timer of 1 s in this process: p50 %.1f, p95 %.1f, p99 %.1f, max %.1f ms\n", tq.P50, tq.P95, tq.P99, tq.Max)
		return nil
	})

	step("concurrency", func() error {
		for _, handlers := range handlers43 {
			s, paired := samples{}, samples{}
			for r := range rounds {
				for _, mix := range []string{"healthy", "storm"} {
					for _, pair := range [][2]string{{"ttl-tiers", "ceiling-copy"}, {"delayed-retry", "ceiling-native"}} {
						order := []string{pair[0], pair[1]}
						if r%2 == 1 {
							order = []string{pair[1], pair[0]}
						}
						for _, kind := range order {
							rate, _, err := e.router43(ctx, run43opts{kind: kind, mix: mix, prefetch: 1, handlers: handlers, n: native43N, round: r})
							if err != nil {
								return fmt.Errorf("%s/%s, %d handlers: %w", kind, mix, handlers, err)
							}
							s.add(kind+"/"+mix, rate)
						}
						paired.add(pair[0]+"/"+mix, last(s[pair[0]+"/"+mix])/last(s[pair[1]+"/"+mix]))
					}
				}
				say("   %d handler(s), round %d: %s\n", handlers, r+1, lastOf(s))
			}
			h := fmt.Sprint(handlers)
			res.Concurrency[h] = s.medians()
			res.ConcurrencyRatio[h] = map[string]float64{}
			res.ConcurrencyRatioRounds[h] = map[string][]float64{}
			for k, v := range paired {
				res.ConcurrencyRatio[h][k] = round(median(v), 3)
				for _, x := range v {
					res.ConcurrencyRatioRounds[h][k] = append(res.ConcurrencyRatioRounds[h][k], round(x, 3))
				}
			}
		}
		return nil
	})
	res.LoadAverage = append(res.LoadAverage, loadAverage())
	res.Goals = goals43(res)
	return res, log.String(), errors.Join(errs...)
}

func lastOf(s samples) string {
	keys := make([]string, 0, len(s))
	for k := range s {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %.0f", k, last(s[k])))
	}
	return strings.Join(parts, ", ")
}

func goals43(r *results43) []goal43 {
	var g []goal43
	for _, p := range []string{"1", "50"} {
		for _, k := range []string{"delayed-retry/storm", "two-stage/storm", "delayed-retry/always"} {
			if v, ok := r.LibraryOverRawNative[p][k]; ok {
				g = append(g, goal43{fmt.Sprintf("library %s ÷ raw native loop, prefetch %s", k, p), v, ">= 0.8", v >= 0.8})
			}
		}
	}
	if r.VsInprocessRetry != nil {
		g = append(g, goal43{"vs_inprocess_retry, delayed-retry, prefetch 50", *r.VsInprocessRetry, ">= 100", *r.VsInprocessRetry >= 100})
	}
	if r.NativeLatenessMS != nil {
		g = append(g, goal43{"native lateness p99 beyond the delay, ms", r.NativeLatenessMS.P99, "<= 20", r.NativeLatenessMS.P99 <= 20})
	}
	for _, k := range []string{"ttl-tiers/healthy", "ttl-tiers/storm", "delayed-retry/healthy", "delayed-retry/storm"} {
		if v, ok := r.ConcurrencyRatio["16"][k]; ok {
			g = append(g, goal43{"16 handlers, " + k + " ÷ ceiling", v, ">= 0.9", v >= 0.9})
		}
	}
	return g
}

// table43 renders the figures.
func table43(r *results43) string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "RabbitMQ %s, %d rounds (medians), load average %s\n", r.Broker, r.Rounds, strings.Join(r.LoadAverage, " -> "))
	for _, p := range []string{"1", "50"} {
		if r.Library[p] == nil {
			continue
		}
		if r.RawLoop[p] != nil {
			fmt.Fprintf(w, "prefetch %s\traw copy %.0f\traw native %.0f (x%.2f)\traw native-always %.0f\n", p, r.RawLoop[p]["copy"], r.RawLoop[p]["native"], r.NativeOverCopy[p], r.RawLoop[p]["native-always"])
		} else {
			fmt.Fprintf(w, "prefetch %s\t(no raw loops)\n", p)
		}
		for _, k := range sortedKeys(r.Library[p]) {
			fmt.Fprintf(w, "  %s\t%.0f msg/s", k, r.Library[p][k])
			if v, ok := r.LibraryOverRawNative[p][k]; ok {
				fmt.Fprintf(w, "\t÷ raw native %.3f", v)
			}
			fmt.Fprintln(w, "\t")
		}
		if cs := r.CopyStorm[p]; cs != nil {
			fmt.Fprintf(w, "  copy storm, medians of the rounds' ratios: ttl-tiers ÷ ceiling-copy %.3f, ÷ ceiling-envelope %.3f; ceiling-envelope ÷ ceiling-copy %.3f\t\n",
				cs["over_ceiling_copy"], cs["over_ceiling_envelope"], cs["ceiling_envelope_over_copy"])
		}
		for _, k := range sortedKeys(r.CPUPer1000[p]) {
			fmt.Fprintf(w, "  CPU ms per 1,000 messages, %s\tclient %.0f\tbroker %.0f\t\n", k, r.CPUPer1000[p][k]["client"], r.CPUPer1000[p][k]["broker"])
		}
		if c := r.Library[p]["ceiling-copy/storm"]; c > 0 {
			fmt.Fprintf(w, "  copy storm: ttl-tiers ÷ ceiling-copy %.3f", r.Library[p]["ttl-tiers/storm"]/c)
			if ce := r.Library[p]["ceiling-envelope/storm"]; ce > 0 {
				fmt.Fprintf(w, ", ÷ ceiling-envelope %.3f; ceiling-envelope ÷ ceiling-copy %.3f", r.Library[p]["ttl-tiers/storm"]/ce, ce/c)
			}
			fmt.Fprintln(w, "\t")
		}
	}
	if rp := r.RetryPath; rp != nil {
		fmt.Fprintf(w, "retry path, 16 handlers (retrypath.go)\tours (ttl-tiers) %.0f/s\trouter + ceiling %.0f/s\traw %.0f/s\tours ÷ raw %.3f, ÷ router + ceiling %.3f\n",
			rp["ours_retries_per_s"], rp["router_ceiling_per_s"], rp["raw_per_s"], rp["retry_path_ratio"], rp["ours_over_router_ceiling"])
	}
	if r.VsInprocessRetry != nil {
		fmt.Fprintf(w, "vs_inprocess_retry (delayed-retry 100ms, prefetch 50)\t%.1f\trounds %v\tours/ceiling/in-process msg/s %s\n", *r.VsInprocessRetry, r.VsInprocessRetryRounds, strings.Join(r.VsInprocessRates, " "))
		if r.VsInprocessRetryCeiling != nil {
			fmt.Fprintf(w, "  the same with the native ceiling (router, nack only)\t%.1f\t\t\n", *r.VsInprocessRetryCeiling)
		}
	}
	for _, l := range []struct {
		name string
		q    *quantiles
	}{{"native lateness, library (1 s delay)", r.NativeLatenessMS}, {"  raw amqp091-go, same workload", r.RawNativeLatenessMS}, {"  a Go timer of 1 s, same pace", r.TimerLatenessMS}} {
		if q := l.q; q != nil {
			fmt.Fprintf(w, "%s\tp50 %.1f\tp95 %.1f\tp99 %.1f\tmax %.1f ms\n", l.name, q.P50, q.P95, q.P99, q.Max)
		}
	}
	for _, h := range []string{"1", "4", "16"} { // those measured
		if r.Concurrency[h] == nil {
			continue
		}
		fmt.Fprintf(w, "%s handler(s)", h)
		for _, k := range sortedKeys(r.Concurrency[h]) {
			fmt.Fprintf(w, "\t%s %.0f", k, r.Concurrency[h][k])
		}
		fmt.Fprintf(w, "\n  ratios")
		for _, k := range sortedKeys(r.ConcurrencyRatio[h]) {
			fmt.Fprintf(w, "\t%s %.3f", k, r.ConcurrencyRatio[h][k])
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w, "goal\tvalue\twant\tmet")
	for _, g := range r.Goals {
		met := "yes"
		if !g.Met {
			met = "NO"
		}
		fmt.Fprintf(w, "%s\t%.3f\t%s\t%s\n", g.Figure, g.Value, g.Goal, met)
	}
	_ = w.Flush()
	return b.String()
}

func sortedKeys[V any](m map[string]V) []string {
	return slices.Sorted(maps.Keys(m))
}

// workQueueArgs43 are the arguments of every work queue of the suite.
func workQueueArgs43(d time.Duration) amqp.Table { return backend.WorkQueueArgs(d) }

// rawLoop43 is the raw amqp091-go loop: mode copy, native or native-always.
func (e *env) rawLoop43(ctx context.Context, mode string, prefetch, n, round int) (float64, error) {
	conn, err := e.dial()
	if err != nil {
		return 0, err
	}
	defer conn.Close() //nolint:errcheck
	pubConn, err := e.dial()
	if err != nil {
		return 0, err
	}
	defer pubConn.Close() //nolint:errcheck
	q := e.name("r43", fmt.Sprintf("raw-%s-p%d-%d", mode, prefetch, round))
	if err := e.declare(conn, topology.Topology{Queues: []topology.Queue{{Name: q, Args: workQueueArgs43(native43Delay)}}}); err != nil {
		return 0, err
	}
	if err := prefill(ctx, conn, q, benchMessages("raw43", n)); err != nil {
		return 0, err
	}
	pub, err := pubConn.Channel()
	if err == nil {
		err = pub.Confirm(false)
	}
	if err != nil {
		return 0, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Qos(prefetch, 0, false)
	}
	var deliveries <-chan amqp.Delivery
	if err == nil {
		deliveries, err = ch.Consume(q, "", false, false, false, false, nil)
	}
	if err != nil {
		return 0, err
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	runCtx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	seen := make(map[string]bool, n)
	var first time.Time
	done := 0
	for done < n {
		var d amqp.Delivery
		select {
		case <-runCtx.Done():
			return 0, fmt.Errorf("raw %s: %d of %d within 3 minutes: %w", mode, done, n, runCtx.Err())
		case dv, open := <-deliveries:
			if !open {
				select {
				case cerr := <-closed:
					return 0, fmt.Errorf("raw %s: consumer channel closed after %d of %d: %v", mode, done, n, cerr)
				case <-time.After(time.Second):
				}
				return 0, fmt.Errorf("raw %s: deliveries closed after %d of %d", mode, done, n)
			}
			d = dv
		}
		if first.IsZero() {
			first = time.Now()
		}
		id := d.MessageId
		if id == "" {
			id, _ = d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
		}
		switch {
		case mode == "native-always":
			err = d.Nack(false, true)
			done++
		case seen[id]:
			err = d.Ack(false)
			done++
		case mode == "native":
			seen[id] = true
			err = d.Nack(false, true)
		default: // copy
			seen[id] = true
			var dc *amqp.DeferredConfirmation
			dc, err = pub.PublishWithDeferredConfirmWithContext(runCtx, "", q, false, false, amqp.Publishing{
				Headers: d.Headers, Body: d.Body, DeliveryMode: amqp.Persistent, MessageId: d.MessageId,
			})
			if err == nil {
				var ok bool
				if ok, err = dc.WaitContext(runCtx); err == nil && !ok {
					err = errors.New("publish nacked")
				}
			}
			if err == nil {
				err = d.Ack(false)
			}
		}
		if err != nil {
			return 0, err
		}
	}
	rate := float64(n) / time.Since(first).Seconds()
	_ = ch.Close()
	return rate, nil
}

// run43opts is one router run of the 4.3 suite.
type run43opts struct {
	kind     string // delayed-retry, two-stage, ttl-tiers, ceiling-copy, ceiling-native, inprocess
	mix      string // storm, storm2, healthy, always
	prefetch int
	handlers int
	n        int
	round    int
	delay    time.Duration // the held retries' delay and the copies' tier; default native43Delay
	observe  func(amqpretry.Event)
	// outer, if set, is the router's outermost middleware (around the retry).
	outer message.HandlerMiddleware
}

var run43Seq atomic.Int64

// router43 runs o and returns its rate: the never-failing messages' for healthy,
// retries settled per second for always, all messages' otherwise.
func (e *env) router43(ctx context.Context, o run43opts) (float64, cpuUse, error) {
	if o.mix == "always" {
		rate, err := e.routerAlways43(ctx, o)
		return rate, cpuUse{}, err
	}
	st, err := e.router43stats(ctx, o)
	if err != nil {
		return 0, cpuUse{}, err
	}
	if o.mix == "healthy" {
		return st.healthyRate(), st.cpu, nil
	}
	return st.handledRate(), st.cpu, nil
}

// setup43 declares and fills the work queue of o and returns the router with o's
// middleware and subscriber, ready to take handlers.
func (e *env) setup43(ctx context.Context, o run43opts, msgs []*message.Message) (topic string, router *message.Router, sub message.Subscriber, closeAll func(), err error) {
	if o.delay == 0 {
		o.delay = native43Delay
	}
	var closers []func()
	closeAll = func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	defer func() {
		if err != nil {
			closeAll()
		}
	}()
	conn, err := e.dial()
	if err != nil {
		return "", nil, nil, closeAll, err
	}
	closers = append(closers, func() { _ = conn.Close() })
	seq := run43Seq.Add(1)
	topic = e.name("r43", fmt.Sprintf("%s-%s-h%d-p%d-%d", o.kind, o.mix, o.handlers, o.prefetch, seq))
	amqpCfg := wamqp.NewDurableQueueConfig(e.uri)
	amqpCfg.Consume.Qos.PrefetchCount = o.prefetch
	amqpCfg.Queue.Arguments = workQueueArgs43(o.delay)

	router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return "", nil, nil, closeAll, err
	}
	if o.outer != nil {
		router.AddMiddleware(o.outer)
	}
	subCfg := amqpCfg
	switch o.kind {
	case "delayed-retry", "two-stage", "ttl-tiers", "ceiling-copy", "ceiling-envelope", "ceiling-packed", "ceiling-lean", "ceiling-native":
		prefix := e.name("r43", fmt.Sprintf("d%d", seq))
		rcfg := amqpretry.Config{Prefix: prefix, PoisonQueue: prefix + ".poison", Observe: o.observe}
		switch o.kind {
		case "delayed-retry", "ceiling-native":
			rcfg.Backend = delay.DelayedRetry(o.delay)
			rcfg.Policy = amqpretry.Policy{MaxAttempts: 100}
		default:
			rcfg.Backend = delay.TTLTiers(o.delay)
			rcfg.Policy = amqpretry.Policy{MaxAttempts: 100, Delays: []time.Duration{o.delay}, Jitter: -1}
			if o.kind == "two-stage" {
				rcfg.Backend = delay.HeldRetries(1, o.delay, rcfg.Backend)
			}
		}
		e.reg.queue(rcfg.PoisonQueue) // whatever Plan says
		if plan, perr := rcfg.Plan(topic); perr == nil {
			e.reg.topology(plan)
		}
		r, rerr := wamqp3.New(amqpCfg, rcfg)
		if rerr != nil {
			return "", nil, nil, closeAll, rerr
		}
		closers = append(closers, func() { _ = r.Close() })
		subCfg = r.SubscriberConfig()
		envelope, ceiling := ceilingEnvelopes43[o.kind]
		switch {
		case ceiling:
			c, cerr := e.newCeiling(prefix, []time.Duration{o.delay})
			if cerr != nil {
				return "", nil, nil, closeAll, cerr
			}
			if envelope != nil {
				c.envelope = envelope(topic, o.delay)
			}
			closers = append(closers, c.close)
			router.AddMiddleware(c.middleware)
		case o.kind == "ceiling-native":
			// The delayed-retry subscriber (its marshaler reads the int headers 4.3
			// adds on redelivery, which watermill-amqp's DefaultMarshaler refuses),
			// and nothing but the settlement that backend makes: nack, requeue. No
			// Retry middleware on purpose: the marshaler's guard, which refuses a
			// message its handler failed without one, is left out.
			if m, ok := subCfg.Marshaler.(marshal.Marshaler); ok {
				m.Guard = nil
				subCfg.Marshaler = m
			}
			router.AddMiddleware(nackOnError)
		default:
			router.AddMiddleware(r.Middleware)
		}
	case "inprocess":
		router.AddMiddleware(inprocessPolicy.Middleware)
	default:
		return "", nil, nil, closeAll, fmt.Errorf("unknown kind %q", o.kind)
	}
	// The work queue as the subscriber declares it, then the messages.
	if err := e.declare(conn, topology.Topology{Queues: []topology.Queue{{Name: topic, Args: subCfg.Queue.Arguments}}}); err != nil {
		return "", nil, nil, closeAll, err
	}
	if err := prefill(ctx, conn, topic, msgs); err != nil {
		return "", nil, nil, closeAll, fmt.Errorf("prefill %s: %w", topic, err)
	}
	s, err := wamqp.NewSubscriber(subCfg, watermill.NopLogger{})
	if err != nil {
		return "", nil, nil, closeAll, err
	}
	closers = append(closers, func() { _ = s.Close() })
	return topic, router, s, closeAll, nil
}

// ceilingEnvelopes43 are the copying ceilings' kinds, each with the headers its copy
// adds (nil: none, the bare copy).
var ceilingEnvelopes43 = map[string]func(topic string, delay time.Duration) amqp.Table{
	"ceiling-copy":     nil,
	"ceiling-envelope": envelope43,
	"ceiling-packed":   packed43,
	"ceiling-lean":     lean43,
}

// envelope43 is the envelope our ttl-tiers copy of a storm message carries (its
// first failure, on topic, retried after delay), written by middleware.Envelope: what
// the ceiling-envelope kind adds to the ceiling's copy (mandatory, with a MessageId,
// as ours), so that ours ÷ it is what our code costs beside the envelope's bytes.
func envelope43(topic string, delay time.Duration) amqp.Table {
	return headers43(stormEnvelope43(topic, delay))
}

// stormEnvelope43 is the envelope of our ttl-tiers copy of a storm message.
func stormEnvelope43(topic string, delay time.Duration) middleware.Envelope {
	now := time.Now()
	return middleware.Envelope{
		Attempt: 2, Error: errPlanned.Error(), ErrorTypes: []string{fmt.Sprintf("%T", errPlanned)},
		FirstFailure: now, LastFailure: now, Handler: "bench-0", Topic: topic, Queue: topic,
		OriginalRoutingKey: topic, RequestedDelay: delay, EffectiveDelay: delay, Due: now.Add(delay),
	}
}

// headers43 is env as the headers Write gives it.
func headers43(env middleware.Envelope) amqp.Table {
	md := message.Metadata{}
	env.Write(md)
	t := amqp.Table{}
	for k, v := range md {
		t[k] = v
	}
	return t
}

// packed43 is envelope43's envelope in one header, as JSON (its struct tags): the
// ceiling-packed kind, what the same facts cost in one header instead of twelve.
func packed43(topic string, delay time.Duration) amqp.Table {
	b, err := json.Marshal(stormEnvelope43(topic, delay))
	if err != nil {
		panic(err) // a struct of strings, times and numbers
	}
	return amqp.Table{"amqpretry-envelope": string(b)}
}

// lean43 is an envelope of three fields, the attempt, the first failure and the due
// time: the ceiling-lean kind, what a retry copy carrying only those would cost.
func lean43(_ string, delay time.Duration) amqp.Table {
	now := time.Now()
	return headers43(middleware.Envelope{Attempt: 2, FirstFailure: now, Due: now.Add(delay)})
}

// messages43 are the messages of a mix: every one marked failing (storm, storm2,
// always), or every tenth (healthy).
func messages43(mix string, n int) []*message.Message {
	if mix == "healthy" {
		return throughputMessages(brokerRetry, n)
	}
	msgs := benchMessages("s43", n)
	for _, m := range msgs {
		m.Metadata.Set(failKey, "1")
	}
	return msgs
}

// router43stats runs a mix with successes (storm, storm2, healthy) to the end.
func (e *env) router43stats(ctx context.Context, o run43opts) (*runStats, error) {
	topic, router, sub, closeAll, err := e.setup43(ctx, o, messages43(o.mix, o.n))
	if err != nil {
		return nil, err
	}
	defer closeAll()
	st := newRunStats(o.n, 0)
	switch o.mix {
	case "storm":
		st.failTimes = 1
	case "storm2", "healthy":
		st.failTimes = 2
	}
	for i := range o.handlers {
		router.AddConsumerHandler(fmt.Sprintf("bench-%d", i), topic, sub, st.handle)
	}
	runErr := make(chan error, 1)
	cpu0 := cpuNow()
	go func() { runErr <- router.Run(ctx) }()
	timeout := time.Minute + time.Duration(o.n)*100*time.Millisecond
	select {
	case <-st.finished:
		st.cpu = cpuNow().since(cpu0)
	case err := <-runErr:
		return nil, fmt.Errorf("router stopped: %w", err)
	case <-ctx.Done():
	case <-time.After(timeout):
	}
	if err := router.Close(); err != nil {
		return nil, err
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if len(st.done) < o.n {
		return nil, fmt.Errorf("%s/%s: %d of %d messages handled within %s", o.kind, o.mix, len(st.done), o.n, timeout)
	}
	return st, nil
}

// routerAlways43: every handler call fails; the rate is retries settled (the
// middleware returned nil) per second, over o.n of them.
func (e *env) routerAlways43(ctx context.Context, o run43opts) (float64, error) {
	var (
		mu        sync.Mutex
		first     time.Time
		lastAt    time.Time
		scheduled int
		finished  = make(chan struct{})
	)
	// count is the outermost middleware: a nil error from inside is a settled retry.
	o.outer = func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			mu.Lock()
			if first.IsZero() {
				first = time.Now()
			}
			mu.Unlock()
			out, err := h(msg)
			if err == nil {
				mu.Lock()
				if scheduled++; scheduled == o.n {
					lastAt = time.Now()
					close(finished)
				}
				mu.Unlock()
			}
			return out, err
		}
	}
	topic, router, sub, closeAll, err := e.setup43(ctx, o, messages43(o.mix, o.n))
	if err != nil {
		return 0, err
	}
	defer closeAll()
	fail := func(*message.Message) error { return errPlanned }
	for i := range o.handlers {
		router.AddConsumerHandler(fmt.Sprintf("bench-%d", i), topic, sub, fail)
	}
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	select {
	case <-finished:
	case err := <-runErr:
		return 0, fmt.Errorf("router stopped: %w", err)
	case <-ctx.Done():
	case <-time.After(3 * time.Minute):
	}
	if err := router.Close(); err != nil {
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	mu.Lock()
	defer mu.Unlock()
	if scheduled < o.n {
		return 0, fmt.Errorf("%d of %d retries settled", scheduled, o.n)
	}
	return float64(o.n) / lastAt.Sub(first).Seconds(), nil
}

// lateness43 publishes n messages at rate a second to a delayed-retry work queue
// (prefetch 50, delay d), each failing once, and returns the lateness the middleware
// observes for the held retries.
func (e *env) lateness43(ctx context.Context, n, rate int, d time.Duration) (quantiles, error) {
	var mu sync.Mutex
	var late []time.Duration
	o := run43opts{kind: "delayed-retry", mix: "storm", prefetch: 50, handlers: 1, n: n, delay: d, observe: func(ev amqpretry.Event) {
		if ev.Kind == amqpretry.EventDelivered && ev.Late {
			mu.Lock()
			late = append(late, ev.Lateness)
			mu.Unlock()
		}
	}}
	topic, router, sub, closeAll, err := e.setup43(ctx, o, nil)
	if err != nil {
		return quantiles{}, err
	}
	defer closeAll()
	st := newRunStats(n, 0)
	st.failTimes = 1
	router.AddConsumerHandler("bench-0", topic, sub, st.handle)
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case <-time.After(30 * time.Second):
		return quantiles{}, errors.New("router not running after 30 s")
	}
	conn, err := e.dial()
	if err != nil {
		return quantiles{}, err
	}
	defer conn.Close() //nolint:errcheck
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		return quantiles{}, err
	}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for i, msg := range messages43("storm", n) {
		<-tick.C
		p, err := wamqp.DefaultMarshaler{}.Marshal(msg)
		if err != nil {
			return quantiles{}, err
		}
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", topic, false, false, p)
		if err != nil {
			return quantiles{}, fmt.Errorf("publish %d: %w", i, err)
		}
		_ = dc // confirmed in bulk below; the pace is what matters
	}
	timeout := time.Minute + d
	select {
	case <-st.finished:
	case err := <-runErr:
		return quantiles{}, fmt.Errorf("router stopped: %w", err)
	case <-ctx.Done():
		return quantiles{}, ctx.Err()
	case <-time.After(timeout):
		return quantiles{}, fmt.Errorf("lateness: not every message done within %s", timeout)
	}
	if err := router.Close(); err != nil {
		return quantiles{}, err
	}
	mu.Lock()
	defer mu.Unlock()
	if len(late) != n {
		return quantiles{}, fmt.Errorf("lateness observed for %d held retries, want %d", len(late), n)
	}
	return quantilesOf(late), nil
}

// loadAverage is the machine's 1, 5 and 15 minute load average.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], "/")
}

// nackOnError is the native ceiling: a failed message is nacked (requeued, for the
// broker to hold), nothing else.
func nackOnError(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err != nil {
			msg.Nack()
			return nil, nil
		}
		return out, nil
	}
}

// rawLateness43 is lateness43's workload on a raw amqp091-go consumer (prefetch 50):
// nack each message on its first delivery, and measure its redelivery against the
// nack time plus d.
func (e *env) rawLateness43(ctx context.Context, n, rate int, d time.Duration) (quantiles, error) {
	conn, err := e.dial()
	if err != nil {
		return quantiles{}, err
	}
	defer conn.Close() //nolint:errcheck
	q := e.name("r43", "raw-lateness")
	if err := e.declare(conn, topology.Topology{Queues: []topology.Queue{{Name: q, Args: workQueueArgs43(d)}}}); err != nil {
		return quantiles{}, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Qos(50, 0, false)
	}
	var deliveries <-chan amqp.Delivery
	if err == nil {
		deliveries, err = ch.Consume(q, "", false, false, false, false, nil)
	}
	if err != nil {
		return quantiles{}, err
	}
	runCtx, cancel := context.WithTimeout(ctx, time.Minute+time.Duration(n)*time.Second/time.Duration(rate)+d)
	defer cancel()
	result := make(chan error, 1)
	var late []time.Duration
	go func() {
		nacked := make(map[string]time.Time, n)
		for len(late) < n {
			var dv amqp.Delivery
			select {
			case <-runCtx.Done():
				result <- fmt.Errorf("raw lateness: %d of %d: %w", len(late), n, runCtx.Err())
				return
			case x, open := <-deliveries:
				if !open {
					result <- errors.New("deliveries closed")
					return
				}
				dv = x
			}
			now := time.Now()
			id, _ := dv.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
			var err error
			if at, ok := nacked[id]; ok {
				late = append(late, now.Sub(at.Add(d)))
				err = dv.Ack(false)
			} else {
				nacked[id] = time.Now()
				err = dv.Nack(false, true)
			}
			if err != nil {
				result <- err
				return
			}
		}
		result <- nil
	}()
	pub, err := conn.Channel()
	if err != nil {
		return quantiles{}, err
	}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for _, msg := range benchMessages("rawlat", n) {
		<-tick.C
		p, err := wamqp.DefaultMarshaler{}.Marshal(msg)
		if err == nil {
			err = pub.PublishWithContext(runCtx, "", q, false, false, p)
		}
		if err != nil {
			return quantiles{}, err
		}
	}
	if err := <-result; err != nil {
		return quantiles{}, err
	}
	return quantilesOf(late), nil
}

// timerLateness starts n Go timers of d at rate a second and returns how late they
// fire: the scheduling delay of this process on this machine, with no broker.
func timerLateness(n, rate int, d time.Duration) quantiles {
	late := make([]time.Duration, n)
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for i := range n {
		<-tick.C
		wg.Add(1)
		due := time.Now().Add(d)
		time.AfterFunc(d, func() {
			late[i] = time.Since(due)
			wg.Done()
		})
	}
	wg.Wait()
	return quantilesOf(late)
}
