package amqp1

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/testsupport/tlstest"
)

// tlsRoundTrip publishes one message over the publisher config and receives it over
// the subscriber config, both amqps.
func tlsRoundTrip(t *testing.T, queue string, pc PublisherConfig, sc SubscriberConfig) {
	t.Helper()
	declareQueue(t, queue, "quorum", nil)
	pub, err := NewPublisher(pc, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	msg := message.NewMessage(watermill.NewUUID(), []byte("over tls"))
	if err := pub.Publish(queue, msg); err != nil {
		t.Fatalf("publish over amqps: %v", err)
	}
	sc.Queue.NoDeclare = true
	sub, err := NewSubscriber(sc, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ctx := testContext(t, 30*time.Second)
	messages, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatalf("subscribe over amqps: %v", err)
	}
	select {
	case got, ok := <-messages:
		if !ok {
			t.Fatal("no message received over amqps within 30 s")
		}
		got.Ack()
		if got.UUID != msg.UUID {
			t.Errorf("received %s, want %s", got.UUID, msg.UUID)
		}
	case <-ctx.Done():
		t.Fatal("no message received over amqps within 30 s")
	}
}

// TestTLS: AMQP 1.0 over amqps, the CA given in TLSConfig or in the URI (cacertfile,
// as amqp091-go reads it), and SASL EXTERNAL with a client certificate from the URI.
// AMQPS_URI names the TLS listener of the broker at AMQP1_URI.
func TestTLS(t *testing.T) {
	env := tlstest.Get(t)
	requireBroker(t)
	t.Run("CA in TLSConfig", func(t *testing.T) {
		cfg := env.Config(t)
		tlsRoundTrip(t, queueName(t, "tls-config"), PublisherConfig{URI: env.URI, TLSConfig: cfg}, SubscriberConfig{URI: env.URI, TLSConfig: cfg})
	})
	t.Run("CA in the URI", func(t *testing.T) {
		uri := tlstest.WithQuery(t, env.URI, "cacertfile", env.File("ca.pem"))
		tlsRoundTrip(t, queueName(t, "tls-uri"), PublisherConfig{URI: uri}, SubscriberConfig{URI: uri})
	})
	t.Run("SASL EXTERNAL", func(t *testing.T) {
		client := env.ClientCert(t, false)
		u, _ := url.Parse(env.URI)
		uri := tlstest.WithQuery(t, "amqps://"+u.Host+"/", "auth_mechanism", "external",
			"cacertfile", env.File("ca.pem"), "certfile", client.CertFile, "keyfile", client.KeyFile)
		tlsRoundTrip(t, queueName(t, "tls-external"), PublisherConfig{URI: uri}, SubscriberConfig{URI: uri})
	})
}

// TestTLSFailsLoudly: a wrong CA, a wrong server name or the plain port behind an amqps
// URI fail the connection with the TLS error, never the password, and never fall
// back to plain AMQP (the plain port would have taken it).
func TestTLSFailsLoudly(t *testing.T) {
	env := tlstest.Get(t)
	plain := requireBroker(t)
	uri, secret := tlstest.WithPassword(t, env.URI)
	pu, _ := url.Parse(plain)
	wrongName := env.Config(t)
	wrongName.ServerName = "wrong.invalid"
	unknownCA := func(err error) bool {
		var e x509.UnknownAuthorityError
		return errors.As(err, &e) || strings.Contains(err.Error(), "certificate signed by unknown authority")
	}
	badName := func(err error) bool {
		var e x509.HostnameError
		return errors.As(err, &e) || strings.Contains(err.Error(), "wrong.invalid")
	}
	notTLS := func(err error) bool {
		var e tls.RecordHeaderError
		return errors.As(err, &e) || strings.Contains(err.Error(), "does not look like a TLS handshake")
	}
	for _, tc := range []struct {
		name string
		uri  string
		tls  *tls.Config
		want func(error) bool
	}{
		{"wrong CA in TLSConfig", uri, env.WrongCA(t), unknownCA},
		{"wrong CA in the URI", tlstest.WithQuery(t, uri, "cacertfile", env.File("wrongca.pem")), nil, unknownCA},
		{"system roots only", uri, nil, unknownCA},
		{"wrong server name", uri, wrongName, badName},
		{"wrong server name in the URI", tlstest.WithQuery(t, uri, "cacertfile", env.File("ca.pem"), "server_name_indication", "wrong.invalid"), nil, badName},
		{"amqps to the plain port", tlstest.WithPort(t, uri, pu.Port()), env.Config(t), notTLS},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pub, err := NewPublisher(PublisherConfig{URI: tc.uri, TLSConfig: tc.tls}, testLogger())
			if err != nil {
				t.Fatal(err)
			}
			defer pub.Close()
			err = pub.Publish(queueName(t, "tls-never"), message.NewMessage(watermill.NewUUID(), nil))
			switch {
			case err == nil:
				t.Fatal("published; want a TLS failure")
			case strings.Contains(err.Error(), secret):
				t.Errorf("the error shows the password: %v", err)
			case !tc.want(err):
				t.Errorf("%v; want the TLS failure", err)
			}

			sub, err := NewSubscriber(SubscriberConfig{URI: tc.uri, TLSConfig: tc.tls, Queue: QueueConfig{NoDeclare: true}}, testLogger())
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_, err = sub.Subscribe(ctx, queueName(t, "tls-never-sub"))
			switch {
			case err == nil:
				t.Fatal("subscribed; want a TLS failure")
			case strings.Contains(err.Error(), secret):
				t.Errorf("the subscriber's error shows the password: %v", err)
			case !tc.want(err):
				t.Errorf("subscribe: %v; want the TLS failure", err)
			}
		})
	}
}

// TestParseURITLSQuery: amqp091-go's TLS query parameters, read without a broker.
func TestParseURITLSQuery(t *testing.T) {
	const secret = "s3cr3t-tls"
	dir := t.TempDir()
	notPEM := dir + "/not.pem"
	if err := os.WriteFile(notPEM, []byte("nothing"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := "amqps://u:" + secret + "@broker.example/"
	e, err := parseURI(base+"?server_name_indication=other.example&auth_mechanism=EXTERNAL", nil)
	if err != nil {
		t.Fatal(err)
	}
	if e.tls.ServerName != "other.example" || !e.external || e.connOptions("c").SASLType == nil {
		t.Errorf("server name %q, external %v", e.tls.ServerName, e.external)
	}
	// A TLSConfig given wins over the URI's parameters, as in amqp091-go.
	e, err = parseURI(base+"?cacertfile="+dir+"/missing.pem", &tls.Config{ServerName: "given.example"})
	if err != nil || e.tls.ServerName != "given.example" {
		t.Errorf("with TLSConfig: %v, server name %q", err, e.tls.ServerName)
	}
	for _, tc := range []struct{ query, want string }{
		{"cacertfile=" + dir + "/missing.pem", "cacertfile"},
		{"cacertfile=" + notPEM, "no PEM certificate"},
		{"certfile=" + notPEM, "give both or neither"},
		{"certfile=" + notPEM + "&keyfile=" + notPEM, "certfile and keyfile"},
		{"auth_mechanism=kerberos", "want plain or external"},
	} {
		_, err := parseURI(base+"?"+tc.query, nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), secret) {
			t.Errorf("%s: %v; want an error about %s, without the password", tc.query, err, tc.want)
		}
	}
}
