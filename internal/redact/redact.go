// Package redact keeps passwords out of what the library, its command and its tests
// print: every URI the root module shows and every error of it that may quote a URI
// goes through it. The modules of their own (amqp1, metrics, cmd/amqpretry, the
// quickstarts) build on the public API only and redact with their own code.
package redact

import (
	"errors"
	"net/url"
	"regexp"
	"strings"
)

// unparseable stands for a URI that cannot be shown safely.
const unparseable = "(unparseable amqp uri)"

// URI returns uri with its password replaced by "xxxxx", or a placeholder when uri is
// not an amqp:// or amqps:// URI with a host (url.Parse takes many malformed URIs,
// such as "amqp//user:pass@host/", for a path that still has the password).
func URI(uri string) string {
	u, err := url.Parse(uri)
	if err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") || u.Host == "" || u.Opaque != "" {
		return unparseable
	}
	return u.Redacted()
}

// userinfo matches the password part of anything shaped like scheme://user:password@,
// however malformed the rest: it is replaced, and nothing else (a password that
// happens to be "1" must not garble the host "127.0.0.1").
var userinfo = regexp.MustCompile(`(://[^/@\s:"]*:)([^@\s"]*)@`)

// String returns s with every occurrence of uri shown as URI(uri), and the password
// of anything else in it shaped like a URI with a password replaced by "xxxxx".
func String(s, uri string) string {
	if uri != "" {
		s = strings.ReplaceAll(s, uri, URI(uri))
	}
	return userinfo.ReplaceAllString(s, "${1}xxxxx@")
}

// Error returns err, or, when its text would show a password (of uri, or of any URI
// it quotes), an error with the redacted text. The redacted error wraps the sentinels
// of err that errors.Is finds among wanted, so that callers can still match them; it
// does not wrap err itself, whose text has the password.
func Error(err error, uri string, wanted ...error) error {
	if err == nil {
		return nil
	}
	text := err.Error()
	clean := String(text, uri)
	if clean == text && !leaks(text, uri) {
		return err
	}
	if clean == text { // the password appears outside any URI shape: drop the text
		clean = "(error text withheld: it quotes a password)"
	}
	r := &redacted{text: clean}
	for _, w := range wanted {
		if errors.Is(err, w) {
			r.wraps = append(r.wraps, w)
		}
	}
	return r
}

// leaks tells whether text has the password of uri outside a URI shape.
func leaks(text, uri string) bool {
	u, err := url.Parse(uri)
	if err != nil || u.User == nil {
		// A URI url.Parse refuses: look for its userinfo by hand.
		if i, j := strings.Index(uri, "://"), strings.LastIndex(uri, "@"); i >= 0 && j > i+3 {
			if c := strings.Index(uri[i+3:j], ":"); c >= 0 {
				p := uri[i+3+c+1 : j]
				return p != "" && strings.Contains(text, uri[i+3:j])
			}
		}
		return false
	}
	p, ok := u.User.Password()
	return ok && p != "" && strings.Contains(text, u.User.String())
}

type redacted struct {
	text  string
	wraps []error
}

func (r *redacted) Error() string   { return r.text }
func (r *redacted) Unwrap() []error { return r.wraps }
