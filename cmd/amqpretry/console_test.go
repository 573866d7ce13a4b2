package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/console"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

// consoleRun is a console started in-process by the command line.
type consoleRun struct {
	start  string // the URL printed at start, with the token
	base   string // http://127.0.0.1:port
	token  string
	stdout string
	stderr *lockedBuffer
}

// startConsole runs `amqpretry console args...` on a free port until the test ends,
// and returns once it has printed its URL.
func startConsole(t *testing.T, args ...string) *consoleRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	stderr := &lockedBuffer{}
	exited := make(chan int, 1)
	go func() {
		exited <- run(ctx, append([]string{"console", "--listen", "127.0.0.1:0"}, args...), pw, stderr)
		_ = pw.Close()
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case code := <-exited:
			if code != exitOK {
				t.Errorf("console exited %d: %s", code, stderr.String())
			}
		case <-time.After(30 * time.Second):
			t.Errorf("console did not stop within 30 s of its context")
		}
	})
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(pr).ReadString('\n')
		line <- s
		_, _ = io.Copy(io.Discard, pr)
	}()
	var first string
	select {
	case first = <-line:
	case code := <-exited:
		t.Fatalf("console exited %d before printing its URL: %s", code, stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("console printed no URL within 30 s: %s", stderr.String())
	}
	i := strings.Index(first, "http")
	if i < 0 || !strings.HasPrefix(first, "amqpretry console") {
		t.Fatalf("console's first line: %q", first)
	}
	start := strings.TrimSpace(first[i:])
	u, err := url.Parse(start)
	if err != nil {
		t.Fatal(err)
	}
	c := &consoleRun{start: start, base: u.Scheme + "://" + u.Host, token: u.Query().Get("token"), stdout: first, stderr: stderr}
	if len(c.token) < 32 {
		t.Fatalf("token %q: want 256 bits, hex", c.token)
	}
	return c
}

