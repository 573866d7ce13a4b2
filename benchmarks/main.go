// Command benchmarks measures the broker-side retry middleware against a real RabbitMQ
// and writes the figures of issue 4 as JSON, a table and a PNG plot.
//
//	cd benchmarks && go run . -quick -json results/quick.json
//
// The broker is AMQP_URI (default amqp://guest:guest@127.0.0.1:5672/). Every queue and
// exchange the program declares starts with a prefix unique to the run and is deleted
// when it ends, also on error or interrupt.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/amqpretry/amqpretry/delay"
)

const defaultURI = "amqp://guest:guest@127.0.0.1:5672/"

// Results holds exactly the figures of the issue; it is the JSON file.
type Results struct {
	HealthyThroughputRatio *float64       `json:"healthy_throughput_ratio"`
	VsInprocessRetry       *float64       `json:"vs_inprocess_retry"`
	RetryPathRatio         *float64       `json:"retry_path_ratio"`
	LatenessMS             map[string]any `json:"lateness_ms"`
	HeadOfLineMS           map[string]any `json:"head_of_line_ms"`
	RSSGrowthMB            *float64       `json:"rss_growth_mb"`
}

// skipped is the entry of a backend that could not be built on this broker.
type skipped struct {
	Skipped string `json:"skipped"`
}

// sizes are the scenario sizes; quick mode shrinks the slow ones only.
type sizes struct {
	throughputN int // messages per throughput run (ours and no-failure)
	// throughputHandlers: the handler counts of the throughput runs; the JSON figures
	// are those at 1 handler.
	throughputHandlers []int
	inprocessN         int           // messages of the in-process retry run
	retryPathN         int           // messages per retry-path run
	concurrency        int           // handlers (ours) and consumer goroutines (raw) on the retry path
	latenessN          int           // retries per backend, delays 1-10 s
	holLong            int           // long retries ahead of the probe
	holLongDelay       time.Duration // their delay, backends
	baselineDelay      time.Duration // their delay, per-message-TTL baseline
	rssN               int           // messages waiting in delay for the RSS figure
	publishWorkers     int           // goroutines scheduling retries through a backend
}

func modeSizes(quick bool) sizes {
	s := sizes{
		throughputN:        5000,
		throughputHandlers: []int{1, 4},
		inprocessN:         5000,
		retryPathN:         5000,
		concurrency:        16,
		latenessN:          1000,
		holLong:            1000,
		holLongDelay:       10 * time.Minute,
		baselineDelay:      10 * time.Minute,
		rssN:               100_000,
		publishWorkers:     16,
	}
	if quick {
		// In-process retry sleeps 300 ms per failing message inside the one handler:
		// 5,000 messages would take 150 s. 1,000 keep the 10% mix and take 30 s.
		s.inprocessN = 1000
		// The baseline queue releases nothing until its head expires.
		s.baselineDelay = 20 * time.Second
	}
	return s
}

