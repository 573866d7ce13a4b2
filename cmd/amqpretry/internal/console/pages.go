package console

import (
	"context"
	"encoding/hex"
	"fmt"
	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/format"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/ops"
)

// payloadCap is the most payload bytes a message page shows.
const payloadCap = 16 << 10

// firstFew is how many messages a dry run lists.
const firstFew = 10

// reasons are the poison reasons the filter takes.
var reasons = []amqpretry.Reason{
	amqpretry.ReasonPermanent, amqpretry.ReasonMaxAttempts, amqpretry.ReasonDelayTooLong,
	amqpretry.ReasonHandoffFailed, amqpretry.ReasonTooLarge, amqpretry.ReasonDeliveryLimit,
}

var funcs = template.FuncMap{
	"stamp": stamp,
	"ago": func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return stamp(t) + " (" + format.Duration(time.Since(t)) + " ago)"
	},
	"in": func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		d := time.Until(t)
		if d < 0 {
			return stamp(t) + " (" + format.Duration(-d) + " overdue)"
		}
		return stamp(t) + " (in " + format.Duration(d) + ")"
	},
	"dur":   format.Duration,
	"conf":  format.Configured,
	"delay": format.Delay,
	"join":  strings.Join,
	"upper": strings.ToUpper,
	"dash": func(s string) string {
		if s == "" {
			return "-"
		}
		return s
	},
	"clip": func(s string, n int) string {
		r := []rune(strings.ReplaceAll(s, "\n", " "))
		if len(r) <= n {
			return string(r)
		}
		return string(r[:n]) + "…"
	},
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

// parseFilter reads the filter fields of a query or form: queue, reason, error,
// older, newer (durations), id (repeated).
func parseFilter(v url.Values) (ops.Filter, error) {
	f := ops.Filter{Queue: strings.TrimSpace(v.Get("queue")), Error: v.Get("error")}
	if r := v.Get("reason"); r != "" {
		if !slices.Contains(reasons, amqpretry.Reason(r)) {
			return f, badRequest("reason: unknown reason %q (known: %s)", r, reasonList())
		}
		f.Reason = amqpretry.Reason(r)
	}
	for _, d := range []struct {
		name string
		to   *time.Duration
	}{{"older", &f.OlderThan}, {"newer", &f.NewerThan}} {
		s := strings.TrimSpace(v.Get(d.name))
		if s == "" {
			continue
		}
		t, err := time.ParseDuration(s)
		if err != nil || t < 0 {
			return f, badRequest("%s: want a duration such as 90s or 2h, got %q", d.name, s)
		}
		*d.to = t
	}
	for _, id := range v["id"] {
		if id = strings.TrimSpace(id); id != "" {
			f.IDs = append(f.IDs, id)
		}
	}
	return f, nil
}

func reasonList() string {
	s := make([]string, len(reasons))
	for i, r := range reasons {
		s[i] = string(r)
	}
	return strings.Join(s, ", ")
}

// filterQuery is f as a query string (without the IDs).
func filterQuery(f ops.Filter) url.Values {
	v := url.Values{}
	set := func(k, s string) {
		if s != "" {
			v.Set(k, s)
		}
	}
	set("queue", f.Queue)
	set("reason", string(f.Reason))
	set("error", f.Error)
	if f.OlderThan > 0 {
		v.Set("older", f.OlderThan.String())
	}
	if f.NewerThan > 0 {
		v.Set("newer", f.NewerThan.String())
	}
	return v
}

// describeFilter is f in one line, for the audit and the confirmation.
func describeFilter(f ops.Filter) string {
	parts := []string{}
	if q := filterQuery(f).Encode(); q != "" {
		parts = append(parts, q)
	}
	if len(f.IDs) > 0 {
		parts = append(parts, "ids="+strings.Join(f.IDs, ","))
	}
	if len(parts) == 0 {
		return "all"
	}
	return strings.Join(parts, " ")
}

// row is one queue of the overview.
type row struct {
	ops.QueueStatus
	Link, Oldest, State string
}

