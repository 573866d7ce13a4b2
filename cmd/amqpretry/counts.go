package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/ops"
)

// countsFunc reads the broker's counts (ops.StatusOptions.Counts).
type countsFunc = func(ctx context.Context) (ops.BrokerCounts, error)

// ctlWaitDelay is how long a killed rabbitmqctl's output may stay open: past it the
// run returns even if some process it started still has the pipe open.
const ctlWaitDelay = 5 * time.Second

// rabbitmqctlCounts reads the broker's counts with the rabbitmqctl command words:
// `list_queues` for the queues of vhost, `status` for the file descriptors and
// sockets. Each run is bounded by timeout; on timeout its whole process group is
// killed (a wrapper such as scripts/rabbitmq4.sh runs rabbitmqctl in a child).
func rabbitmqctlCounts(words []string, uri string, timeout time.Duration) countsFunc {
	return ctlCounts(uri, timeout, newNodeCheck(words, uri, timeout, false))
}

// nodeCheck tells, once, which rabbitmqctl command reaches the broker at a URI: a host
// may run several brokers, and the rabbitmqctl on PATH serves one of them. It asks the
// node the command reaches its name and AMQP ports (one eval that reads nothing else)
// and refuses one that does not listen on the URI's port, so that nothing is read or
// run there; with find (--rabbitmqctl auto) it then looks for the node of this host
// that does (findNode), and uses `-n` that node. Every use of the command within one
// CLI run shares one check.
type nodeCheck struct {
	once    sync.Once
	check   func(ctx context.Context) ([]string, string, error)
	words   []string // the command that reaches the node at the URI, once checked
	reached string   // what it reached, once checked
	err     error
}

func newNodeCheck(words []string, uri string, timeout time.Duration, find bool) *nodeCheck {
	u, _ := amqp.ParseURI(uri) // one that does not parse fails to dial first
	return &nodeCheck{check: func(ctx context.Context) ([]string, string, error) {
		node, ports, err := ctlNode(ctx, words, timeout)
		if err == nil && slices.Contains(ports, u.Port) {
			return words, fmt.Sprintf("%s reaches node %s, which listens for AMQP on %d of AMQP_URI", strings.Join(words, " "), node, u.Port), nil
		}
		var tried []string
		if find && ctx.Err() == nil {
			var found []string
			var foundNode string
			found, foundNode, tried = findNode(ctx, words, uri, node, timeout)
			if found != nil {
				alone := "reaches no node"
				if err == nil {
					alone = fmt.Sprintf("reaches node %s, on %v", node, ports)
				}
				return found, fmt.Sprintf("%s reaches node %s, which listens for AMQP on %d of AMQP_URI (%s alone %s: the node was found by the URI's port)",
					strings.Join(found, " "), foundNode, u.Port, strings.Join(words, " "), alone), nil
			}
		}
		lookedFor := ""
		if find {
			lookedFor = "; no other node of this host was found listening there"
			if len(tried) > 0 {
				lookedFor = fmt.Sprintf("; nor do the nodes of this host it asked (%s)", strings.Join(tried, ", "))
			}
		}
		if err != nil {
			return nil, "", fmt.Errorf("%w%s", err, lookedFor)
		}
		return nil, "", fmt.Errorf("%s reaches node %s, which listens for AMQP on %v, not on %d of AMQP_URI: nothing was read there%s; give the rabbitmqctl command of the broker at AMQP_URI (--rabbitmqctl 'rabbitmqctl -n NODE'), or --rabbitmqctl off", strings.Join(words, " "), node, ports, u.Port, lookedFor)
	}}
}

// do runs the check the first time, and returns its verdict every time.
func (n *nodeCheck) do(ctx context.Context) error {
	n.once.Do(func() { n.words, n.reached, n.err = n.check(ctx) })
	return n.err
}

// ctlCounts is rabbitmqctlCounts, with the command check finds.
func ctlCounts(uri string, timeout time.Duration, check *nodeCheck) countsFunc {
	u, _ := amqp.ParseURI(uri)
	vhost := u.Vhost
	return func(ctx context.Context) (ops.BrokerCounts, error) {
		c := newCounts()
		if err := check.do(ctx); err != nil {
			return ops.BrokerCounts{}, err
		}
		words := check.words
		out, err := runCtl(ctx, words, timeout, "-q", "status", "--formatter", "json")
		if err != nil {
			return c, err
		}
		if _, err := ctlStatus(out, &c); err != nil {
			return c, fmt.Errorf("%s status: %w", strings.Join(words, " "), err)
		}
		out, err = runCtl(ctx, words, timeout, "-q", "list_queues", "-p", vhost, "name", "messages", "messages_ready", "messages_unacknowledged", "type", "members", "online", "--no-table-headers")
		if err != nil {
			return c, err
		}
		listQueues(out, c)
		return c, nil
	}
}

func newCounts() ops.BrokerCounts {
	return ops.BrokerCounts{Messages: map[string]int{}, Ready: map[string]int{}, Unacked: map[string]int{},
		Members: map[string]int{}, Online: map[string]int{}}
}