func main() {
	quick := flag.Bool("quick", false, "quick mode: in-process retry on 1,000 messages, head-of-line baseline behind 20 s (under 5 minutes)")
	jsonPath := flag.String("json", "", "write the figures as JSON to this file")
	pngPath := flag.String("png", "", "write the plot here (default: beside -json, else results/quick.png or results/full.png)")
	textPath := flag.String("text", "", "also write the results table to this file (default: beside -json, with .txt)")
	only := flag.String("only", "", "comma-separated scenarios to run (throughput,retrypath,lateness,headofline,rss); default all")
	concurrency := flag.Int("concurrency", 16, "handlers (broker retry) and consumer goroutines (raw loop) on the retry path")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of this process to this file")
	handlers := flag.String("throughput-handlers", "1,4", "handler counts of the throughput runs; the JSON figures are those at 1")
	flag.Parse()

	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = defaultURI
	}
	mode := "full"
	if *quick {
		mode = "quick"
	}
	switch {
	case *pngPath != "":
	case *jsonPath != "":
		*pngPath = strings.TrimSuffix(*jsonPath, ".json") + ".png"
	default:
		*pngPath = filepath.Join("results", mode+".png")
	}
	if *textPath == "" && *jsonPath != "" {
		*textPath = strings.TrimSuffix(*jsonPath, ".json") + ".txt"
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	sz := modeSizes(*quick)
	sz.concurrency = max(*concurrency, 1)
	sz.throughputHandlers = nil
	for _, f := range strings.Split(*handlers, ",") {
		k, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || k < 1 {
			fmt.Fprintf(os.Stderr, "-throughput-handlers: %q is not a positive number\n", f)
			os.Exit(2)
		}
		sz.throughputHandlers = append(sz.throughputHandlers, k)
	}
	e := &env{
		uri:    uri,
		prefix: fmt.Sprintf("amqpretry-bench.%s.%d", time.Now().UTC().Format("150405"), os.Getpid()),
		reg:    &registry{},
		sz:     sz,
		mode:   mode,
	}
	// A second interrupt, or a scenario that ignores the first, still gets the broker
	// cleaned: after a grace period the watchdog deletes everything and exits.
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
		case <-done:
			return
		}
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			fmt.Fprintln(os.Stderr, "interrupted: deleting the run's queues and exchanges")
			_ = e.cleanup(true)
			os.Exit(130)
		}
	}()

	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "cpuprofile:", err)
			os.Exit(2)
		}
	}
	started := time.Now()
	fmt.Printf("amqpretry benchmarks, %s mode, broker %s, names %s.*\n", mode, delay.Redact(uri), e.prefix)
	fmt.Printf("delay backends: %s\n\n", strings.Join(delay.Backends(), ", "))

	rep, runErr := run(ctx, e, *only)
	rep.elapsed = time.Since(started)
	pprof.StopCPUProfile() // a no-op without -cpuprofile
	close(done)
	cleanErr := e.cleanup(true) // a last sweep, whatever happened

	text := rep.table()
	fmt.Print("\n" + text)
	var errs []error
	if runErr != nil {
		errs = append(errs, runErr)
	}
	if cleanErr != nil {
		errs = append(errs, fmt.Errorf("cleanup: %w", cleanErr))
	}
	if *textPath != "" {
		if err := os.WriteFile(*textPath, []byte(text), 0o644); err != nil {
			errs = append(errs, err)
		} else {
			fmt.Printf("wrote %s\n", *textPath)
		}
	}
	if *jsonPath != "" {
		if err := writeJSON(*jsonPath, rep.results); err != nil {
			errs = append(errs, err)
		} else {
			fmt.Printf("wrote %s\n", *jsonPath)
		}
	}
	if err := plotReport(*pngPath, rep); err != nil {
		errs = append(errs, fmt.Errorf("plot: %w", err))
	} else {
		fmt.Printf("wrote %s\n", *pngPath)
	}
	if err := errors.Join(errs...); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

// run runs the scenarios in order. A failed scenario leaves its figures null and the
// others still run; the errors are returned together.
func run(ctx context.Context, e *env, only string) (*report, error) {
	rep := &report{results: Results{LatenessMS: map[string]any{}, HeadOfLineMS: map[string]any{}}, sz: e.sz, mode: e.mode, broker: e.brokerVersion()}
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
	scenarios := []struct {
		name string
		run  func(context.Context, *env, *report) error
	}{
		{"throughput", runThroughput},
		{"retrypath", runRetryPath},
		{"lateness", runLateness},
		{"headofline", runHeadOfLine},
		{"rss", runRSS},
	}
	var errs []error
	for _, s := range scenarios {
		if !want(s.name) {
			continue
		}
		if ctx.Err() != nil {
			errs = append(errs, fmt.Errorf("%s: not run: %w", s.name, ctx.Err()))
			continue
		}
		start := time.Now()
		fmt.Printf("== %s\n", s.name)
		if err := s.run(ctx, e, rep); err != nil {
			fmt.Printf("   FAILED: %v\n", err)
			errs = append(errs, fmt.Errorf("%s: %w", s.name, err))
			e.reg.markUnsure()
		}
		fmt.Printf("   (%s)\n", time.Since(start).Round(100*time.Millisecond))
		// Each scenario's queues go as soon as it is done, so the next one runs on a
		// broker that holds none of them.
		if err := e.cleanup(e.reg.takeUnsure()); err != nil {
			errs = append(errs, fmt.Errorf("%s: cleanup: %w", s.name, err))
		}
	}
	return rep, errors.Join(errs...)
}

func writeJSON(path string, r Results) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
