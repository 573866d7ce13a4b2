// Package tlstest gives the TLS tests a broker's TLS listener and the certificates of
// scripts/tls.sh. They run where AMQPS_URI (the amqps URI of the broker under test,
// without query parameters) and AMQPRETRY_TLS_DIR (the directory scripts/tls.sh prints)
// are both set, as scripts/test.sh sets them in its TLS steps, and skip elsewhere,
// saying so.
package tlstest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

// The environment of the TLS tests.
const (
	URIEnv     = "AMQPS_URI"
	DirEnv     = "AMQPRETRY_TLS_DIR"
	ClusterEnv = "AMQPRETRY_TLS_CLUSTER" // the cluster's TLS nodes, host:port,host:port,...
)

// Env is a broker's TLS listener and the test certificates.
type Env struct {
	URI string // amqps://guest:guest@localhost:PORT/ (AMQPS_URI)
	Dir string
}

// Get returns the TLS environment, or skips t when it is not set.
func Get(t testing.TB) Env {
	t.Helper()
	e := Env{URI: os.Getenv(URIEnv), Dir: os.Getenv(DirEnv)}
	if e.URI == "" || e.Dir == "" {
		t.Skipf("TLS tests skipped: set %s (the broker's amqps URI) and %s (the certificates of scripts/tls.sh certs); scripts/test.sh does in its TLS steps", URIEnv, DirEnv)
	}
	for _, f := range []string{"ca.pem", "wrongca.pem", "ca.key"} {
		if _, err := os.Stat(e.File(f)); err != nil {
			t.Fatalf("%s: %v (make the certificates with scripts/tls.sh certs)", DirEnv, err)
		}
	}
	return e
}

// File is the path of a file of the certificate directory.
func (e Env) File(name string) string { return filepath.Join(e.Dir, name) }

// Pool returns the certificates of the PEM file name as a pool.
func (e Env) Pool(t testing.TB, name string) *x509.CertPool {
	t.Helper()
	data, err := os.ReadFile(e.File(name))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		t.Fatalf("%s: no certificate", e.File(name))
	}
	return pool
}

// Config trusts the test CA only.
func (e Env) Config(t testing.TB) *tls.Config {
	return &tls.Config{RootCAs: e.Pool(t, "ca.pem"), MinVersion: tls.VersionTLS12}
}

// WrongCA trusts only a CA that signed nothing the broker presents.
func (e Env) WrongCA(t testing.TB) *tls.Config {
	return &tls.Config{RootCAs: e.Pool(t, "wrongca.pem"), MinVersion: tls.VersionTLS12}
}

// WithQuery returns uri with the query parameters kv (name, value, ...) added: the
// amqp091-go ones (cacertfile, certfile, keyfile, server_name_indication,
// auth_mechanism), which module amqp1 reads too.
func WithQuery(t testing.TB, uri string, kv ...string) string {
	t.Helper()
	u, err := url.Parse(uri)
	if err != nil {
		t.Fatal("unparseable URI")
	}
	q := u.Query()
	for i := 0; i+1 < len(kv); i += 2 {
		q.Add(kv[i], kv[i+1])
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// WithPassword returns uri with its password replaced by one of the test's own, to
// look for in errors.
func WithPassword(t testing.TB, uri string) (string, string) {
	t.Helper()
	u, err := url.Parse(uri)
	if err != nil {
		t.Fatal("unparseable URI")
	}
	secret := "tls-secret-" + randHex(t, 6)
	u.User = url.UserPassword(u.User.Username(), secret)
	return u.String(), secret
}

// WithPort returns uri on another port of the same host.
func WithPort(t testing.TB, uri, port string) string {
	t.Helper()
	u, err := url.Parse(uri)
	if err != nil {
		t.Fatal("unparseable URI")
	}
	u.Host = u.Hostname() + ":" + port
	return u.String()
}

// Client is a client certificate for SASL EXTERNAL: its common name is the user the
// broker logs it in as (ssl_cert_login_from = common_name).
type Client struct {
	User              string
	CertFile, KeyFile string
	Cert              tls.Certificate
}

// ClientCert signs a client certificate with the test CA (or, wrong, with the wrong
// CA) for a user of the test's own, and, unless wrong, creates that user on the broker
// under test (no password; all permissions on vhost /) through rabbitmqctl
// (AMQPRETRY_RABBITMQCTL, which must reach the broker at AMQP_URI), deleting it when
// the test ends.
func (e Env) ClientCert(t testing.TB, wrong bool) Client {
	t.Helper()
	ca := "ca"
	if wrong {
		ca = "wrongca"
	}
	caCert, caKey := e.loadCA(t, ca)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	user := "amqpretry-tls-test-" + randHex(t, 6)
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: user},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	c := Client{User: user, CertFile: filepath.Join(dir, "client.pem"), KeyFile: filepath.Join(dir, "client.key")}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	if err := os.WriteFile(c.CertFile, certPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(c.KeyFile, keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if c.Cert, err = tls.X509KeyPair(certPEM, keyPEM); err != nil {
		t.Fatal(err)
	}
	if wrong {
		return c
	}
	ctx := context.Background()
	// A user without a password: it can log in with a certificate only.
	if out, err := brokertest.Ctl(ctx, "add_user", user, randHex(t, 16)); err != nil {
		t.Fatalf("creating the EXTERNAL user: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		if out, err := brokertest.Ctl(context.Background(), "delete_user", user); err != nil {
			t.Errorf("deleting user %s: %v\n%s", user, err, out)
		}
	})
	if out, err := brokertest.Ctl(ctx, "clear_password", user); err != nil {
		t.Fatalf("clearing the EXTERNAL user's password: %v\n%s", err, out)
	}
	if out, err := brokertest.Ctl(ctx, "set_permissions", "-p", "/", user, ".*", ".*", ".*"); err != nil {
		t.Fatalf("permissions of the EXTERNAL user: %v\n%s", err, out)
	}
	return c
}

func (e Env) loadCA(t testing.TB, name string) (*x509.Certificate, any) {
	t.Helper()
	certPEM, err := os.ReadFile(e.File(name + ".pem"))
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := os.ReadFile(e.File(name + ".key"))
	if err != nil {
		t.Fatalf("%v (the tests sign client certificates with the CA's key: run them as its owner)", err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	return cert, pair.PrivateKey
}

func randHex(t testing.TB, n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