// rows renders queues as the overview's rows.
func (s *Server) rows(st ops.Status, queues []ops.QueueStatus) []row {
	rows := make([]row, 0, len(queues))
	for _, q := range queues {
		x := row{QueueStatus: q, Oldest: "-", State: "ok"}
		switch q.Role {
		case "poison":
			x.Link = "/poison"
		case "parking":
			x.Link = "/parking"
		case "work":
			if s.cfg.Waiting {
				x.Link = "/waiting?" + url.Values{"queue": {q.Name}}.Encode()
			}
		}
		if q.AgeKnown {
			x.Oldest = format.Duration(q.OldestAge)
		}
		var states []string
		for _, f := range st.Flags {
			if f.Name == q.Name && f.Role == q.Role {
				states = append(states, strings.ToUpper(string(f.Kind)))
			}
		}
		if q.PossibleOutage() {
			states = append(states, "POSSIBLE OUTAGE")
		}
		if q.Unconsumed() {
			states = append(states, "NO CONSUMER")
		}
		if len(states) > 0 {
			x.State = strings.Join(states, ", ")
		}
		rows = append(rows, x)
	}
	return rows
}

// status reads the status for a page.
func (s *Server) status(r *http.Request) (ops.Status, error) {
	return s.statusWith(r, s.cfg.Status)
}

// statusWith reads the status with opts.
func (s *Server) statusWith(r *http.Request, opts ops.StatusOptions) (ops.Status, error) {
	var st ops.Status
	err := s.use(func(b Broker) (err error) {
		st, err = b.Status(r.Context(), opts)
		return err
	})
	return st, err
}

// overview shows, in the order of ops.Overview: the poison and parking queues, the
// work queues in a possible outage (said below the table, with what it is based on),
// those with a backlog and no consumer, what is flagged, one line on the blocked
// order keys when there are any (on /blocked), then the other work queues, one line
// on the delay storage (its queues on /delay) and the waiting retries.
func (s *Server) overview(w http.ResponseWriter, r *http.Request) {
	// The broker's counts name every queue: without a behind queue among them, no key
	// is blocked, and the blocked keys are not listed.
	opts := s.cfg.Status
	var queues map[string]int
	if counts := opts.Counts; counts != nil && s.cfg.Blocked {
		opts.Counts = func(ctx context.Context) (ops.BrokerCounts, error) {
			c, err := counts(ctx)
			if err == nil {
				queues = c.Messages
			}
			return c, err
		}
	}
	st, err := s.statusWith(r, opts)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	ov := st.Overview()
	var work []row
	for _, x := range s.rows(st, st.Queues) {
		if x.Role == "work" && x.WaitingRead {
			work = append(work, x)
		}
	}
	flags := make([]string, len(st.Flags))
	for i, f := range st.Flags {
		flags[i] = s.cfg.Describe(f, st)
	}
	var outages []string
	for _, q := range ov.First {
		if q.PossibleOutage() {
			outages = append(outages, format.PossibleOutage(q))
		}
	}
	s.render(w, http.StatusOK, "overview", "overview", struct {
		Status      ops.Status
		Rows, Work  []row
		Delay       ops.DelaySummary
		Outages     []string
		Flags       []string
		CountsError string
		BlockedKeys blockedLine
	}{st, s.rows(st, append(ov.First, ov.Work...)), work, ov.Delay, outages, flags, s.cfg.Redact(st.CountsError), s.blockedSummary(r, queues)})
}

// delayQueues lists every delay queue, the flagged ones first.
func (s *Server) delayQueues(w http.ResponseWriter, r *http.Request) {
	st, err := s.status(r)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	ov := st.Overview()
	var queues []ops.QueueStatus
	for _, q := range ov.First {
		if q.Role == "delay" {
			queues = append(queues, q)
		}
	}
	s.render(w, http.StatusOK, "delay", "delay", struct {
		Status ops.Status
		Rows   []row
		Delay  ops.DelaySummary
	}{st, s.rows(st, append(queues, ov.DelayQueues...)), ov.Delay})
}

