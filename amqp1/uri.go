package amqp1

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"

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
}

// parseURI reads amqp://user:password@host:port/vhost (or amqps://). The vhost is the
// path without its leading slash, percent-decoded; an empty path or "/" is the default
// vhost "/". Errors never contain the URI.
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
	if u.Scheme == "amqps" {
		if tlsConfig != nil {
			e.tls = tlsConfig.Clone()
		} else {
			e.tls = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		// go-amqp would otherwise take the TLS server name from the AMQP hostname
		// field, which carries "vhost:<name>" for RabbitMQ.
		if e.tls.ServerName == "" {
			e.tls.ServerName = host
		}
	}
	return e, nil
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
	if e.user != "" {
		opts.SASLType = amqp.SASLTypePlain(e.user, e.password)
	}
	return opts
}