// listQueues reads rabbitmqctl list_queues name messages messages_ready
// messages_unacknowledged type members online (tab-separated, no headers) into c: a
// quorum queue's members and online nodes are lists ("[rabbit@a, rabbit@b]").
func listQueues(out []byte, c ops.BrokerCounts) {
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Split(strings.TrimSpace(sc.Text()), "\t")
		for len(f) < 7 && len(f) >= 5 {
			f = append(f, "") // a classic queue's empty lists, trimmed off the line
		}
		if len(f) != 7 {
			continue
		}
		n := make([]int, 3)
		ok := true
		for i := range n {
			var err error
			n[i], err = strconv.Atoi(f[i+1])
			ok = ok && err == nil
		}
		if !ok {
			continue
		}
		c.Messages[f[0]], c.Ready[f[0]], c.Unacked[f[0]] = n[0], n[1], n[2]
		if f[4] == "quorum" {
			c.Members[f[0]], c.Online[f[0]] = nodeCount(f[5]), nodeCount(f[6])
		}
	}
}

// nodeCount counts the nodes of a rabbitmqctl list: "[rabbit@a, rabbit@b]", "[]".
func nodeCount(list string) int {
	n := 0
	for _, node := range strings.Split(strings.Trim(strings.TrimSpace(list), "[]"), ",") {
		if strings.TrimSpace(node) != "" {
			n++
		}
	}
	return n
}

// ctlStatus reads the file descriptors and sockets from rabbitmqctl status JSON: its
// file_descriptors (RabbitMQ 3.x), or, where RabbitMQ no longer counts them (4.0+),
// /proc/<pid> of the broker when this host can see it. It returns the node's AMQP
// ports.
func ctlStatus(out []byte, c *ops.BrokerCounts) (ports []int, err error) {
	if i := bytes.IndexByte(out, '{'); i > 0 {
		out = out[i:] // past any warning printed before the document
	}
	var st struct {
		Listeners []struct {
			Port     int    `json:"port"`
			Protocol string `json:"protocol"`
		} `json:"listeners"`
		PID any `json:"pid"`
		FD  *struct {
			TotalUsed    int `json:"total_used"`
			TotalLimit   int `json:"total_limit"`
			SocketsUsed  int `json:"sockets_used"`
			SocketsLimit int `json:"sockets_limit"`
		} `json:"file_descriptors"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		return nil, err
	}
	for _, l := range st.Listeners {
		if l.Protocol == "amqp" || l.Protocol == "amqp/ssl" {
			ports = append(ports, l.Port)
		}
	}
	if st.FD != nil && st.FD.TotalUsed > 0 {
		c.FileDescriptors, c.FileDescriptorLimit = st.FD.TotalUsed, st.FD.TotalLimit
		c.Sockets, c.SocketLimit = st.FD.SocketsUsed, st.FD.SocketsLimit
		return ports, nil
	}
	// 4.0 prints the section with 0 used (it no longer counts them), 4.3 omits it.
	if pid, err := strconv.Atoi(strings.Trim(fmt.Sprint(st.PID), `"`)); err == nil && pid > 0 {
		procFDs(pid, c) // else unknown: the limits stay 0
	}
	return ports, nil
}

// procFDs counts the open files and sockets of process pid and reads its soft limit of
// open files, when /proc shows them; otherwise it leaves c as it is.
func procFDs(pid int, c *ops.BrokerCounts) {
	dir := filepath.Join("/proc", strconv.Itoa(pid))
	entries, err := os.ReadDir(filepath.Join(dir, "fd"))
	if err != nil {
		return
	}
	limits, err := os.ReadFile(filepath.Join(dir, "limits"))
	if err != nil {
		return
	}
	for _, line := range strings.Split(string(limits), "\n") {
		if f := strings.Fields(strings.TrimPrefix(line, "Max open files")); strings.HasPrefix(line, "Max open files") && len(f) > 0 {
			c.FileDescriptorLimit, _ = strconv.Atoi(f[0])
		}
	}
	c.FileDescriptors = len(entries)
	for _, e := range entries {
		if link, err := os.Readlink(filepath.Join(dir, "fd", e.Name())); err == nil && strings.HasPrefix(link, "socket:") {
			c.Sockets++
		}
	}
}

// nodeQuery asks the node rabbitmqctl reaches for its name and AMQP ports, and nothing
// else: {Node, [Port...]}. The same on RabbitMQ 3.10 to 4.3.
const nodeQuery = `{node(), [element(6, L) || L <- rabbit_networking:node_listeners(node()), lists:member(element(3, L), [amqp, 'amqp/ssl'])]}.`

// nodeAnswer reads nodeQuery's answer: {rabbit@host,[5672,5671]}.
var nodeAnswer = regexp.MustCompile(`\{'?([^,'{}]+)'?,\[([0-9, ]*)\]\}`)