// group is the messages read that share one error.
type group struct {
	Error string
	Count int
	Link  string
}

func (s *Server) messages(w http.ResponseWriter, r *http.Request) {
	source := ops.Source(strings.TrimPrefix(r.URL.Path, "/"))
	if source == ops.Parking && !s.cfg.Parking {
		s.fail(w, r, notFound("this backend has no parking queue"))
		return
	}
	q := r.URL.Query()
	f, err := parseFilter(q)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	pageNo, res, err := s.listPage(r, source, f)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	counts := map[string]int{}
	for _, m := range res.Messages {
		counts[m.Error]++
	}
	groups := make([]group, 0, len(counts))
	for e, n := range counts {
		v := filterQuery(f)
		v.Set("error", e)
		groups = append(groups, group{Error: e, Count: n, Link: "/" + string(source) + "?" + v.Encode()})
	}
	sort.Slice(groups, func(i, j int) bool {
		if groups[i].Count != groups[j].Count {
			return groups[i].Count > groups[j].Count
		}
		return groups[i].Error < groups[j].Error
	})
	from := min((pageNo-1)*s.cfg.Limit, len(res.Messages))
	to := min(from+s.cfg.Limit, len(res.Messages))
	link := func(p int) string {
		v := filterQuery(f)
		v.Set("page", strconv.Itoa(p))
		return "/" + string(source) + "?" + v.Encode()
	}
	var prev, next string
	if pageNo > 1 {
		prev = link(pageNo - 1)
	}
	if to < len(res.Messages) {
		next = link(pageNo + 1)
	}
	s.render(w, http.StatusOK, "messages", string(source), struct {
		Source         ops.Source
		Result         ops.ListResult
		Page           []ops.Message
		From, To, Num  int
		Prev, Next     string
		Groups         []group
		Filter         ops.Filter
		Reasons        []amqpretry.Reason
		Window         int
		CanPurge       bool
		ResetByDefault bool
	}{source, res, res.Messages[from:to], from + 1, to, pageNo, prev, next, groups, f, reasons, s.cfg.Window,
		source == ops.Poison, source == ops.Poison})
}

func pageNumber(q url.Values) (int, error) {
	p := q.Get("page")
	if p == "" {
		return 1, nil
	}
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 {
		return 0, badRequest("page: want a number from 1, got %q", p)
	}
	return n, nil
}

// header is one header of a message.
type header struct{ Key, Value string }

