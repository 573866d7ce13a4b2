package amqp1

import (
	"strings"
	"testing"
)

func TestParseURI(t *testing.T) {
	for _, tc := range []struct {
		uri, addr, vhost, user, redacted string
		tls                              bool
	}{
		{"amqp://guest:guest@127.0.0.1:5675/", "amqp://127.0.0.1:5675", "/", "guest", "amqp://guest:xxxxx@127.0.0.1:5675/", false},
		{"amqp://localhost", "amqp://localhost:5672", "/", "", "amqp://localhost", false},
		{"amqps://u:p@broker.example/prod", "amqps://broker.example:5671", "prod", "u", "amqps://u:xxxxx@broker.example/prod", true},
		{"amqp://u:p@h:1/%2f", "amqp://h:1", "/", "u", "amqp://u:xxxxx@h:1/%2f", false},
		{"amqp://u:p@h/a%20b", "amqp://h:5672", "a b", "u", "amqp://u:xxxxx@h/a%20b", false},
		{"amqp://u:p@[::1]:5675/", "amqp://[::1]:5675", "/", "u", "amqp://u:xxxxx@[::1]:5675/", false},
	} {
		e, err := parseURI(tc.uri, nil)
		if err != nil {
			t.Errorf("%s: %v", tc.uri, err)
			continue
		}
		if e.addr != tc.addr || e.vhost != tc.vhost || e.user != tc.user || e.redacted != tc.redacted || (e.tls != nil) != tc.tls {
			t.Errorf("%s: got addr %q vhost %q user %q redacted %q tls %v", tc.uri, e.addr, e.vhost, e.user, e.redacted, e.tls != nil)
		}
		if opts := e.connOptions("c"); opts.HostName != "vhost:"+tc.vhost {
			t.Errorf("%s: hostname %q", tc.uri, opts.HostName)
		}
		if tc.tls && e.tls.ServerName != "broker.example" {
			t.Errorf("%s: TLS server name %q", tc.uri, e.tls.ServerName)
		}
	}
}

// TestURIErrorsHideThePassword: no error about a URI repeats its password.
func TestURIErrorsHideThePassword(t *testing.T) {
	const secret = "s3cr3t-pa55"
	for _, uri := range []string{
		"amqp://user:" + secret + "@bad host:5672/",
		"http://user:" + secret + "@host/",
		"amqp://user:" + secret + "@:5672/",
		"amqp://user:" + secret + "@host:port/",
		"",
	} {
		_, err := parseURI(uri, nil)
		if err == nil {
			t.Errorf("%q: no error", uri)
			continue
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("error shows the password: %v", err)
		}
		if _, err := NewPublisher(PublisherConfig{URI: uri}, nil); err == nil || strings.Contains(err.Error(), secret) {
			t.Errorf("NewPublisher(%q): %v", uri, err)
		}
		if _, err := NewSubscriber(SubscriberConfig{URI: uri}, nil); err == nil || strings.Contains(err.Error(), secret) {
			t.Errorf("NewSubscriber(%q): %v", uri, err)
		}
	}
}
