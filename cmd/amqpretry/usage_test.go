package main

import (
	"bytes"
	"context"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/ops"
)

// TestUsageErrors: garbage on the command line is refused before anything is dialled
// (AMQP_URI names no broker), with exit status 2, one error line naming the problem,
// and no usage block printed twice (issue 19).
func TestUsageErrors(t *testing.T) {
	t.Setenv(uriEnv, "amqp://u:p@192.0.2.1:1/") // never dialled
	for _, tt := range []struct {
		args []string
		want string
	}{
		{nil, "a command is needed"},
		{[]string{"bogus"}, `unknown command "bogus"`},
		{[]string{"poison"}, "amqpretry poison needs a command: list, purge, redrive, show"},
		{[]string{"poison", "bogus"}, `amqpretry poison: unknown command "bogus"`},
		{[]string{"topology", "frobnicate"}, `unknown command "frobnicate"`},
		{[]string{"status", "--bogus"}, "unknown flag: --bogus"},
		{[]string{"status", "--peek", "sometimes"}, `--peek: want auto, always or never, got "sometimes"`},
		{[]string{"status", "--stuck-margin", "-1s"}, "--stuck-margin: want a positive duration"},
		{[]string{"status", "--rabbitmqctl", "rabbitmqctl", "--management-url", "http://h:15672"}, "none of the others can be"},
		{[]string{"status", "--management-url", "h:15672"}, "--management-url: want http(s)://host:port"},
		{[]string{"poison", "redrive", "--rate", "x"}, `invalid argument "x" for "--rate"`},
		{[]string{"poison", "redrive", "--rate", "0"}, "N > 0"},
		{[]string{"poison", "list", "--limit", "-5"}, `invalid argument "-5" for "--limit" flag: -5 is below 0`},
		{[]string{"poison", "list", "--window", "0"}, `invalid argument "0" for "--window" flag: 0 is below 1`},
		{[]string{"poison", "redrive", "--window", "0"}, "0 is below 1"},
		{[]string{"poison", "list", "extra"}, `takes no arguments, got ["extra"]`},
		{[]string{"parking", "redrive", "now", "please"}, "takes no arguments"},
		{[]string{"poison", "list", "--reason", "bogus"}, `--reason: unknown reason "bogus" (known: permanent, max-attempts, delay-too-long, handoff-failed, too-large, delivery-limit)`},
		{[]string{"poison", "purge"}, "no filter given; pass --all to purge every message"},
		{[]string{"poison", "list", "--older-than", "yesterday"}, `"--older-than"`},
		{[]string{"poison", "list", "--newer-than", "-1h"}, "-1h0m0s is negative"},
		{[]string{"--tiers", "1s,banana", "topology", "plan"}, `"1s,banana" for "--tiers"`},
		{[]string{"--tiers", "", "topology", "plan"}, "--tiers"},
		{[]string{"--backend", "binary-levels", "--levels", "40", "topology", "plan"}, "--levels: 40 is outside 1 to 29"},
		{[]string{"--backend", "carrier-pigeon", "status"}, `--backend: unknown backend "carrier-pigeon"`},
		{[]string{"--backend", "memory", "poison", "list"}, "the memory backend has nothing on the broker"},
		{[]string{"--prefix", "a b", "topology", "plan"}, "--prefix:"},
		{[]string{"--retry-delay", "1us", "--held-retries", "2", "topology", "plan"}, "--retry-delay:"},
		{[]string{"--held-retries", "-1", "topology", "plan"}, "--held-retries: -1 is negative"},
		{[]string{"topology", "plan", "--queue"}, "flag needs an argument: --queue"},
		{[]string{"waiting"}, "amqpretry waiting needs a command: list, purge, retry-now"},
		{[]string{"waiting", "retry-now"}, "--queue is required"},
		{[]string{"waiting", "purge"}, "no filter given; pass --all to purge every waiting retry"},
		{[]string{"waiting", "list", "--reason", "permanent"}, "a waiting retry has no poison reason"},
		{[]string{"waiting", "list", "--rabbitmqctl", "off"}, "waiting list needs rabbitmqctl"},
		// Issue 51: teardown needs no --backend (it asks every backend what it declares).
		{[]string{"teardown"}, "teardown removes queues and exchanges for good: pass --yes to confirm"},
		// Issue 33: a destructive move needs --yes when stdin is not a terminal to ask on.
		{[]string{"poison", "purge", "--all"}, "poison purge deletes messages for good: pass --yes to confirm"},
		{[]string{"parking", "purge", "--queue", "q"}, "parking purge deletes messages for good: pass --yes to confirm"},
		{[]string{"waiting", "purge", "--all"}, "waiting purge drops retries for good: pass --yes to confirm"},
		{[]string{"--backend", "ttl-tiers", "teardown", "--force"}, "teardown --force removes the storage with the messages waiting there: pass --yes"},
		// Issue 43: every teardown that removes, not only --force.
		{[]string{"--backend", "ttl-tiers", "teardown"}, "teardown removes queues and exchanges for good: pass --yes to confirm"},
		{[]string{"--backend", "ttl-tiers", "teardown", "--keep-backend", "binary-levels", "--keep-levels", "99"}, "invalid --keep-* configuration"},
		// Issue 48: the blocked keys.
		{[]string{"blocked"}, "amqpretry blocked needs a command: list, release"},
		{[]string{"blocked", "list", "--rabbitmqctl", "off"}, "blocked list needs rabbitmqctl"},
		{[]string{"blocked", "release", "--queue", "q"}, "--queue and --key are both required"},
		{[]string{"blocked", "release", "--queue", "q", "--key", "k"}, "blocked release lets a key's messages run, which cannot be undone: pass --yes to confirm"},
		{[]string{"blocked", "release", "--queue", "q", "--key", "k", "--yes", "--rabbitmqctl", "off"}, "blocked release needs rabbitmqctl"},
	} {
		code, out, errOut := runArgs(tt.args...)
		if code != exitUsage {
			t.Errorf("%q exited %d, want %d\n%s%s", tt.args, code, exitUsage, out, errOut)
			continue
		}
		if !strings.Contains(errOut, tt.want) {
			t.Errorf("%q: stderr lacks %q:\n%s", tt.args, tt.want, errOut)
		}
		if n := strings.Count(errOut, "amqpretry: "); n != 1 || strings.Count(errOut, "Usage:") > 0 || out != "" {
			t.Errorf("%q: want one error line and no usage block, got stdout %q, stderr:\n%s", tt.args, out, errOut)
		}
	}
}

