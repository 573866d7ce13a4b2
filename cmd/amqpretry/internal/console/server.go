// Package console is the operator's console of the amqpretry command: a web page in
// front of package ops (status, the poison and parking queues, the waiting retries,
// the blocked order keys),
// served by net/http with html/template, its files embedded. It has the security
// model (token, cookie, CSRF, Host and Origin checks, CSP, read-only mode); the
// command (console.go) parses the flags, listens and prints the URL.
package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/ops"
)

// Broker is what the console needs of package ops (*ops.Ops has it).
type Broker interface {
	Status(ctx context.Context, opts ops.StatusOptions) (ops.Status, error)
	List(ctx context.Context, source ops.Source, opts ops.ListOptions) (ops.ListResult, error)
	Redrive(ctx context.Context, source ops.Source, opts ops.MoveOptions) (ops.MoveResult, error)
	Purge(ctx context.Context, source ops.Source, opts ops.MoveOptions) (ops.MoveResult, error)
	Blocked(ctx context.Context) ([]ops.BlockedKey, error)
	Release(ctx context.Context, opts ops.ReleaseOptions) (ops.ReleaseResult, error)
	Close() error
}

// Config configures New.
type Config struct {
	// Open connects to the broker; the console keeps one connection and opens a new
	// one after an error (a broker that went away).
	Open func() (Broker, error)
	// Token is the access token (at least MinTokenLen characters).
	Token string
	// ReadOnly shows no action and refuses every POST.
	ReadOnly bool
	// Hosts are the Host header values (host:port) the console answers to; Origin
	// must be Scheme://one of them. Anything else is refused (DNS rebinding).
	Hosts  []string
	Scheme string
	// Status are the options of the overview's ops.Status (work queues, counts).
	Status ops.StatusOptions
	// Parking: the backend has a parking queue. Waiting: the waiting retries can be
	// read (rabbitmqctl). Blocked: the blocked order keys can be listed (rabbitmqctl).
	Parking, Waiting, Blocked bool
	// BehindQueues is the pattern of the blocked keys' queues ("<prefix>.behind.*"):
	// when the broker's counts name none, the overview does not list the keys.
	BehindQueues string
	// Limit is the page size, Window the most messages one listing reads.
	Limit, Window int
	// Title says what the console looks at (backend, prefix, the redacted URI).
	Title string
	// Describe renders a status flag as a line with its fix (as the CLI prints it).
	Describe func(ops.Flag, ops.Status) string
	// Hidden tells the headers the message page shows in its envelope, not again
	// among the headers.
	Hidden func(key string) bool
	// Redact hides the broker's password in a text shown or logged.
	Redact func(string) string
	// Audit receives one line per move.
	Audit io.Writer
}

// readOnlyRefusal is the answer of a read-only console to every POST (403).
const readOnlyRefusal = "this console is read-only (started with --read-only): it redrives, retries, purges and releases nothing; " +
	"use the amqpretry command, or start the console again without --read-only"

// MinTokenLen is the shortest access token taken: 22 characters of a random token are
// about 128 bits.
const MinTokenLen = 22

// CookieName is the session cookie.
const CookieName = "amqpretry_console"

// Server is the console's http.Handler.
type Server struct {
	cfg   Config
	csrf  string
	pages map[string]*template.Template
	files http.Handler

	mu     sync.Mutex // one broker call at a time (ops: "one at a time")
	broker Broker
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// NewToken returns a random access token of 256 bits, hex.
func NewToken() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	return hex.EncodeToString(b)
}

// CSRF is the CSRF token of the console with the access token token: every form
// posts it.
func CSRF(token string) string {
	mac := hmac.New(sha256.New, []byte(token))
	mac.Write([]byte("amqpretry console csrf"))
	return hex.EncodeToString(mac.Sum(nil))
}

// New checks cfg and returns the console.
func New(cfg Config) (*Server, error) {
	if len(cfg.Token) < MinTokenLen {
		return nil, fmt.Errorf("console: the access token has %d characters, want at least %d (about 128 bits of randomness)", len(cfg.Token), MinTokenLen)
	}
	if cfg.Open == nil || len(cfg.Hosts) == 0 {
		return nil, errors.New("console: Open and Hosts are required")
	}
	if cfg.Scheme == "" {
		cfg.Scheme = "http"
	}
	if cfg.Limit <= 0 {
		cfg.Limit = 100
	}
	if cfg.Window <= 0 {
		cfg.Window = 10_000
	}
	if cfg.Redact == nil {
		cfg.Redact = func(s string) string { return s }
	}
	if cfg.Describe == nil {
		cfg.Describe = func(f ops.Flag, _ ops.Status) string { return strings.ToUpper(string(f.Kind)) + " " + f.Name }
	}
	if cfg.Hidden == nil {
		cfg.Hidden = func(string) bool { return false }
	}
	if cfg.Audit == nil {
		cfg.Audit = io.Discard
	}
	s := &Server{cfg: cfg, csrf: CSRF(cfg.Token), pages: map[string]*template.Template{}}
	for _, page := range []string{"overview", "delay", "messages", "message", "waiting", "blocked", "release", "confirm", "result", "error"} {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+page+".html")
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", page, err)
		}
		s.pages[page] = t
	}
	static, _ := fs.Sub(staticFS, "static")
	s.files = http.StripPrefix("/static/", http.FileServer(http.FS(static)))
	return s, nil
}

