package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/console"
	"github.com/amqpretry/amqpretry/ops"
)

// consoleTokenEnv names the environment variable that may have the console's token.
const consoleTokenEnv = "AMQPRETRY_CONSOLE_TOKEN"

// consoleWindow is the console's default --window: a listing reads (takes and gives
// back) at most this many messages, one basic.get each: on a poison queue of 100,000,
// 1,000 open the page in about a second, 10,000 in 20 to 40 (measured on RabbitMQ
// 3.10.8 by BenchmarkConsolePoisonFirstPage).
const consoleWindow = 1000

// defaultListen is the console's address: loopback and a fixed port.
const defaultListen = "127.0.0.1:7433"

func (a *app) consoleCmd() *cobra.Command {
	var (
		listen, tlsCert, tlsKey string
		insecure, readOnly      bool
		hosts, queues           []string
		limit, window           = 100, consoleWindow
		src                     countsSource
	)
	c := &cobra.Command{
		Use:   "console",
		Short: "Serve the operator's console: a web page on status, the poison and parking queues, the waiting retries and the blocked keys",
		Long: `console serves a web page for the backend, prefix and work queues (--queue) the common
flags name: an overview (what status shows, and the blocked order keys when there are
any, refreshed every 10 s), the poison and parking queues (grouped by error, filters,
each message's envelope, headers and payload; redrive and purge), the waiting retries
of each work queue (a chart of their due times; retry now and purge), and the blocked
order keys (what waits behind each, its poisoned head; release, or redrive the head
and then release). Every move shows its dry run and asks for confirmation.
See docs/console.md.

It listens on --listen, 127.0.0.1:7433 by default, and prints one line with the URL to
open: it carries a random access token (256 bits), or the one in $` + consoleTokenEnv + `
(22 characters at least). Any address but loopback needs --tls-cert and --tls-key, or
--insecure-no-tls; an unspecified address (0.0.0.0, [::]) needs --host, the name
browsers use: the console refuses any other Host or Origin. --read-only shows no action
and refuses every POST. Each move is logged on stderr as one audit line.

The waiting retries are read, and the blocked keys listed, with rabbitmqctl
(--rabbitmqctl, as for status); without it the console shows the rest.

` + exitHelp,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			token := os.Getenv(consoleTokenEnv)
			if token == "" {
				token = console.NewToken()
			} else if len(token) < console.MinTokenLen {
				return usagef("$%s: the token has %d characters, want at least %d (for example: openssl rand -hex 32)", consoleTokenEnv, len(token), console.MinTokenLen)
			}
			host, _, err := net.SplitHostPort(listen)
			if err != nil {
				return usagef("--listen: want host:port, such as %s, got %q", defaultListen, listen)
			}
			if (tlsCert == "") != (tlsKey == "") {
				return usagef("--tls-cert and --tls-key go together")
			}
			ip := net.ParseIP(host)
			loopback := host == "localhost" || (ip != nil && ip.IsLoopback())
			if !loopback && tlsCert == "" && !insecure {
				return usagef("--listen %s: an address other than loopback needs TLS (--tls-cert, --tls-key), or --insecure-no-tls to serve the token and the broker's data in clear text", listen)
			}
			if (host == "" || (ip != nil && ip.IsUnspecified())) && len(hosts) == 0 {
				return usagef("--listen %s: name the host browsers will use with --host (the console refuses any other Host, which stops DNS rebinding)", listen)
			}
			counts, _, err := src.counts(a.uri)
			if err != nil {
				return err
			}
			cfg, err := a.retryConfig()
			if err != nil {
				return err
			}
			var ctl ctlRunner
			if src.mgmt == "" {
				ctl = src.ctlRunner(a.uri)
			}
			var certs []tls.Certificate
			if tlsCert != "" {
				cert, err := tls.LoadX509KeyPair(tlsCert, tlsKey)
				if err != nil {
					return usagef("--tls-cert, --tls-key: %v", err)
				}
				certs = []tls.Certificate{cert}
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return fmt.Errorf("console: listen on %s: %w (is another console running? pick another --listen)", listen, err)
			}
			defer ln.Close()
			_, port, _ := net.SplitHostPort(ln.Addr().String()) // for port 0, the one given
			scheme := "http"
			if certs != nil {
				scheme = "https"
				ln = tls.NewListener(ln, &tls.Config{Certificates: certs, MinVersion: tls.VersionTLS12})
			}
			allowed := []string{net.JoinHostPort(host, port)}
			if loopback {
				allowed = append(allowed, net.JoinHostPort("localhost", port), net.JoinHostPort("127.0.0.1", port), net.JoinHostPort("::1", port))
			}
			for _, h := range hosts {
				allowed = append(allowed, net.JoinHostPort(h, port))
			}
			srv, err := console.New(console.Config{
				Open: func() (console.Broker, error) {
					o, _, err := a.openWith(ctl)
					return o, err
				},
				Token: token, ReadOnly: readOnly, Hosts: allowed, Scheme: scheme,
				Status:  ops.StatusOptions{WorkQueues: queues, Counts: counts},
				Parking: ops.HasParking(cfg), Waiting: ctl != nil, Blocked: ctl != nil, BehindQueues: ops.BehindQueues(cfg),
				Limit: limit, Window: window,
				Title:    fmt.Sprintf("%s, backend %s, prefix %s", redactURI(a.uri), cfg.Backend, cfg.Prefix),
				Describe: func(f ops.Flag, s ops.Status) string { return a.describe(f, s, cfg, queues) },
				Hidden:   func(k string) bool { return shown[k] },
				Redact:   a.redact,
				Audit:    a.stderr,
			})
			if err != nil {
				return err
			}
			defer srv.Close()
			start := url.URL{Scheme: scheme, Host: allowed[0], Path: "/", RawQuery: url.Values{"token": {token}}.Encode()}
			if len(hosts) > 0 {
				start.Host = net.JoinHostPort(hosts[0], port)
			}
			mode := ""
			if readOnly {
				mode = " (read-only)"
			}
			fmt.Fprintf(a.stdout, "amqpretry console%s: open %s\n", mode, start.String())
			// Requests run under the command's context: Ctrl-C stops a move between two
			// messages, as in the CLI.
			hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second,
				BaseContext: func(net.Listener) context.Context { return a.ctx }}
			done := make(chan error, 1)
			go func() { done <- hs.Serve(ln) }()
			select {
			case err := <-done:
				return fmt.Errorf("console: serve on %s: %w", listen, err)
			case <-a.ctx.Done():
			}
			shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := hs.Shutdown(shut); err != nil && !errors.Is(err, context.DeadlineExceeded) {
				return fmt.Errorf("console: shut down: %w", err)
			}
			return nil // stopped by Ctrl-C or SIGTERM: its normal end
		},
	}
	f := c.Flags()
	f.StringVar(&listen, "listen", defaultListen, "address to serve on, host:port (any host but loopback needs TLS or --insecure-no-tls)")
	f.StringVar(&tlsCert, "tls-cert", "", "serve HTTPS with this certificate (PEM)")
	f.StringVar(&tlsKey, "tls-key", "", "the certificate's private key (PEM)")
	f.BoolVar(&insecure, "insecure-no-tls", false, "UNSAFE: serve plain HTTP on an address other than loopback (the token and the broker's data cross the network in clear text)")
	f.StringArrayVar(&hosts, "host", nil, "a host name browsers use to reach the console (repeat for more); the start URL uses the first")
	f.BoolVar(&readOnly, "read-only", false, "show no action, refuse every POST")
	f.StringArrayVar(&queues, "queue", nil, "a work queue to show (its waiting retries; repeat for more)")
	f.Var(boundedInt{&limit, 1}, "limit", "messages per page")
	f.Var(boundedInt{&window, 1}, "window", "at most this many messages read (kept unacked) per listing or move")
	src.flags(c)
	return c
}