// TestHelp: the common flags show the library's real defaults; --reason lists every
// poison reason; every command documents the exit statuses.
func TestHelp(t *testing.T) {
	d := amqpretry.Config{}.WithDefaults()
	code, out, _ := runArgs("--help")
	for _, want := range []string{"(default: the library's ladder)", `(default "` + d.Backend.Name() + `")`, `(default "` + d.Prefix + `")`,
		"(0: the library's default)", d.PoisonQueue, "130  interrupted", "AMQP_URI"} {
		if code != exitOK || !strings.Contains(out, want) {
			t.Errorf("--help lacks %q (%d):\n%s", want, code, out)
		}
	}
	for _, args := range [][]string{{"status", "--help"}, {"topology", "verify", "--help"}, {"poison", "redrive", "--help"}, {"parking", "list", "-h"}, {"help", "poison", "purge"}, {"blocked", "release", "--help"}} {
		code, out, _ := runArgs(args...)
		if code != exitOK || !strings.Contains(out, "Exit status, the same for every command") || !strings.Contains(out, "--prefix") {
			t.Errorf("%q (%d):\n%s", args, code, out)
		}
	}
	_, out, _ = runArgs("poison", "list", "--help")
	for _, r := range poisonReasons(t) {
		if !strings.Contains(out, r) {
			t.Errorf("--reason help lacks %q:\n%s", r, out)
		}
	}
	if code, out, _ := runArgs("--version"); code != exitOK || !strings.HasPrefix(out, "amqpretry ") {
		t.Errorf("--version (%d): %q", code, out)
	}
	if code, out, _ := runArgs("completion", "bash"); code != exitOK || !strings.Contains(out, "bash completion") {
		t.Errorf("completion bash (%d): %.100q", code, out)
	}
}

// poisonReasons reads the values of every amqpretry.Reason constant from the
// library's source, so that a new reason cannot be left out of --reason.
func poisonReasons(t *testing.T) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "../../event.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, decl := range f.Decls {
		g, ok := decl.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, spec := range g.Specs {
			v := spec.(*ast.ValueSpec)
			if id, ok := v.Type.(*ast.Ident); ok && id.Name == "Reason" {
				s, _ := strconv.Unquote(v.Values[0].(*ast.BasicLit).Value)
				out = append(out, s)
			}
		}
	}
	if len(out) < 5 {
		t.Fatalf("found reasons %v", out)
	}
	if len(out) != len(reasons) {
		t.Errorf("amqpretry has reasons %v; --reason takes %v", out, reasons)
	}
	return out
}

