package main

import (
	"errors"
	"net/url"
	"regexp"
	"strings"
)

// The command's own messages (flag values, rabbitmqctl and management API errors)
// go through these before they are printed; ops redacts its own errors.

// unparseableURI stands for a URI that cannot be shown safely.
const unparseableURI = "(unparseable amqp uri)"

// redactURI returns uri with its password replaced by "xxxxx", or a placeholder when
// uri is not an amqp:// or amqps:// URI with a host (url.Parse takes many malformed
// URIs, such as "amqp//user:pass@host/", for a path that still has the password).
func redactURI(uri string) string {
	u, err := url.Parse(uri)
	if err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") || u.Host == "" || u.Opaque != "" {
		return unparseableURI
	}
	return u.Redacted()
}

// userinfo matches the password part of anything shaped like scheme://user:password@,
// however malformed the rest: it is replaced, and nothing else (a password that
// happens to be "1" must not garble the host "127.0.0.1").
var userinfo = regexp.MustCompile(`(://[^/@\s:"]*:)([^@\s"]*)@`)

// redactString returns s with every occurrence of uri shown as redactURI(uri), and the
// password of anything else in it shaped like a URI with a password replaced by
// "xxxxx".
func redactString(s, uri string) string {
	if uri != "" {
		s = strings.ReplaceAll(s, uri, redactURI(uri))
	}
	return userinfo.ReplaceAllString(s, "${1}xxxxx@")
}

// redactError returns err, or, when its text would show a password (of uri, or of any
// URI it quotes), an error with the redacted text, which does not wrap err.
func redactError(err error, uri string) error {
	if err == nil {
		return nil
	}
	text := err.Error()
	clean := redactString(text, uri)
	if u, perr := url.Parse(uri); perr == nil && u.User != nil {
		if p, ok := u.User.Password(); ok && p != "" && strings.Contains(clean, u.User.String()) {
			clean = "(error text withheld: it quotes a password)" // outside any URI shape
		}
	}
	if clean == text {
		return err
	}
	return errors.New(clean)
}
