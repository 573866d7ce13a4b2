package redact

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
)

func TestURI(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"amqp://guest:s3cr3t@127.0.0.1:5672/", "amqp://guest:xxxxx@127.0.0.1:5672/"},
		{"amqps://u:s3cr3t@host/vhost", "amqps://u:xxxxx@host/vhost"},
		{"amqp://127.0.0.1/", "amqp://127.0.0.1/"},
		{"amqp//guest:s3cr3t@host/", "(unparseable amqp uri)"},
		{"guest:s3cr3t@host", "(unparseable amqp uri)"},
		{"amqp:guest:s3cr3t@host", "(unparseable amqp uri)"},
		{"http://u:s3cr3t@host/", "(unparseable amqp uri)"},
		{"amqp://guest:s3cr3t@127.0.0.1:notaport/", "(unparseable amqp uri)"},
		{"", "(unparseable amqp uri)"},
	} {
		got := URI(tt.in)
		if got != tt.want || strings.Contains(got, "s3cr3t") {
			t.Errorf("URI(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestString(t *testing.T) {
	for _, tt := range []struct{ s, uri, want string }{
		// A one-character password must not garble the host (issue 19).
		{"dial amqp://guest:1@127.0.0.1:5673/: refused", "amqp://guest:1@127.0.0.1:5673/", "dial amqp://guest:xxxxx@127.0.0.1:5673/: refused"},
		// A password equal to the user name leaves the user name alone.
		{"dial amqp://guest:guest@h:1/ failed", "amqp://guest:guest@h:1/", "dial amqp://guest:xxxxx@h:1/ failed"},
		// A malformed URI quoted by a parse error.
		{`parse "amqp://u:s3cret@host:badport/": invalid port ":badport" after host`, "amqp://u:s3cret@host:badport/", `parse "(unparseable amqp uri)": invalid port ":badport" after host`},
		{`parse "amqp://u:s3cret@host:badport/"`, "", `parse "amqp://u:xxxxx@host:badport/"`},
		// Another URI in the text.
		{"via amqps://a:b3@x/", "", "via amqps://a:xxxxx@x/"},
		{"nothing secret", "amqp://u:p@h/", "nothing secret"},
	} {
		if got := String(tt.s, tt.uri); got != tt.want {
			t.Errorf("String(%q, %q) = %q, want %q", tt.s, tt.uri, got, tt.want)
		}
	}
}

func TestError(t *testing.T) {
	sentinel := errors.New("sentinel")
	uri := "amqp://user:s3cret@host:badport/"
	_, perr := url.Parse(uri) //lint:ignore SA1007 the malformed URI is the point

	for _, err := range []error{
		perr,
		fmt.Errorf("%w: %w", sentinel, perr),
		fmt.Errorf("%w: user:s3cret", sentinel), // the userinfo outside a URI shape
	} {
		got := Error(err, uri, sentinel)
		if strings.Contains(got.Error(), "s3cret") {
			t.Errorf("Error(%q) = %q: shows the password", err, got)
		}
		if errors.Is(err, sentinel) != errors.Is(got, sentinel) {
			t.Errorf("Error(%q): errors.Is(sentinel) changed", err)
		}
	}
	plain := errors.New("connection refused")
	if got := Error(plain, uri); got != plain {
		t.Errorf("Error(%q) = %v, want the error itself", plain, got)
	}
}
