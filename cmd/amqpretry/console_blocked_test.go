package main

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/console"
)

// TestConsoleBrowserBlockedKeys (issue 48), in headless Chromium, on a running
// application with Config.OrderKey and Config.BlockOnPoison (blockedRig): the overview
// says how many keys are blocked, how many messages wait behind them and how many heads
// are poisoned, and links to the blocked keys' page, which lists each with its head;
// each move shows its dry run and asks: a key released without its head (its later
// events run, in order), one whose head is redriven first (all four, in order), one
// released before a head that waits for its retry. Each move leaves one audit line; a
// refusal says why and changes nothing; read-only shows no move. Once none is
// blocked, the overview says nothing of them.
func TestConsoleBrowserBlockedKeys(t *testing.T) {
	ctx := browser(t)
	r := newBlockedRig(t)
	con := startConsole(t, r.flags...)

	actWithin(t, ctx, brokerStep, "open the console", chromedp.Navigate(con.start), chromedp.WaitVisible(chromedp.CSS("#queues")))
	line := read(t, ctx, "read the blocked keys' line", chromedp.Evaluate[string](`document.querySelector("#blocked-keys .summary")?.textContent ?? ""`))
	if line != "3 blocked keys, 7 messages behind them, 2 poisoned heads" {
		t.Errorf("overview: blocked keys %q", line)
	}
	// Navigated to, not clicked: the overview reloads itself every 10 s, which a
	// click must not meet.
	if href := read(t, ctx, "the link to the blocked keys", chromedp.Evaluate[string](`document.querySelector("#blocked-link")?.getAttribute("href") ?? ""`)); href != "/blocked" {
		t.Errorf("overview: the blocked keys' link goes to %q", href)
	}
	actWithin(t, ctx, brokerStep, "open the blocked keys", chromedp.Navigate(con.base+"/blocked"), chromedp.WaitVisible(chromedp.CSS("#blocked")))
	const rowsJS = `[...document.querySelectorAll("#blocked tbody tr")].map(r => [r.dataset.key, r.querySelector(".behind").textContent, r.querySelector(".head").textContent])`
	rows := read(t, ctx, "read the blocked keys", chromedp.Evaluate[[][]string](rowsJS))
	want := [][]string{{"acc0", "3", "acc0-1"}, {"acc1", "3", "acc1-1"}, {"acc2", "1", "waits for its retry"}}
	if len(rows) != len(want) {
		t.Fatalf("blocked keys page: %v, want %v", rows, want)
	}
	for i := range want {
		if strings.Join(rows[i], "|") != strings.Join(want[i], "|") {
			t.Errorf("blocked keys page row %d: %v, want %v", i, rows[i], want[i])
		}
	}

	// Read-only: the keys, and no move.
	ro := startConsole(t, append([]string{"--read-only"}, r.flags...)...)
	actWithin(t, ctx, brokerStep, "read-only blocked keys", chromedp.Navigate(ro.start), chromedp.WaitVisible(chromedp.CSS("#queues")),
		chromedp.Navigate(ro.base+"/blocked"), chromedp.WaitVisible(chromedp.CSS("#blocked")))
	if n := read(t, ctx, "count the moves", chromedp.Evaluate[int](`document.querySelectorAll("form[method=post], button, input[name=csrf]").length`)); n != 0 {
		t.Errorf("read-only: the blocked keys page shows %d moves", n)
	}
	// Back to the first console: the cookie is the host's, whatever the port.
	actWithin(t, ctx, brokerStep, "back to the console", chromedp.Navigate(con.start), chromedp.WaitVisible(chromedp.CSS("#queues")))

	// A refusal over HTTP: a key that is not blocked; a malformed move.
	cl := con.client(t)
	if resp, err := cl.Get(con.start); err == nil {
		_ = resp.Body.Close()
	}
	csrf := console.CSRF(con.token)
	st, body := post(t, cl, con.base+"/release", url.Values{"csrf": {csrf}, "step": {"do"}, "queue": {r.queue}, "key": {"acc3"}, "action": {"release"}})
	if st != http.StatusConflict || !strings.Contains(body, "not blocked") || !strings.Contains(body, "the blocked keys page lists those that are") {
		t.Errorf("release of a key not blocked: %d\n%.800s", st, body)
	}
	st, body = post(t, cl, con.base+"/release", url.Values{"csrf": {csrf}, "step": {"do"}, "queue": {r.queue}, "key": {"acc2"}, "action": {"release"}})
	if st != http.StatusConflict || !strings.Contains(body, "Release now, before its head") || !strings.Contains(body, "out of the key&#39;s order") {
		t.Errorf("release of a key whose head waits, not forced: %d\n%.800s", st, body)
	}
	st, body = post(t, cl, con.base+"/release", url.Values{"csrf": {csrf}, "step": {"do"}, "queue": {r.queue}, "key": {"acc2"}, "action": {"redrive-head"}, "force": {"1"}})
	if st != http.StatusBadRequest || !strings.Contains(body, "force goes with release") {
		t.Errorf("redrive-head, forced: %d\n%.800s", st, body)
	}
	if n := ready(t, r.behind("acc2")); n != 1 {
		t.Fatalf("refused moves left %d behind acc2, want 1", n)
	}

	// Release acc0 without its head: the dry run, then the confirmation.
	move := func(what, button, wantDry, wantResult string) {
		t.Helper()
		actWithin(t, ctx, brokerStep, what+": dry run", chromedp.Navigate(con.base+"/blocked"), chromedp.WaitVisible(chromedp.CSS("#blocked")),
			chromedp.Click(chromedp.CSS(button)), chromedp.WaitVisible(chromedp.CSS("#dry-run")))
		dry := read(t, ctx, "read the dry run", chromedp.Text(chromedp.CSS("#dry-run")))
		actWithin(t, ctx, brokerStep, what+": confirm", chromedp.Click(chromedp.CSS("#confirm-button")), chromedp.WaitVisible(chromedp.CSS("#result")))
		result := read(t, ctx, "read the result", chromedp.Text(chromedp.CSS("#result")))
		if !strings.HasPrefix(dry, wantDry) || !strings.HasPrefix(result, wantResult) {
			t.Errorf("%s: dry run %q, result %q; want %q, %q", what, dry, result, wantDry, wantResult)
		}
	}
	move("release acc0", `#blocked tr[data-key="acc0"] button.release`,
		`Dry run: key "acc0" of queue `+r.queue+` would be released: the 3 messages behind it run, in order; its poisoned head acc0-1 stays in the poison queue`,
		`key "acc0" of queue `+r.queue+` released: the 3 messages behind it run, in order`)
	r.waitApplied(t, "acc0", 2, 3, 4)
	r.waitQueue(t, r.behind("acc0"), -1)

	r.heal("acc1")
	move("redrive acc1's head", `#blocked tr[data-key="acc1"] button.redrive-head`,
		`Dry run: the poisoned head acc1-1 of key "acc1" would be redriven to queue `+r.queue+`, its attempts reset: once it succeeds, the 3 messages behind it run, in order`,
		`the poisoned head acc1-1 of key "acc1" redriven to queue `+r.queue)
	r.waitApplied(t, "acc1", 1, 2, 3, 4)
	r.waitQueue(t, r.behind("acc1"), -1)

	move("release acc2 before its head", `#blocked tr[data-key="acc2"] button.release`,
		`Dry run: key "acc2" of queue `+r.queue+` would be released, forced: the message behind it runs, before its head`,
		`key "acc2" of queue `+r.queue+` released, forced`)
	r.waitApplied(t, "acc2", 2)
	r.waitQueue(t, r.behind("acc2"), -1)

	audit := con.stderr.String()
	for _, want := range []string{"action=blocked.release queue=" + r.queue + ` key="acc0" force=false behind=3 released=true`,
		"action=blocked.redrive-head queue=" + r.queue + ` key="acc1" force=false behind=3 released=false redriven=acc1-1`,
		"action=blocked.release queue=" + r.queue + ` key="acc2" force=true behind=1 released=true`} {
		if !strings.Contains(audit, want) {
			t.Errorf("audit lacks %q:\n%s", want, audit)
		}
	}
	if n := strings.Count(audit, "audit "); n != 5 { // the 3 moves, and the 2 refused over HTTP
		t.Errorf("%d audit lines, want 5:\n%s", n, audit)
	}

	actWithin(t, ctx, brokerStep, "the overview, nothing blocked", chromedp.Navigate(con.base+"/"), chromedp.WaitVisible(chromedp.CSS("#queues")))
	if n := read(t, ctx, "the blocked keys' line", chromedp.Evaluate[int](`document.querySelectorAll("#blocked-keys").length`)); n != 0 {
		t.Errorf("the overview speaks of blocked keys once none is")
	}
}

// brokerStep bounds a browser step that reaches the broker: the overview's status
// and blocked keys, the blocked keys' page and each release run rabbitmqctl
// (list_queues, status), which takes seconds a run on a loaded machine.
const brokerStep = 5 * time.Minute

// actWithin is act, each step bounded by d.
func actWithin(t *testing.T, ctx context.Context, d time.Duration, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		t.Fatalf("browser: %s: %v\n%s", what, err, page(ctx))
	}
}
