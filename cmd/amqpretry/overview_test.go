package main

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/console"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

// overviewScene is issue 43's first screen: ttl-tiers with tiers of 1.25s and 3.15s, a
// poison queue of 10, a work queue (backlog) with 10 ready and no consumer, and one
// (idle) empty.
type overviewScene struct {
	*env
	flags            []string // --prefix, --tiers, and --queue for both work queues
	backlog, idle    string
	tiers            []string // the delay queues
	tierNames        []string // their TTLs as configured
	poisoned, queued int
}

func newOverviewScene(t *testing.T) *overviewScene {
	t.Helper()
	e := newEnv(t, "backlog", "idle")
	tiers := []time.Duration{1250 * time.Millisecond, 3150 * time.Millisecond}
	p, err := amqpretry.Config{Prefix: e.prefix, Backend: delay.TTLTiers(tiers...)}.Plan(e.queues...)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, p)
	s := &overviewScene{env: e, backlog: e.queues[0], idle: e.queues[1], poisoned: 10, queued: 10,
		tiers:     []string{e.prefix + ".delay.1.25s", e.prefix + ".delay.3.15s"},
		tierNames: []string{"1.25s", "3.15s"}}
	s.flags = append([]string{"--prefix", e.prefix, "--tiers", "1.25s,3.15s"}, e.queueFlags()...)
	if code, out, errOut := runArgs(append([]string{"topology", "apply"}, s.flags...)...); code != exitOK {
		t.Fatalf("apply: %d %s%s", code, out, errOut)
	}
	e.poison(s.poisoned)
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	for i := range s.queued {
		c, err := ch.PublishWithDeferredConfirm("", s.backlog, true, false, amqp.Publishing{Body: []byte{byte(i)}})
		if err != nil {
			t.Fatal(err)
		}
		if ok, err := c.WaitContext(t.Context()); !ok || err != nil {
			t.Fatalf("publish to %s: acked %t, %v", s.backlog, ok, err)
		}
	}
	// The broker shows a confirmed message as ready a moment later: wait for it.
	for deadline := time.Now().Add(10 * time.Second); brokertest.QueueLength(t, s.backlog) != s.queued || brokertest.QueueLength(t, e.prefix+".poison") != s.poisoned; {
		if time.Now().After(deadline) {
			t.Fatalf("%s has %d, the poison queue %d: want %d and %d", s.backlog, brokertest.QueueLength(t, s.backlog), brokertest.QueueLength(t, e.prefix+".poison"), s.queued, s.poisoned)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return s
}

// tableNames returns the first column of the status table (between its QUEUE header
// and the first empty line).
func tableNames(t *testing.T, out string) (names []string, rows map[string]string) {
	t.Helper()
	rows = map[string]string{}
	in := false
	for _, line := range strings.Split(out, "\n") {
		switch {
		case strings.HasPrefix(line, "QUEUE "):
			in = true
		case in && strings.TrimSpace(line) == "":
			return names, rows
		case in:
			name := strings.Fields(line)[0]
			names = append(names, name)
			rows[name] = line
		}
	}
	if !in {
		t.Fatalf("no QUEUE table in:\n%s", out)
	}
	return names, rows
}

// TestStatusOverviewOrder (issue 43): status shows first the poison and parking
// queues, then the work queue with a backlog and no consumer (NO CONSUMER), then the
// other work queue; the delay queues are one line (how many, what waits) unless
// --verbose, which lists them after the rest, their TTLs as configured (1.25s, not
// 1.3s). It said all of it in Status.Queues' order, delay queues first.
func TestStatusOverviewOrder(t *testing.T) {
	s := newOverviewScene(t)
	p := s.prefix
	code, out, errOut := runArgs(append([]string{"status", "--rabbitmqctl", "off"}, s.flags...)...)
	if code != exitOK {
		t.Fatalf("status exited %d:\n%s%s", code, out, errOut)
	}
	names, rows := tableNames(t, out)
	if want := []string{p + ".poison", p + ".parking", s.backlog, s.idle}; strings.Join(names, " ") != strings.Join(want, " ") {
		t.Errorf("status lists %v, want %v:\n%s", names, want, out)
	}
	if !regexp.MustCompile(`^`+regexp.QuoteMeta(p)+`\.poison\s+poison\s+10\s`).MatchString(rows[p+".poison"]) ||
		!regexp.MustCompile(`\s10\s.*\s0\s.*NO CONSUMER$`).MatchString(rows[s.backlog]) || !strings.HasSuffix(rows[s.idle], " ok") {
		t.Errorf("status rows:\n%s", out)
	}
	if !strings.Contains(out, "\ndelay storage: 2 queues, 0 ready") || !strings.Contains(out, "each queue: status --verbose") {
		t.Errorf("no delay storage line:\n%s", out)
	}
	// Flags come before the delay storage line.
	if i, j := strings.Index(out, "nothing flagged"), strings.Index(out, "delay storage:"); i < 0 || j < i {
		t.Errorf("the delay storage line comes before what is flagged:\n%s", out)
	}

	code, out, errOut = runArgs(append([]string{"status", "--verbose", "--rabbitmqctl", "off"}, s.flags...)...)
	if code != exitOK {
		t.Fatalf("status --verbose exited %d:\n%s%s", code, out, errOut)
	}
	names, rows = tableNames(t, out)
	if want := []string{p + ".poison", p + ".parking", s.backlog, s.idle, s.tiers[0], s.tiers[1]}; strings.Join(names, " ") != strings.Join(want, " ") {
		t.Errorf("status --verbose lists %v, want %v:\n%s", names, want, out)
	}
	for i, q := range s.tiers {
		if !regexp.MustCompile(`\s` + regexp.QuoteMeta(s.tierNames[i]) + `\s+-\s+ok$`).MatchString(rows[q]) {
			t.Errorf("status --verbose: %s does not show its TTL %s:\n%s", q, s.tierNames[i], out)
		}
	}
	if strings.Contains(out, "status --verbose") {
		t.Errorf("status --verbose points to itself:\n%s", out)
	}
}

// TestConsoleBrowserOverview (issue 43), in headless Chromium: the overview shows the
// poison and parking queues first, then the work queue with a backlog and no consumer,
// then the other; the delay queues are one line, with a link to their page (order).
// Their TTLs read as configured: 1.25s and 3.15s, not 1.3s and 3.2s (ttl). A read-only
// console answers a POST with 403 saying it is read-only and how it was started; it
// asked to reload the page and try again (read-only).
func TestConsoleBrowserOverview(t *testing.T) {
	ctx := browser(t)
	s := newOverviewScene(t)
	p := s.prefix
	con := startConsole(t, append([]string{"--rabbitmqctl", "off"}, s.flags...)...)
	act(t, ctx, "open the console", chromedp.Navigate(con.start), chromedp.WaitVisible(chromedp.CSS("#queues")))
	// Rows of the table on the page: the queue, then the text of each cell.
	const queueRows = `[...document.querySelectorAll("#queues tbody tr")].map(r => [r.dataset.queue, ...[...r.cells].map(c => c.textContent.trim())])`

	t.Run("order", func(t *testing.T) {
		act(t, ctx, "open the overview", chromedp.Navigate(con.base+"/"), chromedp.WaitVisible(chromedp.CSS("#queues")))
		var got [][]string
		for _, r := range read(t, ctx, "read the overview", chromedp.Evaluate[[][]string](queueRows)) {
			got = append(got, []string{r[0], r[3], r[10]}) // queue, ready, state
		}
		want := [][]string{{p + ".poison", "10", "ok"}, {p + ".parking", "0", "ok"}, {s.backlog, "10", "NO CONSUMER"}, {s.idle, "0", "ok"}}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("the overview's queues:\n got %v\nwant %v", got, want)
		}
		// What comes first on the page: the queues' table, then the flags, then the delay storage.
		order := read(t, ctx, "read the order", chromedp.Evaluate[[]string](`[...document.querySelectorAll("main > *")].map(e => e.id).filter(id => id)`))
		if strings.Join(order, " ") != "queues flags delay-storage" {
			t.Errorf("the overview's sections: %v, want queues, flags, delay-storage", order)
		}
		line := read(t, ctx, "read the delay storage", chromedp.Evaluate[string](`document.querySelector("#delay-storage")?.textContent ?? ""`))
		if !strings.HasPrefix(line, "delay storage: 2 queues, 0 ready") {
			t.Errorf("the delay storage line: %q", line)
		}
		if link := read(t, ctx, "read the link", chromedp.Evaluate[string](`document.querySelector("#delay-queues")?.getAttribute("href") ?? ""`)); link != "/delay" {
			t.Errorf("the link to the delay queues: %q", link)
		}
	})

	t.Run("ttl", func(t *testing.T) {
		// Wherever the console shows them: the overview, the delay queues' page.
		ttls := map[string]string{}
		for _, page := range []string{"/", "/delay"} {
			act(t, ctx, "open "+page, chromedp.Navigate(con.base+page), chromedp.WaitVisible(chromedp.CSS("main h1")))
			for _, r := range read(t, ctx, "read the TTLs", chromedp.Evaluate[[][]string](queueRows)) {
				if strings.Contains(r[0], ".delay.") {
					ttls[r[0]] = r[8]
				}
			}
		}
		if want := map[string]string{s.tiers[0]: s.tierNames[0], s.tiers[1]: s.tierNames[1]}; fmt.Sprint(ttls) != fmt.Sprint(want) {
			t.Errorf("the delay queues' TTLs: %v, want %v", ttls, want)
		}
	})

	t.Run("read-only", func(t *testing.T) {
		// A form posted (without the CSRF token its pages never carry, or with it), and
		// the same POST over HTTP for its status.
		ro := startConsole(t, append([]string{"--rabbitmqctl", "off", "--read-only"}, s.flags...)...)
		move := url.Values{"source": {"poison"}, "action": {"redrive"}, "step": {"do"}, "id": {"m0000"}}
		for _, csrf := range []string{"", console.CSRF(ro.token)} {
			form := maps.Clone(move)
			if csrf != "" {
				form.Set("csrf", csrf)
			}
			fields, _ := json.Marshal(form)
			act(t, ctx, "post a form to the read-only console", chromedp.Navigate(ro.start), chromedp.WaitVisible(chromedp.CSS("#queues")),
				chromedp.Evaluate[chromedp.Void](`(() => { const f = document.createElement("form"); f.method = "post"; f.action = "/move";
				for (const [k, vs] of Object.entries(`+string(fields)+`)) for (const v of vs) { const i = document.createElement("input"); i.name = k; i.value = v; f.append(i); }
				document.body.append(f); f.submit(); })()`))
			waitPath(t, ctx, "/move")
			answer := read(t, ctx, "read the answer", chromedp.Evaluate[string](`(document.querySelector("main") ?? document.body).innerText`))
			if heading, says, _ := strings.Cut(answer, "\n"); heading != "Error 403" || !strings.HasPrefix(strings.TrimSpace(says), "this console is read-only (started with --read-only)") {
				t.Errorf("a form posted to the read-only console (CSRF %t):\n%.600s", csrf != "", answer)
			}
			cl := ro.client(t)
			if resp, err := cl.Get(ro.start); err == nil {
				_ = resp.Body.Close()
			}
			if status, body := post(t, cl, ro.base+"/move", form); status != http.StatusForbidden || !strings.Contains(body, "this console is read-only (started with --read-only)") ||
				strings.Contains(body, "reload the page") {
				t.Errorf("a POST to the read-only console (CSRF %t): %d %.600s", csrf != "", status, body)
			}
		}
		if n := brokertest.QueueLength(t, p+".poison"); n != s.poisoned {
			t.Errorf("the read-only console moved messages: %d left of %d", n, s.poisoned)
		}
	})
}