// TestRedactionKeepsHosts (issue 19): a one-character password garbled every "1" of
// the host ("amqp://guest:xxxxx@xxxxx27.0.0.xxxxx:5673/").
func TestRedactionKeepsHosts(t *testing.T) {
	t.Setenv(uriEnv, "amqp://guest:1@127.0.0.1:5673/") // nothing listens there
	for _, args := range [][]string{{"status"}, {"poison", "list"}, {"status", "--json"}} {
		code, out, errOut := runArgs(args...)
		all := out + errOut
		if code != exitFailed || !strings.Contains(all, "amqp://guest:xxxxx@127.0.0.1:5673/") || strings.Contains(all, "xxxxx27") {
			t.Errorf("%q (%d):\n%s", args, code, all)
		}
	}
}

// TestPasswordNeverPrinted: a malformed URI with a password, and one that dials and
// fails authentication, through every command that dials: the password appears in no
// output.
func TestPasswordNeverPrinted(t *testing.T) {
	brokertest.Dial(t)
	const secret = "s3cret"
	u, err := url.Parse(brokertest.URI())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword("guest", secret)
	commands := [][]string{
		{"status"}, {"status", "--json"}, {"status", "--management-url", "http://127.0.0.1:1"}, {"topology", "apply"}, {"topology", "verify"},
		{"poison", "list"}, {"poison", "show", "x"}, {"poison", "redrive"}, {"poison", "purge", "--all", "--yes"}, {"poison", "list", "--json"},
		{"parking", "list"}, {"parking", "redrive"},
	}
	for _, uri := range []string{"amqp://user:" + secret + "@host:badport/", "amqp//user:" + secret + "@host/", u.String()} {
		t.Setenv(uriEnv, uri)
		for _, args := range commands {
			code, out, errOut := runArgs(args...)
			if code != exitFailed || strings.Contains(out+errOut, secret) || out+errOut == "" {
				t.Errorf("%s %q (%d) printed the password or nothing:\n%s%s", brokertest.Redact(uri), args, code, out, errOut)
			}
		}
	}
}

// TestProgress: a bar on a terminal (progressbar), a line of counts a second
// otherwise, nothing for a run shorter than a second.
func TestProgress(t *testing.T) {
	var buf bytes.Buffer
	p := newProgress(&buf, "redriving", "redriven")
	p.update(ops.MoveResult{Depth: 10, Scanned: 1})
	p.done()
	if buf.Len() != 0 {
		t.Errorf("a short run printed %q", buf.String())
	}
	p = newProgress(&buf, "redriving", "redriven")
	p.start = time.Now().Add(-2 * time.Second)
	p.update(ops.MoveResult{Depth: 10, Scanned: 4, Done: 3, Skipped: 1})
	p.update(ops.MoveResult{Depth: 10, Scanned: 5, Done: 4, Skipped: 1}) // within the second: no line
	p.done()
	if got := buf.String(); got != "progress: 4/10 scanned, 3 redriven, 1 skipped, 0 unroutable\nprogress: 5/10 scanned, 4 redriven, 1 skipped, 0 unroutable\n" {
		t.Errorf("lines of counts: %q", got)
	}
	buf.Reset()
	p = newProgress(&buf, "redriving", "redriven")
	p.tty, p.start = true, time.Now().Add(-2*time.Second)
	p.update(ops.MoveResult{Depth: 10, Scanned: 5, Done: 5})
	p.done()
	if got := buf.String(); !strings.Contains(got, "redriving: 5 redriven") || !strings.Contains(got, "5/10") || !strings.Contains(got, "50%") {
		t.Errorf("bar: %q", got)
	}
}

// TestCountsFromRabbitmqctlStatus: the file descriptors of rabbitmqctl status JSON as
// RabbitMQ 3.x prints it (a warning line first).
func TestCountsFromRabbitmqctlStatus(t *testing.T) {
	var c ops.BrokerCounts
	out := []byte("Warning: something\n" + `{"pid":1,"file_descriptors":{"sockets_limit":832,"sockets_used":4,"total_limit":927,"total_used":18},` +
		`"listeners":[{"port":25672,"protocol":"clustering"},{"port":5672,"protocol":"amqp"}]}`)
	ports, err := ctlStatus(out, &c)
	if err != nil || c.FileDescriptors != 18 || c.FileDescriptorLimit != 927 || c.Sockets != 4 || c.SocketLimit != 832 || !slices.Equal(ports, []int{5672}) {
		t.Errorf("ctlStatus: %v %+v %v", err, c, ports)
	}
	for _, status := range []string{
		`{"pid":999999999}`, // 4.3: no section
		`{"pid":999999999,"file_descriptors":{"sockets_limit":0,"sockets_used":0,"total_limit":19903,"total_used":0}}`, // 4.0.5: not counted
	} {
		c = ops.BrokerCounts{}
		if _, err := ctlStatus([]byte(status), &c); err != nil || c.FileDescriptors != 0 || c.FileDescriptorLimit != 0 {
			t.Errorf("4.x status %s of a process this host cannot see: %v %+v (want unknown: 0 of 0)", status, err, c)
		}
	}
	self := fmt.Sprintf(`{"pid":%d,"file_descriptors":{"sockets_limit":0,"sockets_used":0,"total_limit":19903,"total_used":0}}`, os.Getpid())
	c = ops.BrokerCounts{}
	if _, err := ctlStatus([]byte(self), &c); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat("/proc/self/fd"); err == nil && (c.FileDescriptors <= 0 || c.FileDescriptorLimit <= 0) {
		t.Errorf("4.0.5 status of a process /proc shows: %+v, want its open files", c)
	}
}