// Close closes the broker connection, if open.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.broker == nil {
		return nil
	}
	err := s.broker.Close()
	s.broker = nil
	return err
}

// use runs f with the broker, connecting first if needed; after an error the
// connection is dropped, and the next call connects again.
func (s *Server) use(f func(b Broker) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.broker == nil {
		b, err := s.cfg.Open()
		if err != nil {
			return brokerError{err}
		}
		s.broker = b
	}
	err := f(s.broker)
	if err == nil || errors.As(err, new(inputError)) {
		return err
	}
	if !connectionLost(err) {
		return inputError{http.StatusConflict, err.Error()} // ops refused: nothing was done
	}
	_ = s.broker.Close()
	s.broker = nil
	return brokerError{err}
}

// connectionLost tells whether err is the broker or the network failing (502: the
// connection is dropped and the next request opens a new one), rather than ops
// refusing what was asked.
func connectionLost(err error) bool {
	var amqpErr *amqp.Error
	var netErr net.Error
	return errors.Is(err, amqp.ErrClosed) || errors.As(err, &amqpErr) || errors.As(err, &netErr) ||
		errors.Is(err, io.EOF) || errors.Is(err, context.DeadlineExceeded)
}

// brokerError is a failure to reach or use the broker: 502.
type brokerError struct{ err error }

func (e brokerError) Error() string { return e.err.Error() }
func (e brokerError) Unwrap() error { return e.err }

// inputError is bad input (400), or something not found (404): nothing was done.
type inputError struct {
	status int
	msg    string
}

func (e inputError) Error() string { return e.msg }

func badRequest(format string, args ...any) error {
	return inputError{http.StatusBadRequest, fmt.Sprintf(format, args...)}
}

func notFound(format string, args ...any) error {
	return inputError{http.StatusNotFound, fmt.Sprintf(format, args...)}
}

// ServeHTTP checks the request (Host and Origin, token, read-only, CSRF), in that
// order, then serves it.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin") // "no-referrer" would make the browser send "Origin: null"
	h.Set("Cache-Control", "no-store")
	if !s.hostAllowed(r.Host) {
		http.Error(w, "refused: this console does not answer to host "+r.Host, http.StatusMisdirectedRequest)
		return
	}
	if o := r.Header.Get("Origin"); o != "" && !s.originAllowed(o) {
		http.Error(w, "refused: a request from another origin", http.StatusForbidden)
		return
	}
	if t := r.URL.Query().Get("token"); t != "" && r.Method == http.MethodGet {
		if !s.tokenOK(t) {
			http.Error(w, "401 unauthorized: wrong access token; open the URL amqpretry console printed at start", http.StatusUnauthorized)
			return
		}
		http.SetCookie(w, &http.Cookie{Name: CookieName, Value: t, Path: "/", HttpOnly: true, Secure: s.cfg.Scheme == "https", SameSite: http.SameSiteStrictMode})
		q := r.URL.Query()
		q.Del("token")
		u := *r.URL
		u.RawQuery = q.Encode()
		http.Redirect(w, r, u.RequestURI(), http.StatusSeeOther) // the token out of the address bar
		return
	}
	c, err := r.Cookie(CookieName)
	if err != nil || !s.tokenOK(c.Value) {
		http.Error(w, "401 unauthorized: open the URL amqpretry console printed at start (it carries the access token)", http.StatusUnauthorized)
		return
	}
	if r.Method == http.MethodPost {
		if s.cfg.ReadOnly { // first: its pages carry no CSRF token, and reloading one cannot help
			s.failNote(w, r, inputError{http.StatusForbidden, readOnlyRefusal}, "Nothing was changed.")
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
		if err := r.ParseForm(); err != nil || subtle.ConstantTimeCompare([]byte(r.PostForm.Get("csrf")), []byte(s.csrf)) != 1 {
			http.Error(w, "403 forbidden: a POST needs the form's CSRF token; reload the page and try again", http.StatusForbidden)
			return
		}
	}
	if strings.HasPrefix(r.URL.Path, "/static/") {
		s.files.ServeHTTP(w, r)
		return
	}
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/":
		s.overview(w, r)
	case r.Method == http.MethodGet && r.URL.Path == "/delay":
		s.delayQueues(w, r)
	case r.Method == http.MethodGet && (r.URL.Path == "/poison" || r.URL.Path == "/parking"):
		s.messages(w, r)
	case r.Method == http.MethodGet && r.URL.Path == "/message":
		s.message(w, r)
	case r.Method == http.MethodGet && r.URL.Path == "/waiting":
		s.waiting(w, r)
	case r.Method == http.MethodGet && r.URL.Path == "/blocked":
		s.blocked(w, r)
	case r.Method == http.MethodPost && r.URL.Path == "/move":
		s.move(w, r)
	case r.Method == http.MethodPost && r.URL.Path == "/release":
		s.release(w, r)
	case r.URL.Path == "/" || r.URL.Path == "/delay" || r.URL.Path == "/poison" || r.URL.Path == "/parking" || r.URL.Path == "/message" || r.URL.Path == "/waiting" ||
		r.URL.Path == "/blocked" || r.URL.Path == "/move" || r.URL.Path == "/release":
		s.fail(w, r, inputError{http.StatusMethodNotAllowed, "method " + r.Method + " not allowed on " + r.URL.Path})
	default:
		s.fail(w, r, notFound("no page %s", r.URL.Path))
	}
}