// waitPath waits until the browser has loaded a page at path (the answer to a form
// posted: the page navigates meanwhile, which fails an evaluation).
func waitPath(t *testing.T, ctx context.Context, path string) {
	t.Helper()
	deadline := time.Now().Add(browserStep)
	for {
		step, cancel := context.WithTimeout(ctx, 5*time.Second)
		at, err := chromedp.Run(step, chromedp.Evaluate[string](`location.pathname + " " + document.readyState`))
		cancel()
		if err == nil && at == path+" complete" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("browser: no page %s loaded within %s (at %q, %v)", path, browserStep, at, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// holdDeliveries publishes n messages to queue with confirms and consumes them with
// prefetch, acking none, as a consumer in an outage does (issue 41); it returns once
// the broker counts prefetch unacked and n-prefetch ready.
func holdDeliveries(t *testing.T, queue string, n, prefetch int) {
	t.Helper()
	conn := brokertest.Dial(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.Close() })
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		c, err := ch.PublishWithDeferredConfirm("", queue, true, false, amqp.Publishing{Body: []byte{byte(i)}})
		if err != nil {
			t.Fatal(err)
		}
		if ok, err := c.WaitContext(t.Context()); !ok || err != nil {
			t.Fatalf("publish to %s: acked %t, %v", queue, ok, err)
		}
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		t.Fatal(err)
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for range prefetch {
		select {
		case <-deliveries:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s delivered nothing within 30 s", queue)
		}
	}
	want := fmt.Sprintf("%s\t%d\t%d", queue, n-prefetch, prefetch)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		out, err := brokertest.Ctl(t.Context(), "-q", "list_queues", "name", "messages_ready", "messages_unacknowledged", "--no-table-headers")
		if err != nil {
			t.Fatalf("rabbitmqctl list_queues: %v\n%s", err, out)
		}
		if strings.Contains(string(out), want+"\n") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the broker never counted %q:\n%s", want, out)
		}
	}
}

