package amqpretry_test

import (
	"context"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqpv3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// The figures the docs give about the topology, its limits and its defaults are marked
// where they stand, <!--fig:KEY--> right after the figure (invisible once rendered):
//
//	declares 36<!--fig:ttl-tiers.queues--> quorum queues ... after 100 ms<!--fig:handoff-pause-first-->
//
// TestDocFigures reads every marked figure of README.md and docs/*.md and checks it
// against the code that produces it (Config.Plan, the defaults, the backends' limits);
// a figure of those kinds left unmarked, a marker of an unknown key, and a known key
// that no doc marks any more all fail it.
var (
	figureMarker = regexp.MustCompile(`(\d[\d,.]*(?: (?:ms|s|h|years|days))?)<!--fig:([a-z0-9.-]+)-->`)
	anyMarker    = regexp.MustCompile(`<!--fig:[a-z0-9]`) // "<!--fig:KEY-->" names the convention
	// A count of these, unmarked, is a topology figure that escapes the check.
	unmarkedDocs   = regexp.MustCompile(`\b\d[\d,]* (?:tiers|levels|exchanges|bindings)\b`)
	unmarkedReadme = regexp.MustCompile(`\b\d[\d,]* (?:tiers|levels|exchanges|bindings|quorum queues|queues)\b`)
)

// figureDocs are the files whose figures are checked.
func figureDocs(t *testing.T) []string {
	docs, err := filepath.Glob("docs/*.md")
	if err != nil || len(docs) == 0 {
		t.Fatalf("no docs/*.md (%v)", err)
	}
	return append([]string{"README.md"}, docs...)
}

// expectedFigures computes every figure the docs may mark, from the code.
func expectedFigures(t *testing.T) map[string]string {
	t.Helper()
	want := map[string]string{}
	def := amqpretry.Config{}.WithDefaults()
	plan := func(backendName delay.Backend, queues ...string) (q, x, b int) {
		tp, err := amqpretry.Config{Backend: backendName}.Plan(queues...)
		if err != nil {
			t.Fatalf("Plan(%s): %v", backendName, err)
		}
		return len(tp.Queues), len(tp.Exchanges), len(tp.Bindings)
	}
	perWorkQueue := -1
	for _, name := range []delay.Backend{delay.TTLTiers(), delay.BinaryLevels(0)} {
		q, x, b := plan(name)
		want[name.Name()+".queues"] = strconv.Itoa(q)
		want[name.Name()+".exchanges"] = strconv.Itoa(x)
		want[name.Name()+".bindings"] = strconv.Itoa(b)
		// RabbitMQ 3.x reserves 3 file handles per single-node quorum queue
		// (docs/broker-resources.md, measured).
		want[name.Name()+".handles"] = strconv.Itoa(3 * q)
		for _, n := range []delay.Backend{delay.TTLTiers(), delay.BinaryLevels(0), delay.DelayedExchange()} {
			_, _, b0 := plan(n)
			_, _, b1 := plan(n, "work")
			if perWorkQueue >= 0 && b1-b0 != perWorkQueue {
				t.Errorf("%s: a work queue adds %d bindings, others %d: the docs give one figure for all", n, b1-b0, perWorkQueue)
			}
			perWorkQueue = b1 - b0
		}
	}
	want["bindings-per-work-queue"] = strconv.Itoa(perWorkQueue)
	want["ttl-tiers.tiers"] = strconv.Itoa(len(backend.DefaultTiers()))
	want["binary-levels.levels"] = strconv.Itoa(backend.DefaultLevels)
	// A 1,024-fd RabbitMQ 3.x broker's file handle budget (ulimit -n - 97, measured).
	q, _, _ := plan(delay.TTLTiers())
	want["ttl-tiers.ladders-per-broker"] = strconv.Itoa(927 / (3 * q))

	want["ttl-tiers.longest"] = figureDuration(slices.Max(backend.DefaultTiers()))
	want["binary-levels.longest"] = fmt.Sprintf("%.1f years", longest(t, def, delay.BinaryLevels(0), time.Second).Hours()/24/365.25)
	want["delayed-exchange.longest"] = fmt.Sprintf("%.1f days", longest(t, def, delay.DelayedExchange(), time.Millisecond).Hours()/24)

	want["handoff-attempts"] = strconv.Itoa(backend.HandoffAttempts)
	want["handoff-pause-first"] = figureDuration(backend.HandoffPause(1))
	want["handoff-pause-most"] = figureDuration(backend.HandoffPause(1000))
	want["confirm-timeout"] = figureDuration(backend.DefaultConfirmTimeout)

	want["go"] = goLine(t, "go.mod")
	return want
}

// longest finds the longest delay backend name accepts, in steps of step: the
// backend's Effective accepts it and refuses one step more.
func longest(t *testing.T, c amqpretry.Config, name delay.Backend, step time.Duration) time.Duration {
	t.Helper()
	b, err := backend.Open(name, backend.Setup{Prefix: c.Prefix})
	if err != nil {
		t.Fatal(err)
	}
	lo, hi := step, step
	for {
		if _, err := b.Effective(hi); err != nil {
			break
		}
		lo, hi = hi, hi*2
		if hi > 100*365*24*time.Hour {
			t.Fatalf("%s accepts any delay", name)
		}
	}
	for hi-lo > step { // Effective(lo) accepted, Effective(hi) refused
		mid := lo + (hi-lo)/2/step*step
		if _, err := b.Effective(mid); err != nil {
			hi = mid
		} else {
			lo = mid
		}
	}
	return lo
}

// figureDuration renders d as the docs write it: "1 h", "10 s", "100 ms".
func figureDuration(d time.Duration) string {
	switch {
	case d%time.Hour == 0:
		return fmt.Sprintf("%d h", d/time.Hour)
	case d%time.Second == 0:
		return fmt.Sprintf("%d s", d/time.Second)
	default:
		return fmt.Sprintf("%d ms", d/time.Millisecond)
	}
}

// goLine is the major.minor of the go line of a go.mod.
func goLine(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+)\.(\d+)`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("%s has no go line", path)
	}
	return string(m[1]) + "." + string(m[2])
}

func TestDocFigures(t *testing.T) {
	want := expectedFigures(t)
	seen := map[string]bool{}
	for _, path := range figureDocs(t) {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		markers := figureMarker.FindAllStringSubmatchIndex(text, -1)
		if n := len(anyMarker.FindAllStringIndex(text, -1)); n != len(markers) {
			t.Errorf("%s: %d <!--fig:...--> markers, %d of them right after a figure: a marker follows a number (and its unit) directly", path, n, len(markers))
		}
		for _, m := range markers {
			got, key := text[m[2]:m[3]], text[m[4]:m[5]]
			line := 1 + strings.Count(text[:m[0]], "\n")
			w, ok := want[key]
			switch {
			case !ok:
				t.Errorf("%s:%d: unknown figure %q: add it to expectedFigures (docs_test.go)", path, line, key)
			case strings.ReplaceAll(got, ",", "") != w:
				t.Errorf("%s:%d: figure %s is %q, the code gives %q", path, line, key, got, w)
			}
			seen[key] = true
		}
		unmarked := unmarkedDocs
		if path == "README.md" {
			unmarked = unmarkedReadme
		}
		for _, loc := range unmarked.FindAllStringIndex(text, -1) {
			line := 1 + strings.Count(text[:loc[0]], "\n")
			t.Errorf("%s:%d: %q is a topology figure without a <!--fig:KEY--> marker, so no test checks it", path, line, text[loc[0]:loc[1]])
		}
	}
	for key, w := range want {
		if !seen[key] {
			t.Errorf("no doc marks the figure %s (%s) any more: mark it where the docs give it, or drop it from expectedFigures", key, w)
		}
	}
}

// TestGoVersion: the module's go line is the Go the README says the library needs,
// and no older than the language features its code relies on.
func TestGoVersion(t *testing.T) {
	omitzero := regexp.MustCompile(`json:"[^"]*,omitzero`)
	line := goLine(t, "go.mod")
	// json's omitzero option is honoured from Go 1.24 on; older Go ignores it silently.
	needs := ""
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." {
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil || strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" {
				return filepath.SkipDir // another module
			}
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err == nil && omitzero.Match(b) && needs == "" {
			needs = "1.24 (" + path + " uses json's omitzero)"
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if needs != "" && versionLess(line, "1.24") {
		t.Errorf("go.mod says go %s; the code needs %s", line, needs)
	}
}

func versionLess(a, b string) bool {
	pa, pb := strings.Split(a, "."), strings.Split(b, ".")
	for i := range min(len(pa), len(pb)) {
		x, _ := strconv.Atoi(pa[i])
		y, _ := strconv.Atoi(pb[i])
		if x != y {
			return x < y
		}
	}
	return len(pa) < len(pb)
}

// TestDocsNameEveryBackend: Config.Backend's doc, package delay's table and the
// README's table of backends name every backend of delay's parse table (backend.All),
// so a backend added there is documented, or this fails saying where.
func TestDocsNameEveryBackend(t *testing.T) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "delay/delay.go", nil, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	_ = f
	var backends []string
	for _, b := range backend.All(delay.TTLTiers()) {
		backends = append(backends, b.Name())
	}
	if len(backends) < 6 {
		t.Fatalf("found only %v in delay's parse table", backends)
	}
	cfg, err := parser.ParseFile(fset, "config.go", nil, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	var backendDoc string
	ast.Inspect(cfg, func(n ast.Node) bool {
		if ts, ok := n.(*ast.TypeSpec); ok && ts.Name.Name == "Config" {
			for _, field := range ts.Type.(*ast.StructType).Fields.List {
				if len(field.Names) == 1 && field.Names[0].Name == "Backend" {
					backendDoc = field.Doc.Text()
				}
			}
		}
		return true
	})
	pkgDoc, err := parser.ParseFile(fset, "delay/doc.go", nil, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	table := pkgDoc.Doc.Text()
	readmeTable := readmeBackends(t)
	for _, name := range backends {
		if !strings.Contains(backendDoc, strconv.Quote(name)) {
			t.Errorf("Config.Backend's doc does not name %q", name)
		}
		if !regexp.MustCompile(`(?m)^\s+` + regexp.QuoteMeta(name) + `\s`).MatchString(table) {
			t.Errorf("delay/doc.go's table has no row for %s: add one (precision, longest delay, broker)", name)
		}
		if !regexp.MustCompile("(?m)^\\| `" + regexp.QuoteMeta(name) + "`[ |]").MatchString(readmeTable) {
			t.Errorf("README.md's table of backends (| backend | RabbitMQ | ...) has no row for %s: add one", name)
		}
	}
}

// readmeBackends is the README's table of backends: from its header to the first line
// that is not a row.
func readmeBackends(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "\n| backend | RabbitMQ |")
	if !ok {
		t.Fatal("README.md has no table of backends (a header | backend | RabbitMQ | ...): TestDocsNameEveryBackend checks its rows")
	}
	var rows []string
	for _, line := range strings.Split(rest, "\n")[1:] {
		if !strings.HasPrefix(line, "|") {
			break
		}
		rows = append(rows, line)
	}
	return strings.Join(rows, "\n")
}

// TestDocCommandsWriteOutsideCheckout: a command the docs give through
// cmd/amqpretry/go.sh runs in cmd/amqpretry, so a relative -o writes into the checkout,
// which the README says it never does.
func TestDocCommandsWriteOutsideCheckout(t *testing.T) {
	out := regexp.MustCompile(`go\.sh build[^\n]*?-o\s+(\S+)`)
	for _, path := range []string{"README.md", "cmd/amqpretry/README.md", "cmd/amqpretry/go.sh"} {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range out.FindAllStringSubmatch(string(b), -1) {
			if o := m[1]; !filepath.IsAbs(o) {
				t.Errorf("%s: %q writes %s into the checkout (go.sh runs in cmd/amqpretry): give a path outside it, like /tmp/amqpretry", path, m[0], o)
			}
		}
	}
}

// TestExamplesUsePublicAPIOnly: every example is a module of its own that imports no
// internal package of the library, so that a user can copy it (scripts/examples.sh
// builds each copied into a fresh module outside the repository).
func TestExamplesUsePublicAPIOnly(t *testing.T) {
	var dirs []string
	for _, pattern := range []string{"_examples/*/main.go", "amqp1/examples/*/main.go"} {
		mains, err := filepath.Glob(pattern)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range mains {
			dirs = append(dirs, filepath.Dir(m))
		}
	}
	if len(dirs) < 2 {
		t.Fatalf("found the examples %v, want the two quickstarts at least", dirs)
	}
	fset := token.NewFileSet()
	for _, dir := range dirs {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
			t.Errorf("%s has no go.mod: an example is a module of its own", dir)
		}
		files, _ := filepath.Glob(filepath.Join(dir, "*.go"))
		for _, file := range files {
			f, err := parser.ParseFile(fset, file, nil, parser.ImportsOnly)
			if err != nil {
				t.Fatal(err)
			}
			for _, imp := range f.Imports {
				path, _ := strconv.Unquote(imp.Path.Value)
				if strings.HasPrefix(path, "github.com/amqpretry/amqpretry") && slices.Contains(strings.Split(path, "/"), "internal") {
					t.Errorf("%s imports %s: an example uses the public API only", file, path)
				}
			}
		}
	}
}

// TestGoDocDefaults: every "Default: X" that a field of Config or Policy documents is
// the value WithDefaults gives it, and Tiers' and Levels' docs give the default ladder.
func TestGoDocDefaults(t *testing.T) {
	def := amqpretry.Config{}.WithDefaults()
	values := map[string]reflect.Value{
		"Config": reflect.ValueOf(def),
		"Policy": reflect.ValueOf(def.Policy),
		"Outage": reflect.ValueOf(def.Outage),
	}
	defaultRe := regexp.MustCompile(`Default: ("[^"]*"|[0-9][0-9.]*[a-z]*)`)
	fset := token.NewFileSet()
	checked := 0
	for _, file := range []string{"config.go", "policy.go", "outage.go", "delay/ttltiers.go", "delay/binarylevels.go"} {
		f, err := parser.ParseFile(fset, file, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			// The backend settings' docs, on their constructors.
			if fd, ok := n.(*ast.FuncDecl); ok && fd.Recv == nil && fd.Doc != nil {
				doc := strings.Join(strings.Fields(fd.Doc.Text()), " ")
				switch where := "delay." + fd.Name.Name; fd.Name.Name {
				case "TTLTiers":
					checked++
					if m := regexp.MustCompile(`(\d+) tiers`).FindStringSubmatch(doc); m == nil || m[1] != strconv.Itoa(len(backend.DefaultTiers())) {
						t.Errorf("%s's doc gives %v tiers by default, the default ladder %d", where, m, len(backend.DefaultTiers()))
					}
					if last := figureDuration(slices.Max(backend.DefaultTiers())); !strings.Contains(doc, strings.ReplaceAll(last, " ", "")) {
						t.Errorf("%s's doc does not end the default ladder at %s", where, last)
					}
				case "BinaryLevels":
					checked++
					years := fmt.Sprintf("about %.1f years", longest(t, def, delay.BinaryLevels(0), time.Second).Hours()/24/365.25)
					if !strings.Contains(doc, years) || !strings.Contains(doc, "default, "+strconv.Itoa(backend.DefaultLevels)) {
						t.Errorf("%s's doc does not say the default, %d levels, keeps %s", where, backend.DefaultLevels, years)
					}
				}
				return true
			}
			ts, ok := n.(*ast.TypeSpec)
			if !ok || values[ts.Name.Name] == (reflect.Value{}) {
				return true
			}
			st := ts.Type.(*ast.StructType)
			for _, field := range st.Fields.List {
				if len(field.Names) != 1 || field.Doc == nil {
					continue
				}
				name := field.Names[0].Name
				doc := strings.Join(strings.Fields(field.Doc.Text()), " ")
				v := values[ts.Name.Name].FieldByName(name)
				where := ts.Name.Name + "." + name
				switch name {
				case "Tiers":
					if m := regexp.MustCompile(`(\d+) tiers`).FindStringSubmatch(doc); m == nil || m[1] != strconv.Itoa(len(backend.DefaultTiers())) {
						t.Errorf("%s's doc gives %v tiers by default, the default ladder %d", where, m, len(backend.DefaultTiers()))
					}
					if last := figureDuration(slices.Max(backend.DefaultTiers())); !strings.Contains(doc, strings.ReplaceAll(last, " ", "")) {
						t.Errorf("%s's doc does not end the default ladder at %s", where, last)
					}
				case "Levels":
					years := fmt.Sprintf("about %.1f years", longest(t, def, delay.BinaryLevels(0), time.Second).Hours()/24/365.25)
					if !strings.Contains(doc, years) {
						t.Errorf("%s's doc does not say the default keeps %s", where, years)
					}
				}
				m := defaultRe.FindStringSubmatch(doc)
				if m == nil {
					continue
				}
				text := strings.TrimSuffix(m[1], ".")
				var ok bool
				switch {
				case v.Type() == reflect.TypeOf(time.Duration(0)):
					d, err := time.ParseDuration(text)
					ok = err == nil && d == time.Duration(v.Int())
				case v.Kind() == reflect.String:
					s, err := strconv.Unquote(text)
					ok = err == nil && strings.ReplaceAll(s, "<Prefix>", def.Prefix) == v.String()
				case v.Kind() == reflect.Int:
					n, err := strconv.Atoi(text)
					ok = err == nil && int64(n) == v.Int()
				case v.Kind() == reflect.Float64:
					x, err := strconv.ParseFloat(text, 64)
					ok = err == nil && x == v.Float()
				default:
					continue
				}
				checked++
				if !ok {
					t.Errorf("%s's doc says Default: %s; WithDefaults gives %v", where, text, v)
				}
			}
			return false
		})
	}
	if checked < 10 {
		t.Errorf("checked only %d documented defaults", checked)
	}
}