// client returns an HTTP client with a cookie jar that does not follow redirects.
func (c *consoleRun) client(t *testing.T) *http.Client {
	t.Helper()
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &http.Client{Jar: jar, Timeout: 2 * time.Minute,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// do sends req and returns the status and the body.
func do(t *testing.T, cl *http.Client, req *http.Request) (int, string) {
	t.Helper()
	resp, err := cl.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

func get(t *testing.T, cl *http.Client, u string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	return do(t, cl, req)
}

func post(t *testing.T, cl *http.Client, u string, form url.Values) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	return do(t, cl, req)
}

// TestConsoleSecurity: the console's security model over HTTP, on the real broker
// reached with a user of its own: 401 without the token or with a wrong one; the token
// exchanged for an HttpOnly SameSite=Strict cookie and taken out of the address; 403
// for a POST without the CSRF token whatever its path; a foreign Host or Origin
// refused; the CSP; bad input answered with its status and nothing moved; one audit
// line per move; the password in no page, no error and no audit line, even when the
// broker cannot be reached.
func TestConsoleSecurity(t *testing.T) {
	e := newEnv(t, "orders")
	e.apply()
	e.poison(2)
	uri := brokertest.RestrictedUser(t)
	t.Setenv(uriEnv, uri)
	u, _ := url.Parse(uri)
	password, _ := u.User.Password()
	c := startConsole(t, append(e.flags(), "--rabbitmqctl", "off")...)
	var seen []string // every body and error shown
	check := func(what string, status int, body string, want int, contains string) {
		t.Helper()
		seen = append(seen, body)
		if status != want || !strings.Contains(body, contains) {
			t.Errorf("%s: %d, want %d with %q:\n%.600s", what, status, want, contains, body)
		}
	}
	anon := c.client(t)
	st, body := get(t, anon, c.base+"/")
	check("no token", st, body, http.StatusUnauthorized, "401")
	st, body = get(t, anon, c.base+"/?token=0123456789abcdef0123456789abcdef")
	check("wrong token", st, body, http.StatusUnauthorized, "401")
	req, _ := http.NewRequest(http.MethodGet, c.base+"/poison", nil)
	req.AddCookie(&http.Cookie{Name: console.CookieName, Value: c.token + "0"})
	st, body = do(t, anon, req)
	check("wrong cookie", st, body, http.StatusUnauthorized, "401")
	st, body = post(t, anon, c.base+"/move", url.Values{"csrf": {console.CSRF(c.token)}, "source": {"poison"}})
	check("POST without token", st, body, http.StatusUnauthorized, "401")

	cl := c.client(t)
	resp, err := cl.Get(c.start)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther || strings.Contains(resp.Header.Get("Location"), "token") {
		t.Errorf("token exchange: %d to %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	set := resp.Header.Get("Set-Cookie")
	for _, want := range []string{console.CookieName + "=", "HttpOnly", "SameSite=Strict", "Path=/"} {
		if !strings.Contains(set, want) {
			t.Errorf("cookie %q lacks %s", set, want)
		}
	}
	resp, err = cl.Get(c.base + "/poison")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	check("poison page", resp.StatusCode, string(b), http.StatusOK, "m0001")
	csp := resp.Header.Get("Content-Security-Policy")
	for _, want := range []string{"script-src 'self'", "frame-ancestors 'none'", "default-src 'none'"} {
		if !strings.Contains(csp, want) {
			t.Errorf("CSP %q lacks %s", csp, want)
		}
	}
	if strings.Count(string(b), "<script") != strings.Count(string(b), `<script src="/static/`) {
		t.Errorf("an inline script in the page:\n%s", b)
	}

	csrf := console.CSRF(c.token)
	redrive := url.Values{"csrf": {csrf}, "source": {"poison"}, "action": {"redrive"}, "step": {"do"}, "id": {"m0000"}, "reset": {"1"}}
	noCSRF := url.Values{"source": {"poison"}, "action": {"redrive"}, "step": {"do"}, "id": {"m0000"}}
	st, body = post(t, cl, c.base+"/move", noCSRF)
	check("POST without CSRF", st, body, http.StatusForbidden, "CSRF")
	st, body = post(t, cl, c.base+"/no/such/path", noCSRF)
	check("POST elsewhere without CSRF", st, body, http.StatusForbidden, "CSRF")
	bad := url.Values{"csrf": {csrf + "0"}}
	for k, v := range noCSRF {
		bad[k] = v
	}
	st, body = post(t, cl, c.base+"/move", bad)
	check("POST with a wrong CSRF", st, body, http.StatusForbidden, "CSRF")

	req, _ = http.NewRequest(http.MethodGet, c.base+"/", nil)
	req.Host = "rebound.example:80"
	st, body = do(t, cl, req)
	check("foreign Host", st, body, http.StatusMisdirectedRequest, "refused")
	req, _ = http.NewRequest(http.MethodPost, c.base+"/move", strings.NewReader(redrive.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", "http://evil.example")
	st, body = do(t, cl, req)
	check("foreign Origin", st, body, http.StatusForbidden, "origin")

	for _, bad := range []struct {
		what, path string
		form       url.Values
		want       int
		says       string
	}{
		{"malformed age", "/poison?older=soon", nil, http.StatusBadRequest, "older: want a duration"},
		{"unknown reason", "/poison?reason=bogus", nil, http.StatusBadRequest, "unknown reason"},
		{"unknown page", "/nope", nil, http.StatusNotFound, "no page"},
		{"waiting retries without rabbitmqctl", "/waiting", nil, http.StatusBadRequest, "--rabbitmqctl"},
		{"bad page", "/poison?page=0", nil, http.StatusBadRequest, "page"},
		{"unknown message", "/message?source=poison&id=nope", nil, http.StatusNotFound, "no message"},
		{"unknown source", "/move", url.Values{"source": {"elsewhere"}, "action": {"redrive"}, "step": {"do"}}, http.StatusBadRequest, "source"},
		{"purge without filter", "/move", url.Values{"source": {"poison"}, "action": {"purge"}, "step": {"do"}}, http.StatusBadRequest, "all"},
		{"malformed filter in a move", "/move", url.Values{"source": {"poison"}, "action": {"purge"}, "step": {"do"}, "newer": {"-1h"}}, http.StatusBadRequest, "newer"},
		{"unknown step", "/move", url.Values{"source": {"poison"}, "action": {"redrive"}, "step": {"now"}, "id": {"m0000"}}, http.StatusBadRequest, "step"},
	} {
		if bad.form != nil {
			bad.form.Set("csrf", csrf)
			st, body = post(t, cl, c.base+bad.path, bad.form)
		} else {
			st, body = get(t, cl, c.base+bad.path)
		}
		check(bad.what, st, body, bad.want, bad.says)
	}
	if n := brokertest.QueueLength(t, e.prefix+".poison"); n != 2 {
		t.Fatalf("bad input moved messages: %d left of 2", n)
	}

	st, body = post(t, cl, c.base+"/move", redrive)
	check("redrive", st, body, http.StatusOK, "1 redriven")
	if n := brokertest.QueueLength(t, e.queues[0]); n != 1 {
		t.Errorf("work queue has %d after the redrive, want 1", n)
	}
	audit := c.stderr.String()
	if lines := strings.Count(audit, "audit "); lines != 1 || !strings.Contains(audit, "client=127.0.0.1 action=poison.redrive filter=\"ids=m0000\"") ||
		!strings.Contains(audit, "done=1") {
		t.Errorf("audit: want one line for the redrive:\n%s", audit)
	}
	seen = append(seen, audit, c.stdout)

	// A broker that cannot be reached: 502, and the password of its URI nowhere.
	t.Setenv(uriEnv, "amqp://operator:s3cret-"+password+"@127.0.0.1:1/")
	gone := startConsole(t, append(e.flags(), "--rabbitmqctl", "off")...)
	gcl := gone.client(t)
	if resp, err := gcl.Get(gone.start); err == nil {
		_ = resp.Body.Close()
	}
	st, body = get(t, gcl, gone.base+"/")
	check("broker gone", st, body, http.StatusBadGateway, "Nothing was changed.")
	st, body = get(t, gcl, gone.base+"/poison")
	check("broker gone, poison", st, body, http.StatusBadGateway, "broker")
	seen = append(seen, gone.stderr.String(), gone.stdout)
	for _, s := range seen {
		if strings.Contains(s, password) {
			t.Errorf("the password shows in:\n%.800s", s)
		}
	}
}

// statusJSON runs status --json with args and returns its queues by name.
func statusJSON(t *testing.T, args ...string) map[string]int {
	t.Helper()
	code, out, errOut := runArgs(append([]string{"status", "--json"}, args...)...)
	if code != exitOK && code != exitFailed {
		t.Fatalf("status --json: %d %s%s", code, out, errOut)
	}
	var s struct {
		Queues []struct {
			Name   string `json:"name"`
			Exists bool   `json:"exists"`
			Ready  int    `json:"ready"`
		} `json:"queues"`
	}
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	ready := map[string]int{}
	for _, q := range s.Queues {
		if q.Exists {
			ready[q.Name] = q.Ready
		} else {
			ready[q.Name] = -1
		}
	}
	return ready
}

// waitingJSON runs waiting list --json --limit 0 with args and returns its messages.
func waitingJSON(t *testing.T, args ...string) int {
	t.Helper()
	code, out, errOut := runArgs(append([]string{"waiting", "list", "--json", "--limit", "0"}, args...)...)
	if code != exitOK {
		t.Fatalf("waiting list --json: %d %s%s", code, out, errOut)
	}
	var r struct {
		Messages []json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("waiting list --json: %v\n%s", err, out)
	}
	return len(r.Messages)
}

// TestConsoleRefusesUnsafeStart: before listening or dialling, the console refuses an
// address other than loopback without TLS (unless --insecure-no-tls), an unspecified
// one without --host, half a TLS pair, and a short token, as usage errors.
func TestConsoleRefusesUnsafeStart(t *testing.T) {
	t.Setenv(consoleTokenEnv, "")
	for _, c := range []struct {
		args []string
		env  string
		says string
	}{
		{[]string{"--listen", "192.0.2.1:7433"}, "", "needs TLS"},
		{[]string{"--listen", "0.0.0.0:7433", "--insecure-no-tls"}, "", "--host"},
		{[]string{"--listen", "127.0.0.1:7433", "--tls-cert", "c.pem"}, "", "go together"},
		{[]string{"--listen", "7433"}, "", "host:port"},
		{nil, "short-token", "at least 22"},
	} {
		t.Setenv(consoleTokenEnv, c.env)
		code, out, errOut := runArgs(append([]string{"console"}, c.args...)...)
		if code != exitUsage || !strings.Contains(errOut, c.says) || out != "" {
			t.Errorf("console %v (token %q): %d, want %d saying %q:\n%s%s", c.args, c.env, code, exitUsage, c.says, out, errOut)
		}
	}
}

// TestConsoleRedriveDryRunToDeletedQueue: the console's dry run of a redrive towards a
// deleted queue counts, as the CLI's does (TestRedriveDryRunToDeletedQueue), only the
// messages it would redrive: "2 of 4", "Confirm: redrive 2", and the 2 that would stay;
// when every matching message would stay, there is nothing to confirm.
func TestConsoleRedriveDryRunToDeletedQueue(t *testing.T) {
	e := newEnv(t, "orders", "billing")
	e.apply()
	e.poison(4) // m0000, m0002 failed on orders; m0001, m0003 on billing
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDelete(e.queues[1], false, false, false); err != nil {
		t.Fatal(err)
	}
	c := startConsole(t, append(e.flags(), "--rabbitmqctl", "off")...)
	cl := c.client(t)
	resp, err := cl.Get(c.start)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	dry := func(ids ...string) string {
		t.Helper()
		form := url.Values{"csrf": {console.CSRF(c.token)}, "source": {"poison"}, "action": {"redrive"}, "step": {"dry"}}
		if len(ids) > 0 {
			form["id"] = ids
		}
		st, body := post(t, cl, c.base+"/move", form)
		if st != http.StatusOK {
			t.Fatalf("dry run %v: %d\n%.800s", ids, st, body)
		}
		return body
	}
	poison := e.prefix + ".poison"
	body := dry()
	for _, want := range []string{"Dry run: 2 of 4 messages in " + poison + " would be redriven", "Confirm: redrive 2</button>", "2 would stay: their queue does not exist"} {
		if !strings.Contains(body, want) {
			t.Errorf("dry run of all 4 lacks %q:\n%s", want, body)
		}
	}
	body = dry("m0001", "m0003")
	if !strings.Contains(body, "Dry run: 0 of 4") || strings.Contains(body, `id="confirm-button"`) ||
		!strings.Contains(body, "every matching message would stay") {
		t.Errorf("dry run of the 2 unroutable ones offers to confirm:\n%s", body)
	}
	if n := brokertest.QueueLength(t, poison); n != 4 {
		t.Errorf("the dry runs left %d of 4 in the poison queue", n)
	}
}
