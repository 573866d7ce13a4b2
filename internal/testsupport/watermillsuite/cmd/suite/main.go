// Command suite is the Go half of scripts/watermill-suite.sh:
//
//	go test -json ... 2>&1 | suite record out.json
//	suite compare -major 3 -base base.json -retry retry.json [-base-wall 120 -retry-wall 130]
//	suite delete < names      (lines "queue NAME" or "exchange NAME"; AMQP_URI)
//
// record keeps of a `go test -json` stream every event but the output of the tests
// that pass or skip (the suite's trace logging makes hundreds of megabytes of it): a
// failed or unfinished test keeps its own lines (assertion failures, the suite's
// progress: up to 200 lines that are not Watermill's logging) and its last 20 lines,
// and output outside any test (a build error, a panic) is kept whole.
//
// compare reads the `go test -json` output of watermill-amqp's own pkg/amqp tests run
// as shipped (base) and with every subscriber built from our SubscriberConfig (retry),
// prints one summary line, and exits 1 unless both passed the same tests, skipped the
// same tests and failed none. Test names are compared with watermill's per-run test
// IDs (UUIDs) replaced by <id>.
//
// delete deletes the queues and exchanges named on its standard input, on the broker
// at AMQP_URI; one that is already gone is not an error.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: suite record|compare|delete ...")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "record":
		if len(os.Args) != 3 {
			err = errors.New("usage: suite record FILE")
			break
		}
		err = record(os.Stdin, os.Args[2])
	case "compare":
		err = compare(os.Args[2:])
	case "delete":
		err = deleteNames(os.Stdin)
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "suite:", err)
		os.Exit(1)
	}
}

// event is a line of `go test -json`.
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
	Elapsed float64
}

// run is what one `go test -json` run did.
type run struct {
	pass, skip, fail []string // normalized test names
	unfinished       []string // started, never ended (a panic, a timeout)
	pkg              string   // the package's own result: pass, fail, or "" (none: the run broke)
	elapsed          float64  // the test binary's, from the package event
	output           map[string][]string
	build            []string // output outside any test (build errors, panics)

	failedOrUnfinished func(name string) bool
}

