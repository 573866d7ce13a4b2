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
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/amqpretry/amqpretry/internal/redact"
)

const defaultURI = "amqp://guest:guest@127.0.0.1:5672/"

// Results has exactly the figures of the issue; it is the JSON file.
type Results struct {
	HealthyThroughputRatio *float64 `json:"healthy_throughput_ratio"`
	// HealthyCeilingRatio: per handler work ("0ms", "1ms"), healthy msg/s with our
	// middleware over that with the ceiling middleware (ceiling.go).
	HealthyCeilingRatio map[string]float64 `json:"healthy_ceiling_ratio"`
	// VsInprocessRetry: the median of the rounds' steady-state ratios,
	// VsInprocessRetryRounds.
	VsInprocessRetry       *float64  `json:"vs_inprocess_retry"`
	VsInprocessRetryRounds []float64 `json:"vs_inprocess_retry_rounds"`
	// VsInprocessRetryCeiling: the same median with the ceiling middleware (ceiling.go)
	// in place of ours, measured in the same rounds: what bounds VsInprocessRetry.
	VsInprocessRetryCeiling *float64       `json:"vs_inprocess_retry_ceiling"`
	RetryPathRatio          *float64       `json:"retry_path_ratio"`
	LatenessMS              map[string]any `json:"lateness_ms"`
	HeadOfLineMS            map[string]any `json:"head_of_line_ms"`
	RSSGrowthMB             *float64       `json:"rss_growth_mb"`
	// Order: issue 48's projection, ordered, unordered and in-process (order.go).
	Order *orderFigures `json:"order,omitempty"`
	// Brokers: with -also, every broker's figures under its version (the top level
	// is AMQP_URI's).
	Brokers map[string]*Results `json:"brokers,omitempty"`
}

// current is the environment being run, which the watchdog cleans.
var current atomic.Pointer[env]

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
	vsRounds           int           // rounds of broker retry against in-process retry
	ceilingRounds      int           // rounds of ours, ceiling and plain consumer per handler work
	retryPathN         int           // messages per retry-path run
	concurrency        int           // handlers (ours) and consumer goroutines (raw) on the retry path
	latenessN          int           // retries per backend, delays 1-10 s
	holLong            int           // long retries ahead of the probe
	holLongDelay       time.Duration // their delay, backends
	baselineDelay      time.Duration // their delay, per-message-TTL baseline
	rssN               int           // messages waiting in delay for the RSS figure
	publishWorkers     int           // goroutines scheduling retries through a backend
	// order: accounts and events per account of the projection, and the accounts of
	// its in-process run
	orderAccounts, orderEvents, orderInprocAccounts int
	orderFailEvery                                  int // one event in this many fails once
}

