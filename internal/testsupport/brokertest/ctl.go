package brokertest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// CtlEnv names the command that runs rabbitmqctl against the broker at AMQP_URI, as
// space-separated words: "rabbitmqctl" (the default) for the machine's broker,
// "scripts/rabbitmq4.sh ctl" for the RabbitMQ 4.x one the test script starts.
const CtlEnv = "AMQPRETRY_RABBITMQCTL"

// RestartEnv opts in to tests that stop, restart or cut the connections of the broker
// under test: they run only when it is "1". scripts/test.sh sets it under CI=true;
// elsewhere it never restarts a broker unless asked to.
const RestartEnv = "AMQPRETRY_BROKER_RESTART"

// CtlCommand returns the words of the rabbitmqctl command for the broker under test.
func CtlCommand() []string {
	if words := strings.Fields(os.Getenv(CtlEnv)); len(words) > 0 {
		return words
	}
	return []string{"rabbitmqctl"}
}

// Ctl runs rabbitmqctl args against the broker under test and returns its combined
// output. It first makes sure, once per process, that the command reaches the node
// listening on AMQP_URI's port, and refuses otherwise: a policy, a closed connection or
// a restart meant for the broker under test never lands on another one (such as the
// machine's own broker while AMQP_URI names the RabbitMQ 4.x node). Every run is
// bounded (a minute; three for commands that wait for a node, such as await_startup or
// stop_app; less if ctx ends sooner): a broker that stopped answering fails the caller
// with an error naming the command.
func Ctl(ctx context.Context, args ...string) ([]byte, error) {
	if err := checkNode(ctx); err != nil {
		return nil, err
	}
	return runCtl(ctx, args...)
}

// ctlTimeout bounds one rabbitmqctl run, whatever the caller's context: a broker that
// stopped answering fails the test within it, naming the command, instead of hanging
// the test binary until go test's own timeout. The caller's deadline still applies when
// it is the shorter. (Variables for the package's tests.)
var ctlTimeout = time.Minute

// ctlWaitTimeout bounds the commands that wait for a node to start, stop or join
// (await_startup's own default --timeout is 300 s, so give it one to wait less).
var ctlWaitTimeout = 3 * time.Minute

// ctlWaitDelay is how long a killed rabbitmqctl's output may stay open: past it, the run
// returns even if some process it started still has the output pipe open.
const ctlWaitDelay = 5 * time.Second

// errCtlTimeout says that a rabbitmqctl run did not finish within its bound.
var errCtlTimeout = errors.New("no answer in time")

// ctlLimit returns the bound of one rabbitmqctl run with args.
func ctlLimit(args []string) time.Duration {
	for _, a := range args {
		if strings.HasPrefix(a, "-") {
			continue // options such as -q come before the command
		}
		switch a {
		case "await_startup", "await_online_nodes", "wait", "start_app", "stop_app", "stop",
			"shutdown", "reset", "force_reset", "join_cluster", "forget_cluster_node":
			return ctlWaitTimeout
		}
		return ctlTimeout
	}
	return ctlTimeout
}

func runCtl(ctx context.Context, args ...string) ([]byte, error) {
	words := CtlCommand()
	limit := ctlLimit(args)
	bounded, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	cmd := exec.CommandContext(bounded, words[0], append(words[1:], args...)...)
	// A wrapper (scripts/rabbitmq4.sh ctl) runs rabbitmqctl in a child: on timeout kill
	// the whole process group, and stop waiting for the output of any survivor.
	killProcessGroup(cmd)
	cmd.WaitDelay = ctlWaitDelay
	start := time.Now()
	out, err := cmd.CombinedOutput()
	if err == nil {
		return out, nil
	}
	name := strings.Join(append(slices.Clone(words), args...), " ")
	took := time.Since(start).Round(time.Millisecond)
	switch {
	case ctx.Err() != nil:
		return out, fmt.Errorf("%s: stopped after %s, the caller's context ended: %w (%w)\n%s", name, took, context.Cause(ctx), err, out)
	case bounded.Err() != nil:
		return out, fmt.Errorf("%s: %w: killed after %s (limit %s); is the broker under test hung or stopped? (%w, %w)\n%s", name, errCtlTimeout, took, limit, context.Cause(bounded), err, out)
	}
	return out, fmt.Errorf("%s: %w\n%s", name, err, out)
}

// checked has the rabbitmqctl command and AMQP_URI pairs found to match.
var checked sync.Map

// errOtherNode says that the rabbitmqctl command reaches a node other than AMQP_URI's.
var errOtherNode = errors.New("not the broker at AMQP_URI")

// checkNode returns nil if the rabbitmqctl command reaches the node that listens for
// AMQP on AMQP_URI's port.
func checkNode(ctx context.Context) error {
	words := CtlCommand()
	key := strings.Join(words, " ") + "\x00" + URI()
	if _, ok := checked.Load(key); ok {
		return nil
	}
	ports, err := ctlAMQPPorts(ctx)
	if err != nil {
		return fmt.Errorf("rabbitmqctl does not reach the broker: %w", err)
	}
	if u, _ := amqp.ParseURI(URI()); !slices.Contains(ports, u.Port) {
		return fmt.Errorf("%w: %q reaches a node listening for AMQP on %v, not on %d of AMQP_URI (%s); set %s to the rabbitmqctl command of the broker at AMQP_URI",
			errOtherNode, strings.Join(words, " "), ports, u.Port, Redact(URI()), CtlEnv)
	}
	checked.Store(key, true)
	return nil
}

// RequireRestart skips t unless RestartEnv is "1", the rabbitmqctl command works and the
// node it reaches is the broker at AMQP_URI (it listens for AMQP on the URI's port), so
// that a test never restarts some other broker: say, the machine's own while AMQP_URI
// names the RabbitMQ 4.x node. Under CI=true a command that does not work or reaches
// another node fails t instead. Tests that disturb the broker call it first.
func RequireRestart(t testing.TB) {
	t.Helper()
	if os.Getenv(RestartEnv) != "1" {
		t.Skipf("disturbs the broker under test: set %s=1 (scripts/test.sh does under CI=true) and run packages serially", RestartEnv)
	}
	words := CtlCommand()
	if _, err := exec.LookPath(words[0]); err != nil {
		t.Skipf("needs %s (%s): %v", words[0], CtlEnv, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := checkNode(ctx); err != nil {
		msg := fmt.Sprintf("%s=1 but %v", RestartEnv, err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
}

// ctlAMQPPorts returns the ports on which the node that the rabbitmqctl command reaches
// listens for AMQP.
func ctlAMQPPorts(ctx context.Context) ([]int, error) {
	out, err := runCtl(ctx, "-q", "status", "--formatter", "json")
	if err != nil {
		return nil, err
	}
	var status struct {
		Listeners []struct {
			Port     int    `json:"port"`
			Protocol string `json:"protocol"`
		} `json:"listeners"`
	}
	if i := bytes.IndexByte(out, '{'); i > 0 {
		out = out[i:] // past any warning printed before the document
	}
	if err := json.Unmarshal(out, &status); err != nil {
		return nil, fmt.Errorf("reading rabbitmqctl status: %w\n%s", err, out)
	}
	var ports []int
	for _, l := range status.Listeners {
		if l.Protocol == "amqp" || l.Protocol == "amqp/ssl" {
			ports = append(ports, l.Port)
		}
	}
	return ports, nil
}