var testID = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`)

func normalize(name string) string { return testID.ReplaceAllString(name, "<id>") }

func read(path string) (run, error) {
	f, err := os.Open(path)
	if err != nil {
		return run{}, err
	}
	defer f.Close()
	r := run{output: map[string][]string{}}
	running := map[string]int{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var ev event
		if len(line) == 0 || line[0] != '{' || json.Unmarshal(line, &ev) != nil {
			r.build = appendTail(r.build, string(line))
			continue
		}
		name := normalize(ev.Test)
		switch ev.Action {
		case "run":
			running[name]++
		case "pass", "skip", "fail":
			running[name]--
		}
		switch {
		case ev.Action == "output" && ev.Test != "":
			r.output[name] = appendTail(r.output[name], ev.Output)
		case ev.Action == "output":
			r.build = appendTail(r.build, ev.Output)
		case ev.Test == "" && (ev.Action == "pass" || ev.Action == "fail" || ev.Action == "skip"):
			r.pkg, r.elapsed = ev.Action, ev.Elapsed
		case ev.Action == "pass":
			r.pass = append(r.pass, name)
		case ev.Action == "skip":
			r.skip = append(r.skip, name)
		case ev.Action == "fail":
			r.fail = append(r.fail, name)
		}
	}
	if err := sc.Err(); err != nil {
		return run{}, fmt.Errorf("%s: %w", path, err)
	}
	for name, n := range running {
		if name != "" && n > 0 {
			r.unfinished = append(r.unfinished, name)
		}
	}
	sort.Strings(r.pass)
	sort.Strings(r.skip)
	sort.Strings(r.fail)
	sort.Strings(r.unfinished)
	return r, nil
}

// record copies the go test -json stream on in to path, without the output of the
// tests that did not fail beyond their last lines.
func record(in io.Reader, path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	pending := map[string]*pendingOutput{}
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var ev event
		if len(line) > 0 && line[0] == '{' && json.Unmarshal(line, &ev) == nil && ev.Test != "" {
			switch ev.Action {
			case "output":
				h := pending[ev.Test]
				if h == nil {
					h = &pendingOutput{}
					pending[ev.Test] = h
				}
				h.add(line, ev.Output)
				continue
			case "pass", "skip", "fail":
				if h := pending[ev.Test]; h != nil && ev.Action == "fail" {
					h.write(w)
				}
				delete(pending, ev.Test)
			}
		}
		w.Write(line)
		w.WriteByte('\n')
	}
	// Tests that never ended (a panic, a timeout): their last lines.
	for _, test := range slices.Sorted(maps.Keys(pending)) {
		pending[test].write(w)
	}
	return errors.Join(sc.Err(), w.Flush(), f.Close())
}

// pendingOutput is what record keeps of a test's output until the test ends: the lines
// that are not Watermill's logging (the test's own: assertion failures, the suite's
// progress), up to keptLines, and the last tailLines lines.
type pendingOutput struct {
	own, tail [][]byte
	ownOrder  []int // for each own line, its position among all lines
	n         int
	tailStart int // position of tail[0]
}

func (h *pendingOutput) add(line []byte, output string) {
	if !strings.HasPrefix(strings.TrimSpace(output), "[watermill]") && len(h.own) < keptLines {
		h.own = append(h.own, slices.Clone(line))
		h.ownOrder = append(h.ownOrder, h.n)
	}
	h.tail = append(h.tail, slices.Clone(line))
	if len(h.tail) > tailLines {
		h.tail = h.tail[1:]
		h.tailStart++
	}
	h.n++
}

// write writes the own lines before the tail, then the tail, in their order.
func (h *pendingOutput) write(w *bufio.Writer) {
	for i, l := range h.own {
		if h.ownOrder[i] >= h.tailStart {
			break // in the tail
		}
		w.Write(l)
		w.WriteByte('\n')
	}
	for _, l := range h.tail {
		w.Write(l)
		w.WriteByte('\n')
	}
}

const (
	tailLines = 20
	keptLines = 200
)

// appendTail keeps the last keptLines+tailLines lines.
func appendTail(lines []string, s string) []string {
	lines = append(lines, strings.TrimRight(s, "\n"))
	if len(lines) > keptLines+tailLines {
		lines = lines[len(lines)-keptLines-tailLines:]
	}
	return lines
}

func (r run) String() string {
	return fmt.Sprintf("%d passed, %d skipped, %d failed", len(r.pass), len(r.skip), len(r.fail))
}

func compare(args []string) error {
	fs := flag.NewFlagSet("compare", flag.ExitOnError)
	major := fs.String("major", "", "watermill-amqp major, for the summary")
	basePath := fs.String("base", "", "go test -json output of the suite as shipped")
	retryPath := fs.String("retry", "", "go test -json output of the suite with our SubscriberConfig")
	baseWall := fs.Int("base-wall", 0, "wall time of the base run, seconds (go build included)")
	retryWall := fs.Int("retry-wall", 0, "wall time of the retry run, seconds")
	mode := fs.String("mode", "", "full or short, for the summary")
	_ = fs.Parse(args)
	base, err := read(*basePath)
	if err != nil {
		return err
	}
	retry, err := read(*retryPath)
	if err != nil {
		return err
	}
	var problems []string
	for _, v := range []struct {
		label string
		r     run
	}{{"as shipped", base}, {"with amqpretry", retry}} {
		if v.r.pkg != "pass" {
			problems = append(problems, fmt.Sprintf("%s: the package result is %q, not pass", v.label, v.r.pkg))
		}
		for _, name := range v.r.fail {
			if !isParentOfAnother(name, v.r.fail) {
				problems = append(problems, fmt.Sprintf("%s: FAIL %s", v.label, name))
			}
		}
		for _, name := range v.r.unfinished {
			problems = append(problems, fmt.Sprintf("%s: never finished: %s", v.label, name))
		}
	}
	// Tests that passed or skipped in one run only, unless the other run's failure of
	// the test (or of a subtest) is already listed.
	base.failedOrUnfinished, retry.failedOrUnfinished = failedOrUnfinished(base), failedOrUnfinished(retry)
	problems = append(problems, diff("passed", base, retry, func(r run) []string { return r.pass })...)
	problems = append(problems, diff("skipped", base, retry, func(r run) []string { return r.skip })...)
	if len(base.pass) == 0 {
		problems = append(problems, "no test passed as shipped: is the broker at WATERMILL_TEST_AMQP_URI?")
	}
	verdict := "same"
	if len(problems) > 0 {
		verdict = "DIFFERENT"
	}
	fmt.Printf("watermill-amqp v%s %s: as shipped %s (%s); with amqpretry SubscriberConfig %s (%s): %s\n",
		*major, *mode, base, times(base.elapsed, *baseWall), retry, times(retry.elapsed, *retryWall), verdict)
	if len(problems) == 0 {
		return nil
	}
	for _, p := range problems {
		fmt.Println("  " + p)
	}
	for _, v := range []struct {
		label string
		r     run
	}{{"as shipped", base}, {"with amqpretry", retry}} {
		if v.r.pkg == "" && len(v.r.build) > 0 {
			fmt.Printf("--- %s: output outside any test (last lines)\n", v.label)
			printIndented(v.r.build)
		}
		for _, name := range append(slices.Clone(v.r.fail), v.r.unfinished...) {
			if isParentOfAnother(name, v.r.fail) || isParentOfAnother(name, v.r.unfinished) {
				continue // its failing subtest's output says why
			}
			fmt.Printf("--- %s: %s (last lines)\n", v.label, name)
			printIndented(v.r.output[name])
		}
	}
	return errors.New("the suite does not pass with our SubscriberConfig as it passes without it")
}

func printIndented(lines []string) {
	for _, l := range lines {
		fmt.Println("    " + l)
	}
}

func isParentOfAnother(name string, names []string) bool {
	return slices.ContainsFunc(names, func(n string) bool { return strings.HasPrefix(n, name+"/") })
}

func times(elapsed float64, wall int) string {
	s := fmt.Sprintf("tests %s", (time.Duration(elapsed * float64(time.Second))).Round(time.Second))
	if wall > 0 {
		s += fmt.Sprintf(", wall %s", time.Duration(wall)*time.Second)
	}
	return s
}

// diff names the tests in one run's list and not in the other's, except those the other
// run failed or did not finish.
func diff(what string, base, retry run, list func(run) []string) []string {
	var out []string
	for _, n := range minus(list(base), list(retry)) {
		if !retry.failedOrUnfinished(n) {
			out = append(out, fmt.Sprintf("%s as shipped, not with amqpretry: %s", what, n))
		}
	}
	for _, n := range minus(list(retry), list(base)) {
		if !base.failedOrUnfinished(n) {
			out = append(out, fmt.Sprintf("%s with amqpretry, not as shipped: %s", what, n))
		}
	}
	return out
}

// failedOrUnfinished tells whether r failed or did not finish the test name or one of
// its subtests.
func failedOrUnfinished(r run) func(name string) bool {
	return func(name string) bool {
		for _, list := range [][]string{r.fail, r.unfinished} {
			if slices.Contains(list, name) || isParentOfAnother(name, list) {
				return true
			}
		}
		return false
	}
}

// minus returns the names of a (sorted) not in b (sorted), with multiplicity.
func minus(a, b []string) []string {
	count := map[string]int{}
	for _, n := range b {
		count[n]++
	}
	var out []string
	for _, n := range a {
		if count[n] > 0 {
			count[n]--
			continue
		}
		out = append(out, n)
	}
	return out
}

// deleteNames deletes the queues and exchanges listed on in.
func deleteNames(in io.Reader) error {
	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = "amqp://guest:guest@127.0.0.1:5672/"
	}
	conn, err := amqp.Dial(uri)
	if err != nil {
		return err
	}
	defer conn.Close()
	var ch *amqp.Channel
	deleted := map[string]int{}
	var errs []error
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		kind, name, ok := strings.Cut(strings.TrimSpace(sc.Text()), " ")
		if !ok || name == "" {
			continue
		}
		if ch == nil || ch.IsClosed() {
			if ch, err = conn.Channel(); err != nil {
				return err
			}
		}
		switch kind {
		case "queue":
			_, err = ch.QueueDelete(name, false, false, false)
		case "exchange":
			err = ch.ExchangeDelete(name, false, false)
		default:
			err = fmt.Errorf("unknown kind %q", kind)
		}
		var aerr *amqp.Error
		deleted[kind] += 0 // named in the summary even if none could be deleted
		switch {
		case err == nil:
			deleted[kind]++
		case errors.As(err, &aerr) && aerr.Code == amqp.NotFound:
		default:
			errs = append(errs, fmt.Errorf("%s %q: %w", kind, name, err))
		}
	}
	for _, kind := range []string{"queue", "exchange"} {
		if n, ok := deleted[kind]; ok {
			fmt.Printf("deleted %d %ss\n", n, kind)
		}
	}
	return errors.Join(append(errs, sc.Err())...)
}