func modeSizes(quick bool) sizes {
	s := sizes{
		throughputN:        5000,
		throughputHandlers: []int{1, 4},
		inprocessN:         5000,
		vsRounds:           3,
		ceilingRounds:      3,
		retryPathN:         5000,
		concurrency:        16,
		latenessN:          1000,
		holLong:            1000,
		holLongDelay:       10 * time.Minute,
		baselineDelay:      10 * time.Minute,
		rssN:               100_000,
		publishWorkers:     16,
		// 10,000 events; in-process 800 (about 40 s: it sleeps 500 ms per failure).
		orderAccounts:       500,
		orderEvents:         20,
		orderInprocAccounts: 40,
		orderFailEvery:      10,
	}
	if quick {
		s.orderAccounts, s.orderEvents, s.orderInprocAccounts = 200, 15, 20
		// In-process retry sleeps 300 ms per failing message inside the one handler:
		// 5,000 messages would take 150 s per round. 500 keep the 10% mix and take 15 s;
		// its steady-state window has 400 of them, 40 failing.
		s.inprocessN = 500
		s.ceilingRounds = 2
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
	only := flag.String("only", "", "comma-separated scenarios to run (throughput,ceiling,retrypath,lateness,headofline,rss,order), with -scale backends; default all")
	concurrency := flag.Int("concurrency", 16, "handlers (broker retry) and consumer goroutines (raw loop) on the retry path")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of this process to this file")
	mutexProfile := flag.String("mutexprofile", "", "write a mutex contention profile of this process to this file at the end")
	handlers := flag.String("throughput-handlers", "1", "handler counts of the throughput runs; the JSON figures are those at 1")
	scale := flag.Bool("scale", false, "run only the scale scenario (1,000,000 retries waiting per backend; long) and write its JSON to -json (default results/scale.json)")
	ctl := flag.String("rabbitmqctl", "rabbitmqctl", "command (split on spaces) that runs rabbitmqctl against the broker of AMQP_URI, for -scale's broker memory")
	flag.IntVar(&scaleWaiting, "scale-waiting", 1_000_000, "-scale: retries waiting per backend")
	flag.IntVar(&scaleSameSecond, "scale-same-second", 100_000, "-scale: retries coming due within the same second")
	dlxPrefetch := flag.String("dlx-prefetch", "", "-scale: set the broker's dead_letter_worker_consumer_prefetch (default 32) for the run, through -rabbitmqctl eval; put back after")
	broker43 := flag.String("broker43", "", "run only the RabbitMQ 4.3 suite (delayed retry in the work queue against a confirmed copy; native43.go) against this AMQP URI and write its JSON to -json (default results/rabbitmq-4.3.json) and its table beside it")
	flag.IntVar(&native43N, "n43", 3000, "-broker43: messages per run")
	h43 := flag.String("handlers43", "1,4,16", "-broker43: handler counts of the concurrency step")
	p43 := flag.String("prefetch43", "1,50", "-broker43: prefetches of the prefetch step")
	rounds43 := flag.Int("rounds43", 2, "-broker43: rounds of every figure (medians)")
	k43 := flag.String("kinds43", "", "-broker43: comma-separated kinds of the prefetch step (\"ttl-tiers/storm,ceiling-copy/storm\"; \"raw\" for the raw loops); default all")
	flag.IntVar(&brokerPID, "broker43pid", 0, "-broker43: the broker's beam.smp process: the prefetch step also reports its CPU time per 1,000 messages (Linux)")
	outageLengths := flag.String("outage", "", "run only the outage scenario (issue 41; outage.go) against AMQP_URI: the handler's dependency down for each of these lengths (\"30s,5m\"), with and without outage detection; JSON to -json (default results/outage.json), its table and plot beside it")
	outageBackend := flag.String("outage-backend", "ttl-tiers", "-outage: the delay backend (ttl-tiers; delayed-retry on RabbitMQ 4.3)")
	falseTrips := flag.Int("false-trips", 0, "run only the false-trip scenario (issue 49; outage.go) against AMQP_URI, this many rounds: failure patterns that are not an outage, and a real one, with outage detection; JSON to -json (default results/falsetrips.json), its table beside it")
	tablePath := flag.String("false-trips-table", "", "print the table of this -false-trips JSON and exit")
	falseTripRules := flag.String("false-trips-rules", "this branch's", "-false-trips: what the results table calls the outage rules measured (a version, a commit)")
	orderB := flag.String("order-backends", strings.Join(orderBackends, ","), "order: the backends of the ordered and unordered runs (those this broker cannot run are skipped)")
	orderAcc := flag.Int("order-accounts", 0, "order: accounts of the projection (default 500, quick 200)")
	orderEv := flag.Int("order-events", 0, "order: events per account (default 20, quick 15)")
	orderFail := flag.Int("order-fail-every", 10, "order: one event in this many fails once")
	also := flag.String("also", "", "comma-separated AMQP URIs of more brokers to run the same suite against after AMQP_URI (JSON: one section per broker version under \"brokers\")")
	flag.Parse()

	if *tablePath != "" {
		var res falseTripResults
		b, err := os.ReadFile(*tablePath)
		if err == nil {
			err = json.Unmarshal(b, &res)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(1)
		}
		fmt.Print(falseTripTable(&res))
		return
	}

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
	if *orderAcc > 0 {
		sz.orderAccounts = *orderAcc
	}
	if *orderEv > 0 {
		sz.orderEvents = *orderEv
	}
	sz.orderFailEvery = max(*orderFail, 1)
	orderBackends = strings.Split(*orderB, ",")
	e := &env{
		uri:    uri,
		prefix: fmt.Sprintf("amqpretry-bench.%s.%d", time.Now().UTC().Format("150405"), os.Getpid()),
		reg:    &registry{},
		sz:     sz,
		mode:   mode,
	}
	current.Store(e)
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
			_ = current.Load().cleanup(true)
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
	if *mutexProfile != "" {
		runtime.SetMutexProfileFraction(5)
		defer writeMutexProfile(*mutexProfile)
	}
	started := time.Now()
	if *scale {
		mode = "scale"
	}
	fmt.Printf("amqpretry benchmarks, %s mode, broker %s, names %s.*\n", mode, redact.URI(uri), e.prefix)
	fmt.Printf("delay backends: %s\n\n", strings.Join(benchBackends(), ", "))
	if *scale {
		ctlArgs := strings.Fields(*ctl)
		old, perr := dlxPrefetchEnv(ctlArgs, *dlxPrefetch)
		if perr != nil {
			fmt.Fprintln(os.Stderr, "error:", perr)
			os.Exit(2)
		}
		e.dlxPrefetch = old
		if *dlxPrefetch != "" {
			e.dlxPrefetch = *dlxPrefetch
			fmt.Printf("dead_letter_worker_consumer_prefetch %s for this run (was %s)\n", *dlxPrefetch, old)
		}
		res, runErr := runScale(ctx, e, ctlArgs, *only)
		if *dlxPrefetch != "" {
			if _, err := dlxPrefetchEnv(ctlArgs, old); err != nil {
				runErr = errors.Join(runErr, fmt.Errorf("put dead_letter_worker_consumer_prefetch back to %s: %w", old, err))
			}
		}
		pprof.StopCPUProfile()
		close(done)
		cleanErr := e.cleanup(true)
		// The broker may be restarting (a shared one): its queues have up to a million
		// messages each, so keep trying for a few minutes.
		for try := 0; cleanErr != nil && try < 18; try++ {
			fmt.Fprintln(os.Stderr, "cleanup:", cleanErr, "- trying again in 10 s")
			time.Sleep(10 * time.Second)
			cleanErr = e.cleanup(true)
		}
		if *jsonPath == "" {
			*jsonPath = filepath.Join("results", "scale.json")
		}
		err := errors.Join(runErr, cleanErr)
		if res != nil {
			if werr := writeJSON(*jsonPath, res); werr != nil {
				err = errors.Join(err, werr)
			} else {
				fmt.Printf("wrote %s (%s)\n", *jsonPath, time.Since(started).Round(time.Second))
			}
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(1)
		}
		return
	}

	if *falseTrips > 0 {
		if *jsonPath == "" {
			*jsonPath = filepath.Join("results", "falsetrips.json")
		}
		if *textPath == "" {
			*textPath = strings.TrimSuffix(*jsonPath, ".json") + ".txt"
		}
		res, runErr := runFalseTrips(ctx, e, *falseTrips, *falseTripRules)
		close(done)
		err := errors.Join(runErr, e.cleanup(true))
		res.Command = "cd benchmarks && go run . " + strings.Join(os.Args[1:], " ")
		res.Machine = fmt.Sprintf("%d CPUs; load average at the end %s", numCPU(), loadAvg())
		text := falseTripTable(res)
		fmt.Print("\n" + text)
		if werr := writeJSON(*jsonPath, res); werr != nil {
			err = errors.Join(err, werr)
		}
		if werr := os.WriteFile(*textPath, []byte(text), 0o644); werr != nil {
			err = errors.Join(err, werr)
		}
		fmt.Printf("wrote %s and %s (%s)\n", *jsonPath, *textPath, time.Since(started).Round(time.Second))
		if err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(1)
		}
		return
	}

	if *outageLengths != "" {
		lengths, perr := parseOutages(*outageLengths)
		if perr == nil {
			perr = checkBrokerPID(brokerPID)
		}
		if perr != nil {
			fmt.Fprintln(os.Stderr, "error:", perr)
			os.Exit(2)
		}
		if brokerPID == 0 {
			brokerPID = beamPID(strings.Fields(*ctl))
		}
		if *jsonPath == "" {
			*jsonPath = filepath.Join("results", "outage.json")
		}
		if *pngPath == filepath.Join("results", mode+".png") {
			*pngPath = strings.TrimSuffix(*jsonPath, ".json") + ".png"
		}
		if *textPath == "" {
			*textPath = strings.TrimSuffix(*jsonPath, ".json") + ".txt"
		}
		fmt.Printf("outage scenario, backend %s, broker's beam.smp %d (0: its CPU not measured)\n", *outageBackend, brokerPID)
		res, runErr := runOutages(ctx, e, lengths, *outageBackend, strings.Fields(*ctl))
		close(done)
		err := errors.Join(runErr, e.cleanup(true))
		res.Command = "cd benchmarks && go run . " + strings.Join(os.Args[1:], " ")
		res.Machine = fmt.Sprintf("%d CPUs; load average at the end %s", numCPU(), loadAvg())
		text := outageTable(res)
		fmt.Print("\n" + text)
		if werr := writeJSON(*jsonPath, res); werr != nil {
			err = errors.Join(err, werr)
		}
		if werr := os.WriteFile(*textPath, []byte(text), 0o644); werr != nil {
			err = errors.Join(err, werr)
		}
		if perr := plotOutages(*pngPath, res); perr != nil {
			err = errors.Join(err, fmt.Errorf("plot: %w", perr))
		}
		fmt.Printf("wrote %s, %s and %s (%s)\n", *jsonPath, *textPath, *pngPath, time.Since(started).Round(time.Second))
		if err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(1)
		}
		return
	}

	if *broker43 != "" {
		if *jsonPath == "" {
			*jsonPath = filepath.Join("results", "rabbitmq-4.3.json")
		}
		var perr error
		if handlers43, perr = intList(*h43); perr == nil {
			prefetch43, perr = intList(*p43)
		}
		if perr == nil {
			perr = checkBrokerPID(brokerPID)
		}
		if perr == nil {
			kinds43, perr = parseKinds43(*k43)
		}
		if perr != nil {
			fmt.Fprintln(os.Stderr, "error:", perr)
			os.Exit(2)
		}
		e43 := &env{uri: *broker43, prefix: e.prefix, reg: &registry{}, sz: sz, mode: mode, noSweep: true}
		current.Store(e43)
		fmt.Printf("RabbitMQ 4.3 suite, broker %s, names %s.*\n", redact.URI(e43.uri), e43.prefix)
		res, log, runErr := run43(ctx, e43, max(*rounds43, 1), *only)
		pprof.StopCPUProfile()
		close(done)
		err := errors.Join(runErr, e43.cleanup(false))
		text := log + "\n" + table43(res)
		fmt.Print("\n" + table43(res))
		if werr := writeJSON(*jsonPath, res); werr != nil {
			err = errors.Join(err, werr)
		}
		txt := strings.TrimSuffix(*jsonPath, ".json") + ".txt"
		if werr := os.WriteFile(txt, []byte(text), 0o644); werr != nil {
			err = errors.Join(err, werr)
		}
		fmt.Printf("wrote %s and %s (%s)\n", *jsonPath, txt, time.Since(started).Round(time.Second))
		if *mutexProfile != "" {
			writeMutexProfile(*mutexProfile)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(1)
		}
		return
	}

	// -also: the same suite against more brokers, one after the other; the JSON's top
	// level stays that of AMQP_URI, and "brokers" has every broker's figures under its
	// version.
	envs := []*env{e}
	for _, u := range strings.Split(*also, ",") {
		if u = strings.TrimSpace(u); u != "" {
			envs = append(envs, &env{uri: u, prefix: e.prefix, reg: &registry{}, sz: sz, mode: mode, noSweep: true})
		}
	}
	var (
		reps []*report
		errs []error
	)
	for i, ev := range envs {
		if i > 0 {
			fmt.Printf("\n== broker %s\n", redact.URI(ev.uri))
		}
		current.Store(ev)
		t0 := time.Now()
		rep, runErr := run(ctx, ev, *only)
		rep.elapsed = time.Since(t0)
		if runErr != nil {
			errs = append(errs, runErr)
		}
		if err := ev.cleanup(true); err != nil { // a last sweep, whatever happened
			errs = append(errs, fmt.Errorf("cleanup: %w", err))
		}
		reps = append(reps, rep)
		if ctx.Err() != nil {
			break
		}
	}
	pprof.StopCPUProfile() // a no-op without -cpuprofile
	close(done)

	results := reps[0].results
	if len(reps) > 1 {
		results.Brokers = map[string]*Results{}
	}
	var text string
	for i, rep := range reps {
		if len(reps) > 1 {
			text += fmt.Sprintf("== RabbitMQ %s (%s)\n", rep.broker, redact.URI(envs[i].uri))
		}
		text += rep.table()
	}
	if len(reps) > 1 {
		for _, rep := range reps {
			results.Brokers[rep.broker] = &rep.results
		}
	}
	fmt.Print("\n" + text)
	if *textPath != "" {
		if err := os.WriteFile(*textPath, []byte(text), 0o644); err != nil {
			errs = append(errs, err)
		} else {
			fmt.Printf("wrote %s\n", *textPath)
		}
	}
	if *jsonPath != "" {
		if err := writeJSON(*jsonPath, results); err != nil {
			errs = append(errs, err)
		} else {
			fmt.Printf("wrote %s\n", *jsonPath)
		}
	}
	for i, rep := range reps {
		path := *pngPath
		if i > 0 {
			path = strings.TrimSuffix(path, ".png") + "-rabbitmq-" + rep.broker + ".png"
		}
		if !rep.plotted() { // the order scenario alone: its figures are in the table
			continue
		}
		if err := plotReport(path, rep); err != nil {
			errs = append(errs, fmt.Errorf("plot: %w", err))
		} else {
			fmt.Printf("wrote %s\n", path)
		}
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
		{"ceiling", runCeiling},
		{"retrypath", runRetryPath},
		{"lateness", runLateness},
		{"headofline", runHeadOfLine},
		{"rss", runRSS},
		{"order", runOrder},
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
		// broker that has none of them.
		if err := e.cleanup(e.reg.takeUnsure()); err != nil {
			errs = append(errs, fmt.Errorf("%s: cleanup: %w", s.name, err))
		}
	}
	return rep, errors.Join(errs...)
}

func writeJSON(path string, r any) error {
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

// writeMutexProfile writes the mutex contention profile to path.
func writeMutexProfile(path string) {
	f, err := os.Create(path)
	if err == nil {
		err = pprof.Lookup("mutex").WriteTo(f, 0)
		_ = f.Close()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "mutexprofile:", err)
	}
}

// intList parses a comma-separated list of positive integers.
func intList(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		k, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || k < 1 {
			return nil, fmt.Errorf("%q is not a positive number", f)
		}
		out = append(out, k)
	}
	return out, nil
}