// TestDocClaims checks, where a test can, what the docs say the library does (issue
// 51): each claim is a sentence of a doc, which must still say it (its whitespace
// folded), and the behaviour that makes it true, run in this process (GoChannel, the
// memory backend). wrong are sentences no doc may say any more.
func TestDocClaims(t *testing.T) {
	for _, c := range []struct {
		doc, claim string
		check      func(t *testing.T)
	}{
		{"docs/outage.md", "one at WARN when it begins (at INFO with a logger that has no `Warn` method, as Watermill's own loggers", outageBeginsAtWarnOrInfo},
		{"docs/cqrs.md", "The Retry recovers a handler's panic itself and retries it like an error (`amqpretry.ErrPanicked`, its stack in the envelope), whatever the order", panicRetriedWhateverTheOrder},
		{"README.md", "A panic is recovered whatever the order of `Recoverer`, and retried", panicRetriedWhateverTheOrder},
	} {
		t.Run(c.doc+": "+c.claim[:40], func(t *testing.T) {
			if !strings.Contains(folded(t, c.doc), c.claim) {
				t.Fatalf("%s no longer says: %s", c.doc, c.claim)
			}
			c.check(t)
		})
	}
	for doc, wrong := range map[string]string{
		"docs/cqrs.md":   "a panic would skip the retry and be redelivered at once",
		"docs/outage.md": "one at WARN when it begins, `Work queue in an outage",
	} {
		if strings.Contains(folded(t, doc), wrong) {
			t.Errorf("%s says %q, which the library does not do", doc, wrong)
		}
	}
}

