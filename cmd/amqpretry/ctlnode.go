package main

import (
	"bufio"
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// mayFind tells whether the node of the URI may be looked for (findNode) when the
// rabbitmqctl command words reaches another: for --rabbitmqctl auto, and for a command
// given that is rabbitmqctl naming no node (no -n or --node); never for another
// command (a wrapper), which may not take -n.
func mayFind(words []string, explicit bool) bool {
	if !explicit {
		return true
	}
	if filepath.Base(words[0]) != "rabbitmqctl" {
		return false
	}
	return !slices.ContainsFunc(words[1:], func(w string) bool {
		return w == "-n" || w == "--node" || strings.HasPrefix(w, "-n") || strings.HasPrefix(w, "--node=")
	})
}

// maxNodeTries bounds the nodes findNode asks (each a rabbitmqctl run of a few seconds).
const maxNodeTries = 3

// findNode looks for the node of this host whose AMQP listener is the URI's port, when
// words (rabbitmqctl on PATH) reaches another one, reached ("" if none): the broker at
// the URI names itself (its cluster_name, a node name unless configured otherwise), and
// this host's epmd lists the names of the nodes it runs. It asks, with `words -n
// name@host`, each node of a name the broker gives (or, when it gives none, each other
// node epmd lists), at most maxNodeTries, which one listens on the URI's port: only
// that question (ctlNode) runs on a node before it is known to be the URI's. It returns
// the command that reaches that node and its name, or nil and the nodes it asked.
func findNode(ctx context.Context, words []string, uri, reached string, timeout time.Duration) (found []string, node string, tried []string) {
	u, err := amqp.ParseURI(uri)
	if err != nil {
		return nil, "", nil
	}
	reachedName, reachedHost, _ := strings.Cut(reached, "@")
	hintName, hintHost := "", ""
	if name := clusterName(uri); strings.Contains(name, "@") {
		hintName, hintHost, _ = strings.Cut(name, "@")
	}
	names, err := epmdNames(ctx, u.Host)
	switch {
	case err != nil && hintName == "":
		return nil, "", nil
	case err != nil:
		names = []string{hintName}
	case hintName != "":
		// The broker names itself: only that node, if this host runs it.
		if !slices.Contains(names, hintName) {
			return nil, "", nil
		}
		names = []string{hintName}
	}
	// The host part of a node name is as it was started: that of the node rabbitmqctl
	// reaches, this host's name, localhost, the broker's own.
	var hosts []string
	short, _ := os.Hostname()
	short, _, _ = strings.Cut(short, ".")
	for _, h := range []string{reachedHost, short, "localhost", hintHost} {
		if h != "" && !slices.Contains(hosts, h) {
			hosts = append(hosts, h)
		}
	}
	for _, name := range names {
		if name == reachedName { // epmd names are unique on a host: that one was asked
			continue
		}
		for _, host := range hosts {
			if len(tried) == maxNodeTries || ctx.Err() != nil {
				return nil, "", tried
			}
			cand := name + "@" + host
			tried = append(tried, cand)
			with := append(slices.Clone(words), "-n", cand)
			if got, ports, err := ctlNode(ctx, with, timeout); err == nil && slices.Contains(ports, u.Port) {
				return with, got, tried
			}
		}
	}
	return nil, "", tried
}

// clusterName is the cluster_name the broker at uri announces when a client connects
// (RabbitMQ: the name of its first node unless configured), or "".
func clusterName(uri string) string {
	c, err := amqp.DialConfig(uri, amqp.Config{Dial: amqp.DefaultDial(10 * time.Second)})
	if err != nil {
		return ""
	}
	defer func() { _ = c.Close() }()
	name, _ := c.Properties["cluster_name"].(string)
	return name
}

// epmdNames lists the names of the Erlang nodes registered with the epmd of host (its
// port ERL_EPMD_PORT, or 4369): the NAMES_REQ of the epmd protocol, which reads nothing
// else.
func epmdNames(ctx context.Context, host string) ([]string, error) {
	port := os.Getenv("ERL_EPMD_PORT")
	if port == "" {
		port = "4369"
	}
	bounded, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := (&net.Dialer{}).DialContext(bounded, "tcp", net.JoinHostPort(host, port))
	if err != nil {
		return nil, err
	}
	defer func() { _ = conn.Close() }()
	if deadline, ok := bounded.Deadline(); ok {
		_ = conn.SetDeadline(deadline)
	}
	if _, err := conn.Write([]byte{0, 1, 110}); err != nil { // length 1, NAMES_REQ
		return nil, err
	}
	r := bufio.NewReader(conn)
	if _, err := io.ReadFull(r, make([]byte, 4)); err != nil { // epmd's own port
		return nil, err
	}
	var names []string
	for {
		line, err := r.ReadString('\n')
		// "name h2 at port 25702"
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "name" {
			names = append(names, f[1])
		}
		if err == io.EOF {
			return names, nil
		}
		if err != nil {
			return names, err
		}
	}
}
