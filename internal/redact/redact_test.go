package redact

import (
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
