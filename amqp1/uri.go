package amqp1

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"

	amqp "github.com/Azure/go-amqp"
)

// endpoint is a parsed broker URI: what to dial and how, with the credentials kept out
// of every string that can reach a log or an error.
type endpoint struct {
	addr     string // scheme://host:port, without user information
	redacted string // the URI with the password replaced by "xxxxx", for logs
	vhost    string
	user     string
	password string
	tls      *tls.Config
	external bool // SASL EXTERNAL: the broker logs the client certificate in
}

// parseURI reads amqp://user:password@host:port/vhost (or amqps://). The vhost is the
// path without its leading slash, percent-decoded; an empty path or "/" is the default
// vhost "/". It reads amqp091-go's TLS query parameters, so that one URI serves both
// transports: cacertfile, certfile and keyfile (PEM files: the CA to trust instead of
// the system's, the client certificate and its key), server_name_indication, used
// only when tlsConfig is nil, and auth_mechanism (plain or external: SASL EXTERNAL
// with the client certificate). Errors never contain the URI.
func parseURI(uri string, tlsConfig *tls.Config) (endpoint, error) {
	if uri == "" {
		return endpoint{}, errors.New("URI is empty")
	}
	u, err := url.Parse(uri)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // url.Error repeats the whole URI, password included
		}
		return endpoint{}, fmt.Errorf("URI is not a valid URL: %v", err)
	}
	var defaultPort string
	switch u.Scheme {
	case "amqp":
		defaultPort = "5672"
	case "amqps":
		defaultPort = "5671"
	default:
		return endpoint{}, fmt.Errorf("URI scheme %q is not amqp or amqps", u.Scheme)
	}
	host := u.Hostname()
	if host == "" {
		return endpoint{}, errors.New("URI has no host")
	}
	port := u.Port()
	if port == "" {
		port = defaultPort
	}
	vhost := "/"
	if p := u.Path; p != "" && p != "/" {
		vhost = p[1:]
	}
	e := endpoint{
		addr:     u.Scheme + "://" + net.JoinHostPort(host, port),
		redacted: u.Redacted(),
		vhost:    vhost,
	}
	if u.User != nil {
		e.user = u.User.Username()
		e.password, _ = u.User.Password()
	}
	q := u.Query()
	switch m := strings.ToLower(q.Get("auth_mechanism")); m {
	case "", "plain":
	case "external":
		e.external = true
	default:
		return endpoint{}, fmt.Errorf("URI auth_mechanism %q: want plain or external", m)
	}
	if u.Scheme == "amqps" {
		if tlsConfig != nil {
			e.tls = tlsConfig.Clone()
		} else if e.tls, err = tlsFromQuery(q); err != nil {
			return endpoint{}, err
		}
		// go-amqp would otherwise take the TLS server name from the AMQP hostname
		// field, which carries "vhost:<name>" for RabbitMQ.
		if e.tls.ServerName == "" {
			e.tls.ServerName = host
		}
	}
	return e, nil
}

// tlsFromQuery is the TLS configuration amqp091-go builds from the same parameters.
func tlsFromQuery(q url.Values) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: q.Get("server_name_indication")}
	if f := q.Get("cacertfile"); f != "" {
		pem, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("URI cacertfile: %w", err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("URI cacertfile %s: no PEM certificate in it", f)
		}
	}
	certFile, keyFile := q.Get("certfile"), q.Get("keyfile")
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("URI certfile and keyfile: give both or neither")
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("URI certfile and keyfile: %w", err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}

// connOptions are the go-amqp options for this endpoint. RabbitMQ selects the virtual
// host from the open frame's hostname field, "vhost:<name>".
func (e endpoint) connOptions(containerID string) *amqp.ConnOptions {
	opts := &amqp.ConnOptions{
		ContainerID: containerID,
		HostName:    "vhost:" + e.vhost,
		TLSConfig:   e.tls,
		SASLType:    amqp.SASLTypeAnonymous(),
	}
	switch {
	case e.external:
		opts.SASLType = amqp.SASLTypeExternal("")
	case e.user != "":
		opts.SASLType = amqp.SASLTypePlain(e.user, e.password)
	}
	return opts
}
