package amqpretry_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/testsupport/tlstest"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// TestTLSRetry: a retry through the broker over amqps, the subscriber, the library's
// hand-off and the publisher sharing one tls.Config that names no server (amqp091-go
// fills ServerName in; the race detector watches).
func TestTLSRetry(t *testing.T) {
	env := tlstest.Get(t)
	tlsCfg := env.Config(t)
	prefix := brokertest.Prefix(t)
	topic := prefix + ".work"
	amqpCfg := amqp3.NewDurableQueueConfig(env.URI)
	amqpCfg.Connection.TLSConfig = tlsCfg
	cfg := amqpretry.Config{
		Prefix: prefix, Backend: delay.TTLTiers(time.Second),
		Policy: amqpretry.Policy{MaxAttempts: 3, Delays: amqpretry.Exponential(time.Second, 2, 10*time.Minute), Jitter: -1},
	}
	plan, err := cfg.Plan(topic)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, plan)
	brokertest.Cleanup(t, []string{topic}, nil)

	retry, err := wamqp3.New(amqpCfg, cfg)
	if err != nil {
		t.Fatalf("wamqp3.New over amqps: %v", err)
	}
	t.Cleanup(func() { _ = retry.Close() })
	pub, err := amqp3.NewPublisher(amqpCfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var attempts atomic.Int32
	handled := make(chan struct{})
	var once sync.Once
	if _, err := retry.AddHandler(router, "tls", topic, func(*message.Message) error {
		if attempts.Add(1) == 1 {
			return errors.New("fails once")
		}
		once.Do(func() { close(handled) })
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	go func() { _ = router.Run(context.Background()) }()
	t.Cleanup(func() { _ = router.Close() })
	<-router.Running()
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("over tls"))); err != nil {
		t.Fatal(err)
	}
	select {
	case <-handled:
	case <-time.After(60 * time.Second):
		t.Fatalf("not handled within 60 s over amqps (%d attempts)", attempts.Load())
	}
	if n := attempts.Load(); n != 2 {
		t.Errorf("attempts = %d, want 2 (one failure, one retry through the delay queue)", n)
	}
}

// TestTLSFailsLoudly: a wrong CA, a wrong server name or a plain AMQP port behind an
// amqps URI fail every way of connecting, with the TLS error and never the password,
// and nothing falls back to plain TCP (the broker's plain port would have accepted it).
func TestTLSFailsLoudly(t *testing.T) {
	env := tlstest.Get(t)
	uri, secret := tlstest.WithPassword(t, env.URI)
	u, _ := url.Parse(brokertest.URI())
	plainPort := u.Port()
	if plainPort == "" {
		plainPort = "5672"
	}
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
	cases := []struct {
		name string
		uri  string
		tls  *tls.Config
		want func(error) bool
	}{
		{"wrong CA in tls.Config", uri, env.WrongCA(t), unknownCA},
		{"wrong CA in the URI", tlstest.WithQuery(t, uri, "cacertfile", env.File("wrongca.pem")), nil, unknownCA},
		{"system roots only", uri, nil, unknownCA},
		{"wrong server name in tls.Config", uri, wrongName, badName},
		{"wrong server name in the URI", tlstest.WithQuery(t, uri, "cacertfile", env.File("ca.pem"), "server_name_indication", "wrong.invalid"), nil, badName},
		{"amqps to the plain AMQP port", tlstest.WithPort(t, uri, plainPort), env.Config(t), notTLS},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			check := func(what string, err error) {
				t.Helper()
				switch {
				case err == nil:
					t.Fatalf("%s: connected; want a TLS failure", what)
				case strings.Contains(err.Error(), secret):
					t.Errorf("%s: the error shows the password: %v", what, err)
				case !tc.want(err):
					t.Errorf("%s: %v; want the TLS failure", what, err)
				}
			}
			conn, err := amqp.DialConfig(tc.uri, amqp.Config{TLSClientConfig: tc.tls})
			if err == nil {
				_ = conn.Close()
			}
			check("amqp091-go", err)

			// Every log line, at every level, is checked for the password too.
			var logs bytes.Buffer
			logger := watermill.NewStdLoggerWithOut(&logs, true, true)
			amqpCfg := amqp3.NewDurableQueueConfig(tc.uri)
			amqpCfg.Connection.TLSConfig = tc.tls
			retry, err := wamqp3.New(amqpCfg, amqpretry.Config{Prefix: brokertest.Prefix(t), Logger: logger})
			if err == nil {
				_ = retry.Close()
			}
			check("wamqp3.New", err)

			o, err := ops.New(ops.Config{URI: tc.uri, AMQP: amqp.Config{TLSClientConfig: tc.tls}, Logger: logger})
			if err == nil {
				_ = o.Close()
			}
			check("ops.New", err)
			if strings.Contains(logs.String(), secret) {
				t.Errorf("a log line shows the password:\n%s", logs.String())
			}
		})
	}
}