func (s *Server) message(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	source, err := s.source(q.Get("source"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	id := q.Get("id")
	if id == "" {
		s.fail(w, r, badRequest("id: the message's UUID or AMQP message id is required"))
		return
	}
	var res ops.ListResult
	err = s.use(func(b Broker) (err error) {
		res, err = b.List(r.Context(), source, ops.ListOptions{Filter: ops.Filter{IDs: []string{id}}, Limit: 1, Full: true, Window: s.cfg.Window})
		return err
	})
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if len(res.Messages) == 0 {
		s.fail(w, r, notFound("no message %q among the %d read of %s (it was moved, or lies past the window of %d)", id, res.Scanned, orQueue(res.Queue, source), s.cfg.Window))
		return
	}
	m := res.Messages[0]
	var headers []header
	for k, v := range m.Metadata {
		if !s.cfg.Hidden(k) {
			headers = append(headers, header{k, v})
		}
	}
	sort.Slice(headers, func(i, j int) bool { return headers[i].Key < headers[j].Key })
	body, capped := m.Payload, false
	if len(body) > payloadCap {
		body, capped = body[:payloadCap], true
	}
	view := q.Get("view")
	if view != "hex" && view != "text" {
		view = "text"
		if !printable(body) {
			view = "hex"
		}
	}
	shown := string(body)
	if view == "hex" {
		shown = hex.Dump(body)
	}
	s.render(w, http.StatusOK, "message", string(source), struct {
		Source      ops.Source
		M           ops.Message
		Headers     []header
		Payload     string
		View        string
		Capped      bool
		Cap         int
		TextLink    string
		HexLink     string
		CanPurge    bool
		CanRedrive  bool
		ResetAttmpt bool
	}{source, m, headers, shown, view, capped, payloadCap,
		"/message?" + url.Values{"source": {string(source)}, "id": {id}, "view": {"text"}}.Encode(),
		"/message?" + url.Values{"source": {string(source)}, "id": {id}, "view": {"hex"}}.Encode(),
		source == ops.Poison, source != ops.Waiting, source == ops.Poison})
}

func orQueue(q string, s ops.Source) string {
	if q == "" {
		return "the " + string(s) + " messages"
	}
	return "queue " + q
}

// printable tells whether b reads as text: UTF-8 without control characters but
// newlines and tabs.
func printable(b []byte) bool {
	if !utf8.Valid(b) {
		return false
	}
	for _, r := range string(b) {
		if unicode.IsControl(r) && r != '\n' && r != '\r' && r != '\t' {
			return false
		}
	}
	return true
}

// source reads a source name the console serves.
func (s *Server) source(name string) (ops.Source, error) {
	switch ops.Source(name) {
	case ops.Poison:
		return ops.Poison, nil
	case ops.Parking:
		if s.cfg.Parking {
			return ops.Parking, nil
		}
		return "", notFound("this backend has no parking queue")
	case ops.Waiting:
		if s.cfg.Waiting {
			return ops.Waiting, nil
		}
		return "", badRequest("the waiting retries are read with rabbitmqctl: start the console with --rabbitmqctl")
	}
	return "", badRequest("source: want poison, parking or waiting, got %q", name)
}

// bar is one bucket of the chart of due times.
type bar struct {
	Label             string
	Count             int
	X, Y, W, H, TextY int
}

// chart counts msgs by due time from now: overdue, span cut in n buckets, later.
func chart(msgs []ops.Message, now time.Time, span time.Duration, n int) (bars []bar, total, height int) {
	step := span / time.Duration(n)
	counts := make([]int, n+2)
	for _, m := range msgs {
		in := due(m).Sub(now)
		switch {
		case in < 0:
			counts[0]++
		case in >= span:
			counts[n+1]++
		default:
			counts[1+int(in/step)]++
		}
	}
	most := slices.Max(counts)
	const width, barH, gap = 46, 120, 6
	height = barH + 40
	for i, c := range counts {
		label := spell(time.Duration(i-1) * step) // where the bucket starts
		switch i {
		case 0:
			label = "overdue"
		case n + 1:
			label = "later"
		}
		h := 0
		if most > 0 {
			h = c * barH / most
		}
		if c > 0 && h == 0 {
			h = 1
		}
		bars = append(bars, bar{Label: label, Count: c, X: i * (width + gap), Y: 10 + barH - h, W: width, H: h, TextY: 10 + barH - h - 2})
	}
	return bars, len(counts) * (width + gap), height
}

// spell writes a bucket's start from now: +0m, +5m, +1h.
func spell(d time.Duration) string {
	if d%time.Hour == 0 && d > 0 {
		return fmt.Sprintf("+%dh", d/time.Hour)
	}
	return fmt.Sprintf("+%dm", d/time.Minute)
}

// due is when a waiting retry is due back: its envelope's due time, else its release.
func due(m ops.Message) time.Time {
	if !m.Due.IsZero() {
		return m.Due
	}
	return m.Release
}

func (s *Server) waiting(w http.ResponseWriter, r *http.Request) {
	if !s.cfg.Waiting {
		s.fail(w, r, badRequest("the waiting retries are read with rabbitmqctl eval: start the console with --rabbitmqctl (auto finds it for a broker on this host)"))
		return
	}
	q := r.URL.Query()
	f, err := parseFilter(q)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if f.Reason != "" {
		s.fail(w, r, badRequest("reason: a waiting retry has no poison reason; match its last error with error"))
		return
	}
	if f.Queue != "" && !slices.Contains(s.cfg.Status.WorkQueues, f.Queue) {
		s.fail(w, r, notFound("unknown work queue %q: the console knows %s (start it with --queue %s)", f.Queue, knownQueues(s.cfg.Status.WorkQueues), f.Queue))
		return
	}
	span, n, spanName := time.Hour, 12, "hour"
	switch q.Get("span") {
	case "", "hour":
	case "day":
		span, n, spanName = 24*time.Hour, 24, "day"
	default:
		s.fail(w, r, badRequest("span: want hour or day, got %q", q.Get("span")))
		return
	}
	pageNo, res, err := s.listPage(r, ops.Waiting, f)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	bars, width, height := chart(res.Messages, time.Now(), span, n)
	from := min((pageNo-1)*s.cfg.Limit, len(res.Messages))
	to := min(from+s.cfg.Limit, len(res.Messages))
	link := func(p int) string {
		v := filterQuery(f)
		v.Set("page", strconv.Itoa(p))
		v.Set("span", q.Get("span"))
		return "/waiting?" + v.Encode()
	}
	var prev, next string
	if pageNo > 1 {
		prev = link(pageNo - 1)
	}
	if to < len(res.Messages) {
		next = link(pageNo + 1)
	}
	spanLink := func(sp string) string {
		v := filterQuery(f)
		v.Set("span", sp)
		return "/waiting?" + v.Encode()
	}
	s.render(w, http.StatusOK, "waiting", "waiting", struct {
		Result        ops.ListResult
		Page          []ops.Message
		From, To, Num int
		Prev, Next    string
		Bars          []bar
		Width, Height int
		Span          string
		HourLink      string
		DayLink       string
		Filter        ops.Filter
		Window        int
	}{res, res.Messages[from:to], from + 1, to, pageNo, prev, next, bars, width, height, spanName,
		spanLink("hour"), spanLink("day"), f, s.cfg.Window})
}

func knownQueues(qs []string) string {
	if len(qs) == 0 {
		return "no work queue"
	}
	return strings.Join(qs, ", ")
}

// moveForm is a move as the forms post it.
type moveForm struct {
	Source ops.Source
	Action string // redrive (retry now for waiting) or purge
	Filter ops.Filter
	All    bool
	Reset  bool
}

// verb is what the move does, for the pages.
func (m moveForm) Verb() string {
	switch {
	case m.Action == "purge":
		return "purge"
	case m.Source == ops.Waiting:
		return "retry now"
	}
	return "redrive"
}

// Done is the past tense of Verb.
func (m moveForm) Done() string {
	switch m.Verb() {
	case "purge":
		return "purged"
	case "retry now":
		return "retried now"
	}
	return "redriven"
}

// Fields are the hidden fields that post the same move again.
func (m moveForm) Fields() []header {
	out := []header{{"source", string(m.Source)}, {"action", m.Action}}
	for k, vs := range filterQuery(m.Filter) {
		out = append(out, header{k, vs[0]})
	}
	for _, id := range m.Filter.IDs {
		out = append(out, header{"id", id})
	}
	if m.All {
		out = append(out, header{"all", "1"})
	}
	if m.Reset {
		out = append(out, header{"reset", "1"})
	}
	return out
}

// Back is the page the move came from.
func (m moveForm) Back() string {
	v := filterQuery(m.Filter)
	if m.Source == ops.Waiting {
		v.Del("reason")
		return "/waiting?" + v.Encode()
	}
	return "/" + string(m.Source) + "?" + v.Encode()
}

// parseMove reads and checks a move's form; nothing is done on an error.
func (s *Server) parseMove(r *http.Request) (moveForm, error) {
	v := r.PostForm
	var m moveForm
	source, err := s.source(v.Get("source"))
	if err != nil {
		return m, err
	}
	m.Source, m.Action = source, v.Get("action")
	if m.Filter, err = parseFilter(v); err != nil {
		return m, err
	}
	m.All, m.Reset = v.Get("all") == "1", v.Get("reset") == "1"
	switch {
	case m.Action != "redrive" && m.Action != "purge":
		return m, badRequest("action: want redrive or purge, got %q", m.Action)
	case m.Action == "purge" && source == ops.Parking:
		return m, badRequest("the parking queue is redriven, not purged (as with the amqpretry command)")
	case source == ops.Waiting && m.Filter.Reason != "":
		return m, badRequest("reason: a waiting retry has no poison reason; match its last error with error")
	case source == ops.Waiting && m.Filter.Queue != "" && !slices.Contains(s.cfg.Status.WorkQueues, m.Filter.Queue):
		return m, notFound("unknown work queue %q: the console knows %s", m.Filter.Queue, knownQueues(s.cfg.Status.WorkQueues))
	case source == ops.Waiting && m.Action == "redrive" && m.Filter.Queue == "":
		return m, badRequest("retry now needs the work queue (queue) whose retries to bring back")
	case m.Action == "purge" && describeFilter(m.Filter) == "all" && !m.All:
		return m, badRequest("no filter and no selection: tick \"all\" to purge every message")
	}
	return m, nil
}

// options are the ops options of m.
func (s *Server) options(m moveForm, dry bool) ops.MoveOptions {
	return ops.MoveOptions{Filter: m.Filter, DryRun: dry, All: m.All, ResetAttempts: m.Reset && m.Action == "redrive", Window: s.cfg.Window}
}

func (s *Server) run(r *http.Request, m moveForm, dry bool) (res ops.MoveResult, err error) {
	err = s.use(func(b Broker) (err error) {
		if m.Action == "purge" {
			res, err = b.Purge(r.Context(), m.Source, s.options(m, dry))
		} else {
			res, err = b.Redrive(r.Context(), m.Source, s.options(m, dry))
		}
		return err
	})
	return res, err
}

// move is POST /move: step "dry" runs the dry run and asks to confirm; step "do"
// acts, logs an audit line, and reports what it did and what it left.
func (s *Server) move(w http.ResponseWriter, r *http.Request) {
	m, err := s.parseMove(r)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	switch r.PostForm.Get("step") {
	case "dry":
		res, err := s.run(r, m, true)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		first := res.Messages
		if len(first) > firstFew {
			first = first[:firstFew]
		}
		// Would: the matching messages the run would act on; the unroutable ones (a
		// redrive's, whose queue does not exist) would stay, as the CLI's dry run says.
		s.render(w, http.StatusOK, "confirm", string(m.Source), struct {
			M      moveForm
			R      ops.MoveResult
			Would  int
			First  []ops.Message
			Filter string
		}{m, res, res.Matched - res.Unroutable, first, describeFilter(m.Filter)})
	case "do":
		res, err := s.run(r, m, false)
		s.audit(r, string(m.Source)+"."+strings.ReplaceAll(m.Verb(), " ", "-"), m.Filter, res, err)
		if err != nil {
			s.failNote(w, r, err, fmt.Sprintf("%d %s before it stopped; the rest stayed in place (the audit line on the console's stderr has the counts).", res.Done, m.Done()))
			return
		}
		status := http.StatusOK
		if len(res.Unrouted) > 0 || res.Stopped == "interrupted" {
			status = http.StatusConflict
		}
		s.render(w, status, "result", string(m.Source), struct {
			M      moveForm
			R      ops.MoveResult
			Left   int
			Filter string
		}{m, res, res.Depth - res.Done, describeFilter(m.Filter)})
	default:
		s.fail(w, r, badRequest("step: want dry or do, got %q", r.PostForm.Get("step")))
	}
}

// listPage reads the page number of r's query and lists what matches f in source, all
// of it up to the window (the page is cut from it).
func (s *Server) listPage(r *http.Request, source ops.Source, f ops.Filter) (int, ops.ListResult, error) {
	pageNo, err := pageNumber(r.URL.Query())
	if err != nil {
		return 0, ops.ListResult{}, err
	}
	var res ops.ListResult
	err = s.use(func(b Broker) (err error) {
		res, err = b.List(r.Context(), source, ops.ListOptions{Filter: f, Limit: -1, Window: s.cfg.Window})
		return err
	})
	return pageNo, res, err
}
