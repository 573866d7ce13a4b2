package console

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/format"
	"github.com/amqpretry/amqpretry/ops"
)

// noBlocked is the answer of the blocked keys' pages when there is no rabbitmqctl.
const noBlocked = "the blocked order keys are listed with rabbitmqctl (each has a queue of its own, and AMQP cannot list queues): start the console with --rabbitmqctl (auto finds it for a broker on this host)"

// blockedLine is the overview's line on the blocked keys: empty when there are none,
// Error when they could not be listed.
type blockedLine struct {
	Line, Error string
}

// blockedSummary lists the blocked keys for the overview (with rabbitmqctl only),
// unless queues, every queue the broker's counts named (nil: unknown), has no behind
// queue.
func (s *Server) blockedSummary(r *http.Request, queues map[string]int) blockedLine {
	if !s.cfg.Blocked {
		return blockedLine{}
	}
	if queues != nil && s.cfg.BehindQueues != "" {
		prefix := strings.TrimSuffix(s.cfg.BehindQueues, "*")
		found := false
		for q := range queues {
			if strings.HasPrefix(q, prefix) {
				found = true
				break
			}
		}
		if !found {
			return blockedLine{}
		}
	}
	var keys []ops.BlockedKey
	err := s.use(func(b Broker) (err error) {
		keys, err = b.Blocked(r.Context())
		return err
	})
	switch {
	case err != nil:
		return blockedLine{Error: s.cfg.Redact(err.Error())}
	case len(keys) == 0:
		return blockedLine{}
	}
	return blockedLine{Line: format.Blocked(keys)}
}

// blockedRow is one blocked key on its page.
type blockedRow struct {
	ops.BlockedKey
	Age, HeadLink string
}

// blocked is GET /blocked: every blocked key, what waits behind it and its poisoned
// head, each with its moves.
func (s *Server) blocked(w http.ResponseWriter, r *http.Request) {
	if !s.cfg.Blocked {
		s.fail(w, r, badRequest(noBlocked))
		return
	}
	var keys []ops.BlockedKey
	err := s.use(func(b Broker) (err error) {
		keys, err = b.Blocked(r.Context())
		return err
	})
	if err != nil {
		s.fail(w, r, err)
		return
	}
	rows := make([]blockedRow, len(keys))
	for i, k := range keys {
		rows[i] = blockedRow{BlockedKey: k, Age: "-"}
		if k.Head == nil {
			continue
		}
		if !k.Head.LastFailure.IsZero() {
			rows[i].Age = format.Duration(time.Since(k.Head.LastFailure)) + " ago"
		}
		id := k.Head.UUID
		if id == "" {
			id = k.Head.MessageID
		}
		rows[i].HeadLink = "/message?" + url.Values{"source": {string(ops.Poison)}, "id": {id}}.Encode()
	}
	s.render(w, http.StatusOK, "blocked", "blocked", struct {
		Rows    []blockedRow
		Summary string
	}{rows, format.Blocked(keys)})
}

// releaseForm is a release as the blocked keys' page posts it.
type releaseForm struct {
	Queue, Key         string
	RedriveHead, Force bool
}

// Verb is what the release does, for the pages.
func (m releaseForm) Verb() string {
	if m.RedriveHead {
		return "redrive the head, then release"
	}
	if m.Force {
		return "release before the head"
	}
	return "release"
}

// Fields are the hidden fields that post the same release again.
func (m releaseForm) Fields() []header {
	action := "release"
	if m.RedriveHead {
		action = "redrive-head"
	}
	out := []header{{"queue", m.Queue}, {"key", m.Key}, {"action", action}}
	if m.Force {
		out = append(out, header{"force", "1"})
	}
	return out
}

// parseRelease reads and checks a release's form; nothing is done on an error.
func parseRelease(v url.Values) (releaseForm, error) {
	m := releaseForm{Queue: v.Get("queue"), Key: v.Get("key"), Force: v.Get("force") == "1"}
	switch v.Get("action") {
	case "release":
	case "redrive-head":
		m.RedriveHead = true
	default:
		return m, badRequest("action: want release or redrive-head, got %q", v.Get("action"))
	}
	switch {
	case m.Queue == "" || m.Key == "":
		return m, badRequest("queue and key are both required: the work queue and the blocked key")
	case m.RedriveHead && m.Force:
		return m, badRequest("force goes with release, not with redrive-head: a head that is not in the poison queue cannot be redriven")
	}
	return m, nil
}

// releaseWords names the console's buttons in ops.Release's refusals.
var releaseWords = strings.NewReplacer(
	"set Force to release it anyway", `release it anyway with "Release now, before its head" on the blocked keys page (the messages behind it then run before their head, out of the key's order)`,
	"release without it, with Force,", `release it instead with "Release now, before its head"`,
)

// release is POST /release: step "dry" shows what the release would do and asks to
// confirm; step "do" releases, logs an audit line, and reports what it did.
func (s *Server) release(w http.ResponseWriter, r *http.Request) {
	if !s.cfg.Blocked {
		s.fail(w, r, badRequest(noBlocked))
		return
	}
	m, err := parseRelease(r.PostForm)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	step := r.PostForm.Get("step")
	if step != "dry" && step != "do" {
		s.fail(w, r, badRequest("step: want dry or do, got %q", step))
		return
	}
	var res ops.ReleaseResult
	err = s.use(func(b Broker) (err error) {
		res, err = b.Release(r.Context(), ops.ReleaseOptions{Queue: m.Queue, Key: m.Key, RedriveHead: m.RedriveHead, Force: m.Force, DryRun: step == "dry"})
		return err
	})
	if step == "do" {
		s.auditRelease(r, m, res, err)
	}
	var refused inputError
	if errors.As(err, &refused) {
		refused.msg = releaseWords.Replace(refused.msg)
		if strings.Contains(refused.msg, ": not blocked (") {
			refused.msg += "; the blocked keys page lists those that are"
		}
		err = refused
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	done := ""
	switch {
	case res.DryRun:
	case res.Released:
		done = "A release went to " + res.Key.Queue + ": the application consuming it runs what waits behind the key, then unblocks it."
	default:
		done = "The key stays blocked until then."
	}
	s.render(w, http.StatusOK, "release", "blocked", struct {
		M    releaseForm
		R    ops.ReleaseResult
		Line string
		Done string
	}{m, res, format.Release(res, fmt.Sprintf("%q", m.Key), "the poison queue"), done})
}

// auditRelease writes one line for a release: time, client, action, key, what it did.
func (s *Server) auditRelease(r *http.Request, m releaseForm, res ops.ReleaseResult, err error) {
	client, _, splitErr := net.SplitHostPort(r.RemoteAddr)
	if splitErr != nil {
		client = r.RemoteAddr
	}
	action := "blocked.release"
	if m.RedriveHead {
		action = "blocked.redrive-head"
	}
	line := fmt.Sprintf("audit time=%s client=%s action=%s queue=%s key=%q force=%t behind=%d released=%t",
		time.Now().UTC().Format(time.RFC3339), client, action, m.Queue, m.Key, m.Force, res.Key.Behind, res.Released)
	if res.Redriven != nil {
		line += " redriven=" + res.Redriven.UUID
	}
	if err != nil {
		line += fmt.Sprintf(" error=%q", err.Error())
	}
	fmt.Fprintln(s.cfg.Audit, s.cfg.Redact(line))
}