// folded is the text of doc with every run of white space one space.
func folded(t *testing.T, doc string) string {
	t.Helper()
	b, err := os.ReadFile(doc)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(strings.Fields(string(b)), " ")
}

// inProcess runs handler on a topic through an in-process Retry (GoChannel, the memory
// backend) of cfg, added with AddHandler to a router with the router-level middlewares
// given, and publishes one message to it. stop closes the router, then the Retry.
func inProcess(t *testing.T, cfg amqpretry.Config, handler message.NoPublishHandlerFunc, middlewares ...message.HandlerMiddleware) (stop func()) {
	t.Helper()
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	cfg.Backend = delay.Memory(pubsub)
	r, err := wamqp3.New(wamqpv3.Config{}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(middlewares...)
	if _, err := r.AddHandler(router, "claims", "claims", handler); err != nil {
		t.Fatal(err)
	}
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	if err := pubsub.Publish("claims", message.NewMessage("m1", []byte("{}"))); err != nil {
		t.Fatal(err)
	}
	return func() { _ = router.Close(); _ = r.Close(); _ = pubsub.Close() }
}

// warnLogger is logger with a Warn method: the library's WARN level.
type warnLogger struct{ logger }

func (g warnLogger) Warn(msg string, f watermill.LogFields) { g.l.add("WARN", msg, nil, f) }

// outageBeginsAtWarnOrInfo: the line that begins an outage is at WARN where the logger
// has a Warn method, at INFO where it has none; never at ERROR.
func outageBeginsAtWarnOrInfo(t *testing.T) {
	const begins = "Work queue in an outage"
	for level, log := range map[string]func(*logged) watermill.LoggerAdapter{
		"WARN": func(l *logged) watermill.LoggerAdapter { return warnLogger{logger{l}} },
		"INFO": func(l *logged) watermill.LoggerAdapter { return logger{l} },
	} {
		l := &logged{}
		cfg := amqpretry.Config{Logger: log(l), Outage: amqpretry.Outage{ProbeInterval: time.Hour}}
		stop := inProcess(t, cfg, func(*message.Message) error { return amqpretry.Unavailable(errors.New("database down")) })
		deadline := time.Now().Add(10 * time.Second)
		for len(l.matching(begins)) == 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		stop()
		lines := l.matching(begins)
		if len(lines) != 1 || !strings.HasPrefix(lines[0], level+" ") || !strings.Contains(lines[0], "err=database down") {
			t.Errorf("outage begun: %q, want one line at %s with its error", lines, level)
		}
	}
}

// panicRetriedWhateverTheOrder: a handler's panic is retried like an error, with
// Watermill's Recoverer outside the Retry's middleware (on the router) as inside it.
func panicRetriedWhateverTheOrder(t *testing.T) {
	for _, recovererOutside := range []bool{true, false} {
		var attempts []int
		var mu sync.Mutex
		done := make(chan struct{})
		var once sync.Once
		handler := func(msg *message.Message) error {
			mu.Lock()
			attempts = append(attempts, amqpretry.Attempt(msg))
			mu.Unlock()
			if amqpretry.Attempt(msg) == 1 {
				panic("inventory gone")
			}
			once.Do(func() { close(done) })
			return nil
		}
		cfg := amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{time.Millisecond}}}
		var stop func()
		if recovererOutside {
			stop = inProcess(t, cfg, handler, wmiddleware.Recoverer)
		} else {
			stop = inProcess(t, cfg, func(msg *message.Message) error {
				_, err := wmiddleware.Recoverer(func(msg *message.Message) ([]*message.Message, error) { return nil, handler(msg) })(msg)
				return err
			})
		}
		select {
		case <-done:
		case <-time.After(10 * time.Second):
		}
		stop()
		mu.Lock()
		if !slices.Equal(attempts, []int{1, 2}) {
			t.Errorf("Recoverer outside the Retry %v: attempts %v, want [1 2]", recovererOutside, attempts)
		}
		mu.Unlock()
	}
}
