package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/chromedp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/derived"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

// chromiumEnv names the variable that may give the browser's path.
const chromiumEnv = "AMQPRETRY_CHROMIUM"

// screenshotEnv names the variable that, set to a path, makes the browser test write
// its screenshot of the poison page there (docs/console.png comes from it).
const screenshotEnv = "AMQPRETRY_CONSOLE_SCREENSHOT"

// browser starts a headless Chromium for the test, or skips it (fails it under
// CI=true, where scripts/test.sh installs Chromium) when there is none.
func browser(t *testing.T) context.Context {
	t.Helper()
	path := os.Getenv(chromiumEnv)
	if path == "" {
		for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
			if p, err := exec.LookPath(name); err == nil {
				path = p
				break
			}
		}
	}
	if path == "" {
		msg := "no Chromium for the browser tests (apt-get install chromium, or set " + chromiumEnv + "); scripts/test.sh installs it under CI=true"
		if brokertest.CI() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	opts := append(slices.Clone(chromedp.DefaultExecAllocatorOptions[:]),
		chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1200, 800))
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelCtx := chromedp.NewContext(alloc)
	t.Cleanup(func() { cancelCtx(); cancelAlloc() })
	if err := chromedp.Do(ctx); err != nil { // starts the browser, on a context without a timeout
		t.Fatalf("start %s: %v", path, err)
	}
	return ctx
}

// dueWithinTenMinutes matches the "(in 9m…)" of a retry due 10 minutes after its
// publish, read any time in those 10 minutes (a loaded machine is slow to get there).
var dueWithinTenMinutes = regexp.MustCompile(`\(in [0-9]m[0-9]+s\)`)

// browserStep bounds each browser call.
const browserStep = time.Minute

// act runs the browser steps, one after the other, failing the test on an error. A step
// that failed because the page changed under it (a node or an execution context of a
// document that was replaced, which chromedp hears of late on a loaded machine) runs
// again once the page is ready: such an error comes before a click dispatches any
// mouse event (it fails while resolving the node), so nothing happened twice.
func act(t *testing.T, ctx context.Context, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, browserStep)
	defer cancel()
	for _, step := range steps {
		err := chromedp.Do(ctx, step)
		for try := 1; err != nil && stale(err) && try < 5; try++ {
			if err = chromedp.Do(ctx, chromedp.WaitReady(chromedp.CSS("body"))); err == nil {
				err = chromedp.Do(ctx, step)
			}
		}
		if err != nil {
			t.Fatalf("browser: %s: %v\n%s", what, err, page(ctx))
		}
	}
}

// stale tells whether err is the browser's for a node or an execution context that is
// gone with the document it belonged to.
func stale(err error) bool {
	for _, s := range []string{"Could not find node with given id", "No node with given id found", "Cannot find context with specified id", "Node is detached from document", "Execution context was destroyed"} {
		if strings.Contains(err.Error(), s) {
			return true
		}
	}
	return false
}

// page returns the text of the page the browser shows, for a failure's message.
func page(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	text, err := chromedp.Run(ctx, chromedp.Evaluate[string](`location.href + "\n" + document.body.innerText`))
	if err != nil {
		return "(page unreadable: " + err.Error() + ")"
	}
	return text
}

// read runs one browser action and returns its value, failing the test on an error.
func read[T any](t *testing.T, ctx context.Context, what string, a chromedp.Action[T]) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, browserStep)
	defer cancel()
	v, err := chromedp.Run(ctx, a)
	for try := 1; err != nil && stale(err) && try < 5; try++ { // as act: a read changes nothing
		if err = chromedp.Do(ctx, chromedp.WaitReady(chromedp.CSS("body"))); err == nil {
			v, err = chromedp.Run(ctx, a)
		}
	}
	if err != nil {
		t.Fatalf("browser: %s: %v", what, err)
	}
	return v
}

// consumer records the Watermill UUIDs of what a work queue delivers.
type consumer struct {
	mu   sync.Mutex
	got  []string
	seen chan struct{}
}