// TestListQueues: rabbitmqctl list_queues as the command reads it: a quorum queue's
// members and those online are counted from their lists; a classic queue has neither.
func TestListQueues(t *testing.T) {
	out := []byte("q.delay\t5\t1\t0\tquorum\t[rabbit@a, rabbit@b, rabbit@c]\t[rabbit@a, rabbit@c]\n" +
		"q.work\t2\t2\t0\tclassic\t\t\n" +
		"q.one\t0\t0\t0\tquorum\t[rabbit@a]\t[]\n" +
		"garbage line\n")
	c := newCounts()
	listQueues(out, c)
	if c.Messages["q.delay"] != 5 || c.Ready["q.delay"] != 1 || c.Members["q.delay"] != 3 || c.Online["q.delay"] != 2 {
		t.Errorf("quorum queue: %+v", c)
	}
	if c.Messages["q.work"] != 2 || c.Ready["q.work"] != 2 {
		t.Errorf("classic queue's counts: %+v", c)
	}
	if _, ok := c.Members["q.work"]; ok {
		t.Errorf("classic queue with members: %+v", c)
	}
	if c.Members["q.one"] != 1 || c.Online["q.one"] != 0 {
		t.Errorf("quorum queue with no member online: %+v", c)
	}
	if len(c.Messages) != 3 {
		t.Errorf("read %d queues, want 3: %+v", len(c.Messages), c)
	}
}

// TestManagementCounts: the management API's queues and nodes, read with the URI's
// credentials in the Authorization header only. Neither broker here runs the
// management plugin, so this is an HTTP fixture in the shape of its replies (RabbitMQ
// 4.x reports sockets as 0 of 0: unknown).
func TestManagementCounts(t *testing.T) {
	const secret = "s3cret"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, pass, ok := r.BasicAuth()
		if !ok || user != "ops" || pass != secret {
			http.Error(w, "no", http.StatusUnauthorized)
			return
		}
		switch r.URL.EscapedPath() {
		case "/api/queues/prod":
			_, _ = w.Write([]byte(`[{"name":"p.delay.1s","messages":3,"messages_ready":1,"messages_unacknowledged":0,"type":"quorum","members":["a","b","c"],"online":["a","c"]},{"name":"p.work","messages":0,"messages_ready":0,"messages_unacknowledged":0,"type":"classic"}]`))
		case "/api/nodes":
			_, _ = w.Write([]byte(`[{"name":"a","fd_used":10,"fd_total":100,"sockets_used":0,"sockets_total":0},{"name":"b","fd_used":90,"fd_total":100,"sockets_used":0,"sockets_total":0}]`))
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	c, err := managementCounts(srv.URL, "amqp://ops:"+secret+"@h/prod", nil)(context.Background())
	if err != nil || c.Messages["p.delay.1s"] != 3 || c.Ready["p.delay.1s"] != 1 || c.FileDescriptors != 90 || c.FileDescriptorLimit != 100 || c.SocketLimit != 0 ||
		c.Members["p.delay.1s"] != 3 || c.Online["p.delay.1s"] != 2 || c.Members["p.work"] != 0 {
		t.Errorf("counts: %v %+v", err, c)
	}
	if _, err := managementCounts(srv.URL, "amqp://ops:wrong-"+secret+"@h/prod", nil)(context.Background()); err == nil || strings.Contains(err.Error(), secret) || !strings.Contains(err.Error(), "401") {
		t.Errorf("bad password: %v", err)
	}
	if _, err := managementCounts("http://127.0.0.1:1", "amqp://ops:"+secret+"@h/prod", nil)(context.Background()); err == nil || strings.Contains(err.Error(), secret) {
		t.Errorf("no server: %v", err)
	}
}