// ctlNode returns the name and AMQP ports of the node words reaches.
func ctlNode(ctx context.Context, words []string, timeout time.Duration) (node string, ports []int, err error) {
	out, err := runCtl(ctx, words, timeout, "-q", "eval", nodeQuery)
	if err != nil {
		return "", nil, err
	}
	m := nodeAnswer.FindSubmatch(out)
	if m == nil {
		return "", nil, fmt.Errorf("%s eval: cannot tell which node it reaches from %q", strings.Join(words, " "), bytes.TrimSpace(out))
	}
	for _, p := range strings.Split(string(m[2]), ",") {
		if n, err := strconv.Atoi(strings.TrimSpace(p)); err == nil {
			ports = append(ports, n)
		}
	}
	return string(m[1]), ports, nil
}

// runCtl runs words plus args, bounded by timeout.
func runCtl(ctx context.Context, words []string, timeout time.Duration, args ...string) ([]byte, error) {
	bounded, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(bounded, words[0], append(words[1:len(words):len(words)], args...)...)
	killProcessGroup(cmd)
	cmd.WaitDelay = ctlWaitDelay
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	start := time.Now()
	out, err := cmd.Output()
	if err == nil {
		return out, nil
	}
	name := strings.Join(words, " ") + " " + strings.Join(args, " ")
	if bounded.Err() != nil && ctx.Err() == nil {
		return out, fmt.Errorf("%s: no answer within %s (--ctl-timeout), killed after %s", name, timeout, time.Since(start).Round(time.Millisecond))
	}
	if ctx.Err() != nil {
		return out, ctx.Err()
	}
	msg := strings.TrimSpace(stderr.String())
	if len(msg) > 300 {
		msg = msg[:300] + "…"
	}
	return out, fmt.Errorf("%s: %w: %s", name, err, msg)
}

// managementCounts reads the broker's counts from the management API at base, with
// the user and password of uri (HTTP basic authentication; never in the URL or in
// errors): GET /api/queues/<vhost> and /api/nodes.
func managementCounts(base, uri string, client *http.Client) countsFunc {
	if client == nil {
		client = &http.Client{Timeout: 30 * time.Second}
	}
	var user, pass string
	if u, err := url.Parse(uri); err == nil && u.User != nil {
		user = u.User.Username()
		pass, _ = u.User.Password()
	}
	base = strings.TrimSuffix(base, "/")
	get := func(ctx context.Context, path string, v any) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+path, nil)
		if err != nil {
			return fmt.Errorf("management api: %w", redactError(err, uri))
		}
		req.SetBasicAuth(user, pass)
		resp, err := client.Do(req)
		if err != nil {
			return fmt.Errorf("management api: %s", redactString(redactError(err, uri).Error(), base))
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("management api: GET %s: %s", strings.SplitN(path, "?", 2)[0], resp.Status)
		}
		if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
			return fmt.Errorf("management api: GET %s: %w", strings.SplitN(path, "?", 2)[0], err)
		}
		return nil
	}
	return func(ctx context.Context) (ops.BrokerCounts, error) {
		c := newCounts()
		var queues []struct {
			Name     string   `json:"name"`
			Messages int      `json:"messages"`
			Ready    int      `json:"messages_ready"`
			Unacked  int      `json:"messages_unacknowledged"`
			Type     string   `json:"type"`
			Members  []string `json:"members"`
			Online   []string `json:"online"`
		}
		if err := get(ctx, "/api/queues/"+url.PathEscape(vhost(uri))+"?columns=name,messages,messages_ready,messages_unacknowledged,type,members,online", &queues); err != nil {
			return c, err
		}
		for _, q := range queues {
			c.Messages[q.Name], c.Ready[q.Name], c.Unacked[q.Name] = q.Messages, q.Ready, q.Unacked
			if q.Type == "quorum" {
				c.Members[q.Name], c.Online[q.Name] = len(q.Members), len(q.Online)
			}
		}
		var nodes []struct {
			FDUsed       int `json:"fd_used"`
			FDTotal      int `json:"fd_total"`
			SocketsUsed  int `json:"sockets_used"`
			SocketsTotal int `json:"sockets_total"`
		}
		if err := get(ctx, "/api/nodes?columns=name,fd_used,fd_total,sockets_used,sockets_total", &nodes); err != nil {
			return c, err
		}
		// The node nearest to its limit speaks for the cluster. RabbitMQ 4.0+ reports
		// no sockets (0 of 0): unknown.
		worst := func(used, limit int, u, l *int) {
			if limit > 0 && (*l == 0 || used*(*l) > (*u)*limit) {
				*u, *l = used, limit
			}
		}
		for _, n := range nodes {
			worst(n.FDUsed, n.FDTotal, &c.FileDescriptors, &c.FileDescriptorLimit)
			worst(n.SocketsUsed, n.SocketsTotal, &c.Sockets, &c.SocketLimit)
		}
		if len(nodes) == 0 {
			return c, errors.New("management api: GET /api/nodes: no node")
		}
		return c, nil
	}
}