// tokenOK compares t with the token in constant time (of their hashes: equal length).
func (s *Server) tokenOK(t string) bool {
	a, b := sha256.Sum256([]byte(t)), sha256.Sum256([]byte(s.cfg.Token))
	return subtle.ConstantTimeCompare(a[:], b[:]) == 1
}

func (s *Server) hostAllowed(host string) bool {
	for _, h := range s.cfg.Hosts {
		if strings.EqualFold(h, host) {
			return true
		}
	}
	return false
}

func (s *Server) originAllowed(origin string) bool {
	for _, h := range s.cfg.Hosts {
		if strings.EqualFold(origin, s.cfg.Scheme+"://"+h) {
			return true
		}
	}
	return false
}

// page is what every template gets.
type page struct {
	Title    string
	Nav      string
	ReadOnly bool
	CSRF     string
	Parking  bool
	Waiting  bool
	Blocked  bool
	Queues   []string // the work queues (--queue)
	Refresh  int      // seconds, 0: none
	Data     any
}

func (s *Server) render(w http.ResponseWriter, status int, name, nav string, data any) {
	p := page{Title: s.cfg.Title, Nav: nav, ReadOnly: s.cfg.ReadOnly, CSRF: s.csrf, Parking: s.cfg.Parking,
		Waiting: s.cfg.Waiting, Blocked: s.cfg.Blocked, Queues: s.cfg.Status.WorkQueues, Data: data}
	if name == "overview" {
		p.Refresh = 10
	}
	var b strings.Builder
	if err := s.pages[name].Execute(&b, p); err != nil {
		http.Error(w, "500 internal error: template "+name+": "+s.cfg.Redact(err.Error()), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, b.String())
}

// fail renders err as a page with its status: 400/404 for bad input, 502 for the
// broker, redacted.
func (s *Server) fail(w http.ResponseWriter, r *http.Request, err error) {
	s.failNote(w, r, err, "Nothing was changed.")
}

// failNote is fail with a note on what was changed.
func (s *Server) failNote(w http.ResponseWriter, r *http.Request, err error, note string) {
	status, msg := http.StatusInternalServerError, err.Error()
	var in inputError
	var be brokerError
	switch {
	case errors.As(err, &in):
		status = in.status
	case errors.As(err, &be):
		status = http.StatusBadGateway
		msg = "the broker did not answer as expected (the next request connects again): " + msg
	}
	s.render(w, status, "error", "", struct {
		Status  int
		Message string
		Note    string
	}{status, s.cfg.Redact(msg), note})
}

// audit writes one line for a move: time, client, action, filter, counts.
func (s *Server) audit(r *http.Request, action string, f ops.Filter, res ops.MoveResult, err error) {
	client, _, splitErr := net.SplitHostPort(r.RemoteAddr)
	if splitErr != nil {
		client = r.RemoteAddr
	}
	line := fmt.Sprintf("audit time=%s client=%s action=%s filter=%q queue=%s depth=%d scanned=%d matched=%d done=%d skipped=%d unroutable=%d dry_run=%t",
		time.Now().UTC().Format(time.RFC3339), client, action, describeFilter(f), res.Queue, res.Depth, res.Scanned, res.Matched, res.Done, res.Skipped, res.Unroutable, res.DryRun)
	if res.Stopped != "" {
		line += " stopped=" + res.Stopped
	}
	if err != nil {
		line += fmt.Sprintf(" error=%q", err.Error())
	}
	fmt.Fprintln(s.cfg.Audit, s.cfg.Redact(line))
}
