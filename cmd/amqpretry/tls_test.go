package main

import (
	"net/url"
	"strings"
	"testing"

	"github.com/amqpretry/amqpretry/internal/testsupport/tlstest"
)

// TestTLSStatus: topology apply and status over amqps, the CA (and for SASL EXTERNAL
// the client certificate) in the URI's query, as amqp091-go reads it; a wrong CA or
// server name fails with the TLS error (exit 1), never showing the password.
func TestTLSStatus(t *testing.T) {
	tlsEnv := tlstest.Get(t)
	e := newEnv(t, "orders")
	withCA := tlstest.WithQuery(t, tlsEnv.URI, "cacertfile", tlsEnv.File("ca.pem"))
	t.Setenv(uriEnv, withCA)
	e.apply()
	code, out, errOut := e.run("status", "--rabbitmqctl", "off", "--queue", e.queues[0])
	if code != exitOK || !strings.Contains(out, "nothing flagged") {
		t.Errorf("status over amqps exited %d:\n%s%s", code, out, errOut)
	}
	u, _ := url.Parse(tlsEnv.URI)
	if want := " at amqps://" + u.User.Username() + ":xxxxx@" + u.Host + "/"; !strings.Contains(out, want) {
		t.Errorf("status does not name the broker as %q:\n%s", want, out)
	}

	client := tlsEnv.ClientCert(t, false)
	t.Setenv(uriEnv, tlstest.WithQuery(t, "amqps://"+u.Host+"/", "auth_mechanism", "external",
		"cacertfile", tlsEnv.File("ca.pem"), "certfile", client.CertFile, "keyfile", client.KeyFile))
	if code, out, errOut := e.run("status", "--rabbitmqctl", "off", "--queue", e.queues[0]); code != exitOK {
		t.Errorf("status with SASL EXTERNAL exited %d:\n%s%s", code, out, errOut)
	}

	uri, secret := tlstest.WithPassword(t, tlsEnv.URI)
	for _, tc := range []struct{ name, uri, want string }{
		{"wrong CA", tlstest.WithQuery(t, uri, "cacertfile", tlsEnv.File("wrongca.pem")), "certificate signed by unknown authority"},
		{"wrong server name", tlstest.WithQuery(t, uri, "cacertfile", tlsEnv.File("ca.pem"), "server_name_indication", "wrong.invalid"), "not wrong.invalid"},
	} {
		t.Setenv(uriEnv, tc.uri)
		code, out, errOut := e.run("status", "--rabbitmqctl", "off")
		if code != exitFailed || !strings.Contains(errOut, tc.want) || strings.Contains(out+errOut, secret) {
			t.Errorf("%s: status exited %d (want %d, the TLS error, no password):\n%s%s", tc.name, code, exitFailed, out, errOut)
		}
	}
}