func consume(t *testing.T, queue string) *consumer {
	t.Helper()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	deliveries, err := ch.Consume(queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := &consumer{seen: make(chan struct{}, 100)}
	go func() {
		for d := range deliveries {
			msg, err := (xdeath.Marshaler{}).Unmarshal(d)
			if err != nil {
				continue
			}
			c.mu.Lock()
			c.got = append(c.got, msg.UUID)
			c.mu.Unlock()
			c.seen <- struct{}{}
		}
	}()
	t.Cleanup(func() { _ = ch.Close() })
	return c
}

// wait waits until the consumer has handled uuid.
func (c *consumer) wait(t *testing.T, uuid string) {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		c.mu.Lock()
		done := slices.Contains(c.got, uuid)
		c.mu.Unlock()
		if done {
			return
		}
		select {
		case <-c.seen:
		case <-deadline:
			t.Fatalf("the consumer never handled %s (got %v)", uuid, c.got)
		}
	}
}

// xssPayload would set window.__xss if anything in it ran.
const xssPayload = `<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">`

// TestConsoleBrowser (ttl-tiers): in headless Chromium, the overview's counts equal
// status --json; the chart of the waiting retries sums to waiting list --json, and one
// of them comes back now through its confirmation; a poisoned message's envelope
// reads as written, one with a script in its payload and error shows it as text and
// runs nothing; a poisoned message is redriven through its dry run and confirmation
// (three clicks from the overview) and a running consumer handles it; read-only mode
// shows no action. The overview and the delay queues' page show every queue once.
func TestConsoleBrowser(t *testing.T) {
	ctx := browser(t)
	if _, err := brokertest.Ctl(t.Context(), "-q", "list_queues", "name"); err != nil {
		t.Skipf("needs rabbitmqctl for the waiting retries: %v", err)
	}
	e := newEnv(t, "orders")
	queue := e.queues[0]
	cfg := amqpretry.Config{Prefix: e.prefix, Backend: delay.TTLTiers(time.Minute, 10*time.Minute)}
	p, err := cfg.Plan(queue)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p)
	flags := []string{"--prefix", e.prefix, "--tiers", "1m,10m"}
	if code, out, errOut := runArgs(append([]string{"topology", "apply", "--queue", queue}, flags...)...); code != exitOK {
		t.Fatalf("apply: %d %s%s", code, out, errOut)
	}
	flags = append(flags, "--rabbitmqctl", strings.Join(brokertest.CtlCommand(), " "))
	e.poison(2)
	xss := message.NewMessage("m-xss", []byte(xssPayload))
	middleware.Envelope{Queue: queue, Handler: "h", Reason: amqpretry.ReasonPermanent, Error: "bad input " + xssPayload,
		Attempt: 1, MaxAttempts: 5, LastFailure: time.Now()}.Write(xss.Metadata)
	xss.Metadata["note"] = xssPayload
	if err := e.h.ToQueue(context.Background(), e.prefix+".poison", xss); err != nil {
		t.Fatal(err)
	}
	c := cfg.WithDefaults()
	b, err := derived.Of(c).Open(backend.Env{Handoff: e.h})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"w-a", "w-b", "w-c"} {
		msg := message.NewMessage(id, []byte(id))
		middleware.Envelope{Queue: queue, Attempt: 2, Due: time.Now().Add(10 * time.Minute), LastFailure: time.Now(), Error: "timeout"}.Write(msg.Metadata)
		wdelay.Message(msg, wdelay.For(10*time.Minute))
		if err := (backend.Scheduler{Backend: b}).Publish(queue, msg); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for waitingJSON(t, append([]string{"--queue", queue}, flags...)...) != 3 {
		if time.Now().After(deadline) {
			t.Fatal("waiting list never showed the 3 retries")
		}
	}

	con := startConsole(t, append([]string{"--queue", queue}, flags...)...)
	act(t, ctx, "open the console", chromedp.Navigate(con.start), chromedp.WaitVisible(chromedp.CSS("#queues")))
	if location := read(t, ctx, "read the address", chromedp.Location()); strings.Contains(location, "token") {
		t.Errorf("the token stays in the address: %s", location)
	}

	// The overview's counts, and those of the delay queues' page, are status --json's.
	const queueRows = `[...document.querySelectorAll("#queues tbody tr")].map(r => [r.dataset.queue, r.querySelector(".ready").textContent.trim()])`
	rows := read(t, ctx, "read the overview", chromedp.Evaluate[[][]string](queueRows))
	// The delay storage in one line: what waits there, read with rabbitmqctl, and when the first is due.
	if line := read(t, ctx, "read the delay storage", chromedp.Evaluate[string](`document.querySelector("#delay-storage")?.textContent ?? ""`)); !strings.HasPrefix(line, "delay storage: 2 queues, 3 messages waiting, next due 20") || !dueWithinTenMinutes.MatchString(line) {
		t.Errorf("the delay storage line: %q", line)
	}
	// The overview has a #queues too: wait for the delay page's own line before reading it.
	act(t, ctx, "open the delay queues", chromedp.Click(chromedp.CSS("#delay-queues")),
		chromedp.WaitVisible(chromedp.CSS("p.meta#delay-storage")), chromedp.WaitVisible(chromedp.CSS("#queues")))
	rows = append(rows, read(t, ctx, "read the delay queues", chromedp.Evaluate[[][]string](queueRows))...)
	act(t, ctx, "back to the overview", chromedp.Navigate(con.base+"/"), chromedp.WaitVisible(chromedp.CSS("#queues")))
	want := statusJSON(t, append([]string{"--queue", queue}, flags...)...)
	if len(rows) != len(want) || len(rows) == 0 {
		t.Errorf("overview shows %d queues, status %d: %v", len(rows), len(want), rows)
	}
	for _, r := range rows {
		n, ok := want[r[0]]
		if !ok || (n >= 0 && r[1] != fmt.Sprint(n)) || (n < 0 && r[1] != "-") {
			t.Errorf("overview: queue %s ready %s; status --json: %d (known: %t)", r[0], r[1], n, ok)
		}
	}
	if waiting := read(t, ctx, "read the waiting retries", chromedp.Text(chromedp.CSS(`#waiting tr[data-queue="`+queue+`"] .waiting`))); waiting != "3" {
		t.Errorf("overview: %s waiting retries, want 3", waiting)
	}

	// The chart sums to waiting list --json; one retry comes back now.
	// From a fresh overview: it reloads itself every 10 s, which a click must not meet.
	act(t, ctx, "open the waiting retries", chromedp.Navigate(con.base+"/"), chromedp.WaitVisible(chromedp.CSS("#waiting")),
		chromedp.Click(chromedp.CSS(`#waiting tr[data-queue="`+queue+`"] a`)), chromedp.WaitVisible(chromedp.CSS("#chart")))
	sum := read(t, ctx, "sum the chart", chromedp.Evaluate[int](chartSum))
	if listed := waitingJSON(t, append([]string{"--queue", queue}, flags...)...); sum != listed || sum != 3 {
		t.Errorf("the chart's buckets sum to %d, waiting list --json lists %d (want 3)", sum, listed)
	}
	act(t, ctx, "retry one now: dry run",
		chromedp.Click(chromedp.CSS(`#retries tr[data-id="w-b"] input[type=checkbox]`)),
		chromedp.Click(chromedp.CSS("#retry-selected")), chromedp.WaitVisible(chromedp.CSS("#dry-run")))
	dry := read(t, ctx, "read the dry run", chromedp.Text(chromedp.CSS("#dry-run")))
	act(t, ctx, "confirm", chromedp.Click(chromedp.CSS("#confirm-button")), chromedp.WaitVisible(chromedp.CSS("#result")))
	result := read(t, ctx, "read the result", chromedp.Text(chromedp.CSS("#result")))
	if !strings.HasPrefix(dry, "Dry run: 1 of 3") || !strings.HasPrefix(result, "1 retried now") {
		t.Errorf("retry now: dry run %q, result %q", dry, result)
	}
	if n := brokertest.QueueLength(t, queue); n != 1 {
		t.Errorf("work queue has %d after retry now, want 1", n)
	}

	act(t, ctx, "an unknown work queue", chromedp.Navigate(con.base+"/waiting?queue=nope"), chromedp.WaitVisible(chromedp.CSS("#error")))
	if text := read(t, ctx, "read the error", chromedp.Text(chromedp.CSS("#error"))); !strings.HasPrefix(text, `unknown work queue "nope"`) {
		t.Errorf("an unknown work queue: %q", text)
	}

	// A poisoned message's envelope; the script in another one is text.
	act(t, ctx, "open a poisoned message", chromedp.Navigate(con.base+"/poison"), chromedp.WaitVisible(chromedp.CSS("#messages")),
		chromedp.Click(chromedp.CSS(`#messages tr[data-id="m0001"] a.open`)), chromedp.WaitVisible(chromedp.CSS("#envelope")))
	envelope := read(t, ctx, "read the envelope", chromedp.Evaluate[map[string]string](`Object.fromEntries([...document.querySelectorAll("#envelope td[id]")].map(td => [td.id, td.textContent]))`))
	if envelope["env-error"] != "warehouse offline" || envelope["env-attempts"] != "5 of 5" || envelope["env-queue"] != queue ||
		envelope["env-reason"] != "max-attempts" || envelope["env-handler"] != "h" || envelope["env-types"] != "*errors.errorString" {
		t.Errorf("envelope: %v", envelope)
	}
	act(t, ctx, "open the message with a script", chromedp.Navigate(con.base+"/message?source=poison&id=m-xss"), chromedp.WaitVisible(chromedp.CSS("#payload")))
	payload := read(t, ctx, "read the payload", chromedp.TextContent(chromedp.CSS("#payload")))
	errText := read(t, ctx, "read the error", chromedp.TextContent(chromedp.CSS("#env-error")))
	if xssSet := read(t, ctx, "window.__xss", chromedp.Evaluate[string](`typeof window.__xss`)); payload != xssPayload || errText != "bad input "+xssPayload || xssSet != "undefined" {
		t.Errorf("script payload: shown %q, error %q, window.__xss %s", payload, errText, xssSet)
	}
	act(t, ctx, "the list with the script", chromedp.Navigate(con.base+"/poison"), chromedp.WaitVisible(chromedp.CSS("#groups")))
	if xssSet := read(t, ctx, "window.__xss", chromedp.Evaluate[string](`typeof window.__xss`)); xssSet != "undefined" {
		t.Errorf("the poison list ran the script: window.__xss %s", xssSet)
	}
	if path := os.Getenv(screenshotEnv); path != "" {
		png := read(t, ctx, "screenshot", chromedp.CaptureScreenshot())
		if err := os.WriteFile(filepath.Clean(path), png, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	// Redrive in three clicks from the overview: Poison, the row's Redrive, Confirm.
	got := consume(t, queue)
	act(t, ctx, "redrive: dry run",
		chromedp.Navigate(con.base+"/"), chromedp.WaitVisible(chromedp.CSS("#queues")),
		chromedp.Click(chromedp.CSS(`#queues tr[data-role="poison"] a`)), chromedp.WaitVisible(chromedp.CSS("#messages")),
		chromedp.Click(chromedp.CSS(`#messages tr[data-id="m0000"] button.redrive-one`)), chromedp.WaitVisible(chromedp.CSS("#dry-run")))
	dry = read(t, ctx, "read the dry run", chromedp.Text(chromedp.CSS("#dry-run")))
	act(t, ctx, "confirm", chromedp.Click(chromedp.CSS("#confirm-button")), chromedp.WaitVisible(chromedp.CSS("#result")))
	result = read(t, ctx, "read the result", chromedp.Text(chromedp.CSS("#result")))
	if !strings.HasPrefix(dry, "Dry run: 1 of 3 messages in "+e.prefix+".poison would be redriven") || !strings.HasPrefix(result, "1 redriven, of 3") {
		t.Errorf("redrive: dry run %q, result %q", dry, result)
	}
	got.wait(t, "m0000")
	if audit := con.stderr.String(); strings.Count(audit, "audit ") != 2 || !strings.Contains(audit, "action=poison.redrive") || !strings.Contains(audit, "action=waiting.retry-now") {
		t.Errorf("audit lines:\n%s", audit)
	}

	// Read-only: no action anywhere.
	ro := startConsole(t, append([]string{"--queue", queue, "--read-only"}, flags...)...)
	for _, page := range []string{"/", "/delay", "/poison", "/message?source=poison&id=m0001", "/waiting?queue=" + queue, "/parking"} {
		target := ro.start
		if page != "/" {
			target = ro.base + page
		}
		act(t, ctx, "read-only "+page, chromedp.Navigate(target), chromedp.WaitVisible(chromedp.CSS("main h1")))
		if n := read(t, ctx, "count the actions", chromedp.Evaluate[int](`document.querySelectorAll("form[method=post], button.redrive-one, #confirm-button, input[name=csrf]").length`)); n != 0 {
			t.Errorf("read-only %s shows %d actions", page, n)
		}
	}
	if n := read(t, ctx, "the badge", chromedp.Evaluate[int](`document.querySelectorAll("#read-only").length`)); n != 1 {
		t.Errorf("read-only: no read-only badge")
	}
}

// chartSum sums the buckets of the chart of due times.
const chartSum = `[...document.querySelectorAll("#chart g.bucket")].reduce((s, g) => s + Number(g.dataset.count), 0)`

// TestConsoleBrowserDelayedRetry (RabbitMQ 4.3: AMQP_URI_43): the retries a work queue
// holds in delayed retry show in the chart, as waiting list --json lists them, and
// come back now through the confirmation.
func TestConsoleBrowserDelayedRetry(t *testing.T) {
	uri := os.Getenv("AMQP_URI_43")
	if uri == "" {
		t.Skip("AMQP_URI_43 unset: no RabbitMQ 4.3 for delayed retry (scripts/test.sh runs this in its RabbitMQ 4.3 section; by hand: AMQP_URI_43=$(scripts/rabbitmq4.sh 4.3 uri) AMQP_URI=$AMQP_URI_43 AMQPRETRY_RABBITMQCTL=\"scripts/rabbitmq4.sh 4.3 ctl\")")
	}
	if uri != brokertest.URI() {
		t.Skip("AMQP_URI_43 is not AMQP_URI: this test runs in the RabbitMQ 4.3 pass, where rabbitmqctl reaches that node")
	}
	ctx := browser(t)
	if _, err := brokertest.Ctl(t.Context(), "-q", "list_queues", "name"); err != nil {
		t.Fatalf("rabbitmqctl does not reach RabbitMQ 4.3: %v", err)
	}
	e := newEnv(t, "orders")
	queue := e.queues[0]
	cfg := amqpretry.Config{Prefix: e.prefix, Backend: delay.DelayedRetry(10 * time.Minute)}
	p, err := cfg.Plan(queue)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p)
	flags := []string{"--prefix", e.prefix, "--backend", "delayed-retry", "--retry-delay", "10m"}
	if code, out, errOut := runArgs(append([]string{"topology", "apply", "--queue", queue}, flags...)...); code != exitOK {
		t.Fatalf("apply: %d %s%s", code, out, errOut)
	}
	flags = append(flags, "--rabbitmqctl", strings.Join(brokertest.CtlCommand(), " "))
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	for i := range 3 {
		if err := ch.Publish("", queue, false, false, amqp.Publishing{MessageId: fmt.Sprint("d-", i)}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for taken := 0; taken < 3; { // fail each once: the broker holds it 10 minutes
		d, ok, err := ch.Get(queue, false)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			if time.Now().After(deadline) {
				t.Fatalf("only %d of 3 published messages arrived", taken)
			}
			continue
		}
		if err := d.Nack(false, true); err != nil {
			t.Fatal(err)
		}
		taken++
	}
	for waitingJSON(t, append([]string{"--queue", queue}, flags...)...) != 3 {
		if time.Now().After(deadline) {
			t.Fatal("waiting list never showed the 3 held retries")
		}
	}
	con := startConsole(t, append([]string{"--queue", queue}, flags...)...)
	act(t, ctx, "open the waiting retries", chromedp.Navigate(con.start), chromedp.WaitVisible(chromedp.CSS("#queues")),
		chromedp.Navigate(con.base+"/waiting?queue="+queue), chromedp.WaitVisible(chromedp.CSS("#chart")))
	if sum := read(t, ctx, "sum the chart", chromedp.Evaluate[int](chartSum)); sum != 3 {
		t.Errorf("the chart's buckets sum to %d, want the 3 waiting list --json lists", sum)
	}
	act(t, ctx, "retry all now: dry run", chromedp.Click(chromedp.CSS("#retry-filter button")), chromedp.WaitVisible(chromedp.CSS("#dry-run")))
	dry := read(t, ctx, "read the dry run", chromedp.Text(chromedp.CSS("#dry-run")))
	act(t, ctx, "confirm", chromedp.Click(chromedp.CSS("#confirm-button")), chromedp.WaitVisible(chromedp.CSS("#result")))
	result := read(t, ctx, "read the result", chromedp.Text(chromedp.CSS("#result")))
	if !strings.HasPrefix(dry, "Dry run: 3 of 3") || !strings.HasPrefix(result, "3 retried now") {
		t.Errorf("retry now: dry run %q, result %q", dry, result)
	}
	deadline = time.Now().Add(30 * time.Second)
	for { // the broker puts them back asynchronously
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if q.Messages == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the work queue has %d after retry now, want 3", q.Messages)
		}
	}
	_, _ = ch.QueuePurge(queue, false)
}
