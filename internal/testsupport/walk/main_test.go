package main

import (
	"bytes"
	"os"
	"slices"
	"strings"
	"testing"
)

// testdata/trace.txt is scripts/walk.sh's trace of ttl-tiers on RabbitMQ 3.10, from
// before the scenario turned jitter off (the delay, 1.086s, passed the 1s tier, so
// (*engine).fail also stamps the time of the re-park: formatTime), trimmed: the failed message's run of the closure on goroutine 25 without most of its
// repeated calls (Envelope.Write's truncates and its formatDurations, the header keys
// after the second, the wire's field sizes after the first), a few lines of other
// goroutines around and inside it, and the start of the second attempt's run on
// goroutine 16, closed by its returns. testdata/repo has the files of the functions it
// names, each function where it was in the repository at the time, as an empty stub.
const module = "github.com/amqpretry/amqpretry"

func segments(t *testing.T) []segment {
	t.Helper()
	f, err := os.Open("testdata/trace.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	segs, err := parseTrace(f, module, "middleware.(*engine).Middleware.func1", repo(t).compilerMade(module))
	if err != nil {
		t.Fatal(err)
	}
	return segs
}

func repo(t *testing.T) index {
	t.Helper()
	idx, err := indexRepo("testdata/repo")
	if err != nil {
		t.Fatal(err)
	}
	return idx
}

func TestWalkOfTheFailedMessage(t *testing.T) {
	segs := segments(t)
	if len(segs) != 2 || segs[0].goroutine != "25" || segs[1].goroutine != "16" {
		t.Fatalf("runs of the closure: %+v, want two, on goroutines 25 and 16", segs)
	}
	seg, ok := pick(segs, "(*engine).fail")
	if !ok || seg.goroutine != "25" {
		t.Fatalf("picked goroutine %s (%v), want 25", seg.goroutine, ok)
	}
	idx := repo(t)
	w := measure(seg, func(sym string) string { return idx.fileOf(module, sym) })

	// 66 calls, 7 of them repeats of a pair (formatInt, truncate, formatTime,
	// Reserved, BrokerOwned); the two defer wrappers and the method value's wrapper
	// (isBound-fm) are not counted.
	if w.hops != 59 || w.calls != 66 {
		t.Errorf("hops %d of %d calls, want 59 of 66", w.hops, w.calls)
	}
	wantFiles := []string{
		"classify.go", "delay/handoff.go", "delay/ttltiers.go", "internal/keys/keys.go",
		"internal/marshal/marshal.go", "internal/marshal/receipt.go",
		"internal/undecodable/undecodable.go", "internal/wire/wire.go",
		"middleware/copy.go", "middleware/engine.go", "middleware/envelope.go",
		"middleware/handoff.go", "middleware/lifecycle.go", "middleware/observe.go",
		"middleware/outage.go", "middleware/panic.go", "middleware/wiring.go", "outage.go",
	}
	if !slices.Equal(w.files, wantFiles) {
		t.Errorf("files %d %q,\nwant %d %q", len(w.files), w.files, len(wantFiles), wantFiles)
	}
	var got []string
	for _, r := range w.returns {
		got = append(got, r.from+" -> "+r.to+": "+short(module, r.sym))
	}
	wantReturns := []string{
		"middleware/engine.go -> middleware/wiring.go: middleware.(*wiring).queue",
		"middleware/engine.go -> middleware/lifecycle.go: middleware.(*lifecycle).begin",
		"middleware/engine.go -> middleware/copy.go: middleware.(*engine).fail",
		// through the method value isBound-fm, skipped
		"middleware/copy.go -> middleware/wiring.go: middleware.(*retry).isBound",
		"middleware/copy.go -> middleware/panic.go: middleware.stackOf",
		"middleware/copy.go -> middleware/envelope.go: middleware.Envelope.Write",
		"middleware/copy.go -> middleware/envelope.go: middleware.formatTime",
		"middleware/copy.go -> delay/ttltiers.go: delay.(*ttlTiers).Park",
		// Reserved entered keys.go first; the next pairs are not counted again
		"internal/marshal/marshal.go -> internal/keys/keys.go: internal/keys.BrokerOwned",
	}
	if !slices.Equal(got, wantReturns) {
		t.Errorf("returns %d:\n%s\nwant %d:\n%s", len(got), strings.Join(got, "\n"), len(wantReturns), strings.Join(wantReturns, "\n"))
	}

	// A deferred closure counts as called by its function, though dlv reports it
	// after the function's return.
	for _, c := range seg.calls {
		if short(module, c.sym) == "middleware.(*engine).run.func1" && short(module, c.caller) != "middleware.(*engine).run" {
			t.Errorf("run.func1 called by %s, want (*engine).run", c.caller)
		}
	}
}

// testdata/trace-delayed-retry.txt is scripts/walk.sh's trace of delayed-retry on
// RabbitMQ 4.3, trimmed to the calls of (*engine).fail that the compiler's functions
// are in: the wrappers (*delayedRetry).Effective and Settle of methods declared on
// delayedRetry, and the hash of a map key.
func TestCompilerMadeSkipped(t *testing.T) {
	f, err := os.Open("testdata/trace-delayed-retry.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	idx := repo(t)
	segs, err := parseTrace(f, module, "middleware.(*engine).Middleware.func1", idx.compilerMade(module))
	if err != nil {
		t.Fatal(err)
	}
	seg, ok := pick(segs, "(*engine).settle")
	if !ok {
		t.Fatal("no run calls (*engine).settle")
	}
	var got []string
	for _, c := range seg.calls[1:] {
		got = append(got, short(module, c.caller)+" -> "+short(module, c.sym))
	}
	want := []string{
		"middleware.(*engine).Middleware.func1 -> middleware.(*engine).fail",
		"middleware.(*engine).fail -> delay.delayedRetry.Effective",
		"middleware.(*engine).fail -> middleware.(*engine).settle",
		"middleware.(*engine).settle -> middleware.(*engine).holdDelivery",
		"middleware.(*engine).holdDelivery -> delay.delayedRetry.Settle",
		"middleware.(*engine).settle -> middleware.(*heldRetries).add",
	}
	if !slices.Equal(got, want) {
		t.Errorf("calls:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	w := measure(seg, func(sym string) string { return idx.fileOf(module, sym) })
	if w.hops != 6 || len(w.files) != 4 || len(w.returns) != 1 || w.returns[0].to != "delay/delayedretry.go" {
		t.Errorf("hops %d, files %q, returns %+v; want 6, 4, one: into delay/delayedretry.go", w.hops, w.files, w.returns)
	}
}

func TestPickAnotherRun(t *testing.T) {
	segs := segments(t)
	seg, ok := pick(segs, "middleware.readTime")
	if !ok || seg.goroutine != "16" {
		t.Fatalf("picked goroutine %s (%v), want 16", seg.goroutine, ok)
	}
	idx := repo(t)
	w := measure(seg, func(sym string) string { return idx.fileOf(module, sym) })
	if w.hops != 7 || len(w.files) != 4 || len(w.returns) != 0 {
		t.Errorf("hops %d, files %q, returns %+v; want 7, 4, none", w.hops, w.files, w.returns)
	}
	if _, ok := pick(segs, "(*engine).settle"); ok {
		t.Error("picked a run for (*engine).settle, which the trace never calls")
	}
}

func TestRun(t *testing.T) {
	var out bytes.Buffer
	if err := run(&out, "testdata/trace.txt", "testdata/repo", "", "middleware.(*engine).Middleware.func1", "(*engine).fail", true); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"walk: goroutine 25, from middleware.(*engine).Middleware.func1 (trace line 3)\n",
		"\n    middleware.(*wiring).queue  [middleware/wiring.go]\n",
		"\nhops: 59 (distinct caller->callee pairs, of 66 calls)\nfiles: 18\n",
		"\nreturns: 9\n",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	err := run(&out, "testdata/trace.txt", "testdata/repo", "", "middleware.(*engine).Middleware.func1", "(*engine).settle", false)
	if err == nil || !strings.Contains(err.Error(), "none of its 2 runs of middleware.(*engine).Middleware.func1 calls (*engine).settle") {
		t.Errorf("err %v, want none of the runs calls (*engine).settle", err)
	}
}

func TestParseLine(t *testing.T) {
	for _, c := range []struct {
		line string
		want event
		ok   bool
	}{
		{`> goroutine(25): github.com/m/middleware.(*engine).read(("*github.com/m/middleware.engine")(0x3e9732d36008), 1)`, event{false, "25", "github.com/m/middleware.(*engine).read"}, true},
		{`>> goroutine(25): github.com/m/middleware.(*engine).read => (github.com/m/middleware.delivery {msg: nil})`, event{true, "25", "github.com/m/middleware.(*engine).read"}, true},
		{`> goroutine(25): github.com/m/middleware.(*outages).of.deferwrap1()`, event{false, "25", "github.com/m/middleware.(*outages).of.deferwrap1"}, true},
		{`>> goroutine(7): github.com/m.DecisionOf => (github.com/m.Decision {Permanent: false})`, event{true, "7", "github.com/m.DecisionOf"}, true},
		{`> goroutine(3): github.com/m/keys.(*Set[go.shape.string]).Add(("*github.com/m/keys.Set[string]")(0xc0), "a b")`, event{false, "3", "github.com/m/keys.(*Set[go.shape.string]).Add"}, true},
		{`> goroutine(3): github.com/m/keys.Map[go.shape.string,go.shape.int](1)`, event{false, "3", "github.com/m/keys.Map[go.shape.string,go.shape.int]"}, true},
		{`Process 19613 has exited with status 0`, event{}, false},
		{`> goroutine(x): github.com/m.F()`, event{}, false},
		{`>> goroutine(1): github.com/m.F(1)`, event{}, false},
	} {
		got, ok := parseLine(c.line)
		if ok != c.ok || (ok && got != c.want) {
			t.Errorf("parseLine(%q) = %+v, %v; want %+v, %v", c.line, got, ok, c.want, c.ok)
		}
	}
}

func TestFileOf(t *testing.T) {
	idx := repo(t)
	for sym, want := range map[string]string{
		module + "/middleware.(*engine).fail":                   "middleware/copy.go",
		module + "/middleware.Envelope.Write":                   "middleware/envelope.go",
		module + ".DecisionOf":                                  "classify.go",
		module + "/middleware.(*engine).run.func1":              "middleware/panic.go",
		module + "/middleware.(*engine).run.func1.2":            "middleware/panic.go",
		module + "/middleware.errorTypes.func1":                 "middleware/copy.go",
		module + "/middleware.(*retry).isBound-fm":              "middleware/wiring.go",
		module + "/middleware.(*outages).of.deferwrap1":         "middleware/outage.go",
		module + "/internal/marshal.Marshaler.Marshal":          "internal/marshal/marshal.go",
		module + "/internal/keys.(*Set[go.shape.string]).Add":   "internal/keys/generic.go",
		module + "/internal/keys.Pair[go.shape.string,int].Get": "internal/keys/generic.go",
		module + "/middleware.(*engine).read":                   "middleware/engine.go", // not copy_test.go
		module + "/middleware.gone":                             "middleware/?gone",
	} {
		if got := idx.fileOf(module, sym); got != want {
			t.Errorf("fileOf(%s) = %s, want %s", sym, got, want)
		}
	}
}