// TestStatusPossibleOutage (issue 41): a work queue whose consumer keeps its prefetch
// of deliveries, acking none, while more wait ready, is what an application in an
// outage shows the broker. status (with the broker's counts) lists it first after the
// poison and parking queues, POSSIBLE OUTAGE, and says what that is based on; it is not
// flagged (exit 0). Without the broker's counts it says nothing of it. The console's
// overview, in headless Chromium, shows the same.
func TestStatusPossibleOutage(t *testing.T) {
	e := newEnv(t, "idle", "orders")
	ctl := ctlFlag(t)
	e.apply()
	p, orders := e.prefix, e.queues[1]
	holdDeliveries(t, orders, 5, 2)
	code, out, errOut := e.run(append(append([]string{"status"}, ctl...), e.queueFlags()...)...)
	if code != exitOK {
		t.Fatalf("status exited %d:\n%s%s", code, out, errOut)
	}
	names, rows := tableNames(t, out)
	if want := []string{p + ".poison", p + ".parking", orders, e.queues[0]}; strings.Join(names, " ") != strings.Join(want, " ") {
		t.Errorf("status lists %v, want %v:\n%s", names, want, out)
	}
	if !regexp.MustCompile(`\s3\s+2\s.*\s1\s.*POSSIBLE OUTAGE$`).MatchString(rows[orders]) || strings.Contains(rows[e.queues[0]], "OUTAGE") {
		t.Errorf("status rows:\n%s", out)
	}
	said := "POSSIBLE OUTAGE work queue " + orders + ": its consumer keeps 2 unacked messages while 3 wait ready, and nothing was acked in 2s: none of the broker's counts (messages, ready, unacked), read twice 2s apart, moved"
	if !strings.Contains(out, "\n"+said) || !strings.Contains(out, "nothing flagged") {
		t.Errorf("status does not say what the possible outage is based on:\n%s", out)
	}
	code, out, errOut = e.run(append(append([]string{"status", "--json"}, ctl...), e.queueFlags()...)...)
	if code != exitOK || !strings.Contains(out, `"stalled_ns": 2000000000`) {
		t.Errorf("status --json (%d):\n%s%s", code, out, errOut)
	}
	code, out, errOut = e.run(append([]string{"status", "--rabbitmqctl", "off"}, e.queueFlags()...)...)
	if code != exitOK || strings.Contains(out, "OUTAGE") {
		t.Errorf("status without the broker's counts (%d) speaks of an outage:\n%s%s", code, out, errOut)
	}

	ctx := browser(t)
	con := startConsole(t, append(append(e.flags(), ctl...), e.queueFlags()...)...)
	act(t, ctx, "open the console", chromedp.Navigate(con.start), chromedp.WaitVisible(chromedp.CSS("#queues")))
	var got []string
	for _, r := range read(t, ctx, "read the overview", chromedp.Evaluate[[][]string](
		`[...document.querySelectorAll("#queues tbody tr")].map(r => [r.dataset.queue, r.cells[r.cells.length-1].textContent.trim()])`)) {
		got = append(got, r[0]+" "+r[1])
	}
	if want := []string{p + ".poison ok", p + ".parking ok", orders + " POSSIBLE OUTAGE", e.queues[0] + " ok"}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("the overview's queues:\n got %v\nwant %v", got, want)
	}
	note := read(t, ctx, "read the note", chromedp.Evaluate[string](`document.querySelector("#possible-outage")?.textContent ?? ""`))
	if !strings.Contains(note, said) {
		t.Errorf("the overview's note on the possible outage: %q", note)
	}
	order := read(t, ctx, "read the order", chromedp.Evaluate[[]string](`[...document.querySelectorAll("main > *")].map(e => e.id).filter(id => id)`))
	if !strings.HasPrefix(strings.Join(order, " "), "queues possible-outage flags ") {
		t.Errorf("the overview's sections: %v", order)
	}
}