// TestTLSExternal: a client certificate logs in with SASL EXTERNAL (plugin
// rabbitmq_auth_mechanism_ssl) as the user its common name names, given in code or in
// the URI; one the broker's CA did not sign is refused.
func TestTLSExternal(t *testing.T) {
	env := tlstest.Get(t)
	client := env.ClientCert(t, false)
	u, _ := url.Parse(env.URI)
	noUser := "amqps://" + u.Host + "/"

	tlsCfg := env.Config(t)
	tlsCfg.Certificates = []tls.Certificate{client.Cert}
	conn, err := amqp.DialConfig(noUser, amqp.Config{SASL: []amqp.Authentication{&amqp.ExternalAuth{}}, TLSClientConfig: tlsCfg})
	if err != nil {
		t.Fatalf("EXTERNAL with a client certificate in tls.Config: %v", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare("", false, true, true, false, nil); err != nil {
		t.Fatalf("declaring a queue as %s: %v", client.User, err)
	}
	// The broker logged the certificate in as its common name, over TLS.
	out, err := brokertest.Ctl(context.Background(), "list_connections", "user", "auth_mechanism", "ssl", "--no-table-headers", "-q")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(strings.Split(string(out), "\n"), func(l string) bool {
		f := strings.Fields(l)
		return len(f) == 3 && f[0] == client.User && f[1] == "EXTERNAL" && f[2] == "true"
	}) {
		t.Errorf("no TLS connection of user %s with auth_mechanism EXTERNAL among:\n%s", client.User, out)
	}
	_ = conn.Close()

	// The same from the URI alone, through ops (what the CLI does).
	byURI := tlstest.WithQuery(t, noUser, "auth_mechanism", "external", "cacertfile", env.File("ca.pem"),
		"certfile", client.CertFile, "keyfile", client.KeyFile)
	o, err := ops.New(ops.Config{URI: byURI, Retry: amqpretry.Config{Prefix: brokertest.Prefix(t)}})
	if err != nil {
		t.Fatalf("ops.New with EXTERNAL from the URI: %v", err)
	}
	_ = o.Close()

	wrong := env.ClientCert(t, true)
	tlsCfg = env.Config(t)
	tlsCfg.Certificates = []tls.Certificate{wrong.Cert}
	conn, err = amqp.DialConfig(noUser, amqp.Config{SASL: []amqp.Authentication{&amqp.ExternalAuth{}}, TLSClientConfig: tlsCfg})
	if err == nil {
		_ = conn.Close()
		t.Fatal("a client certificate of the wrong CA logged in")
	}
}

// TestTLSCluster: Cluster() carries the TLS configuration to every node: successive
// connections reach each of the cluster's TLS listeners, all of them TLS, verified
// against the test CA; a plain node among them fails its dial, never spoken to in
// plain; with the wrong CA every node refuses.
func TestTLSCluster(t *testing.T) {
	env := tlstest.Get(t)
	nodes := strings.Split(os.Getenv(tlstest.ClusterEnv), ",")
	if nodes[0] == "" {
		t.Skipf("set %s to the cluster's TLS nodes (host:port,...); scripts/test.sh does with scripts/cluster.sh", tlstest.ClusterEnv)
	}
	u, _ := url.Parse(env.URI)
	uri := "amqps://" + u.User.String() + "@localhost/" // the nodes come from Cluster
	cluster := amqpretry.Cluster(nodes...)
	cluster.TLSClientConfig = env.Config(t)
	cluster.TLSClientConfig.ServerName = "localhost"
	seen := map[string]bool{}
	for range 2 * len(nodes) {
		conn, err := amqp.DialConfig(uri, *cluster)
		if err != nil {
			t.Fatalf("dial through Cluster over amqps: %v", err)
		}
		st := conn.ConnectionState()
		_, port, _ := net.SplitHostPort(conn.RemoteAddr().String())
		if !st.HandshakeComplete || len(st.VerifiedChains) == 0 {
			t.Errorf("connection to port %s: not a verified TLS connection", port)
		}
		seen[port] = true
		_ = conn.Close()
	}
	for _, n := range nodes {
		_, port, _ := net.SplitHostPort(n)
		if !seen[port] {
			t.Errorf("no connection reached node %s over TLS (reached %v)", n, seen)
		}
	}

	// A node that speaks plain AMQP among TLS ones: the dial that reaches it fails,
	// and never speaks plain to it.
	plain, _ := url.Parse(brokertest.URI())
	mixed := amqpretry.Cluster(nodes[0], plain.Host)
	mixed.TLSClientConfig = cluster.TLSClientConfig
	var failed, ok int
	for range 2 {
		conn, err := amqp.DialConfig(uri, *mixed)
		var e tls.RecordHeaderError
		switch {
		case err == nil:
			ok++
			_ = conn.Close()
		case errors.As(err, &e):
			failed++
		default:
			t.Errorf("dial with a plain node among the TLS ones: %v; want a TLS record error", err)
		}
	}
	if failed != 1 || ok != 1 {
		t.Errorf("with one TLS and one plain node: %d dials connected, %d failed on TLS; want 1 and 1", ok, failed)
	}

	bad := amqpretry.Cluster(nodes...)
	bad.TLSClientConfig = env.WrongCA(t)
	bad.TLSClientConfig.ServerName = "localhost"
	for range len(nodes) {
		conn, err := amqp.DialConfig(uri, *bad)
		if err == nil {
			_ = conn.Close()
			t.Fatalf("connected to %s with the wrong CA", conn.RemoteAddr())
		}
		var e x509.UnknownAuthorityError
		if !errors.As(err, &e) {
			t.Errorf("wrong CA: %v; want x509.UnknownAuthorityError", err)
		}
	}
}
