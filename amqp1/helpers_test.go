package amqp1

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill"
)

// The tests run against a real RabbitMQ 4.x node: AMQP1_URI, by default the 4.3 node
// of scripts/rabbitmq4.sh. Without a broker they skip, saying why, except under
// CI=true, where they fail.
const defaultTestURI = "amqp://guest:guest@127.0.0.1:5675/"

// runID makes this run's queue names and container ids unique.
var runID = func() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}()

func getenvInt(name string) int {
	n, _ := strconv.Atoi(os.Getenv(name))
	return n
}

func testURI() string {
	if uri := os.Getenv("AMQP1_URI"); uri != "" {
		return uri
	}
	return defaultTestURI
}

var (
	brokerOnce    sync.Once
	brokerErr     error
	brokerVersion string
)

// requireBroker returns the broker URI, or skips (fails under CI=true) when no broker
// answers there.
func requireBroker(t testing.TB) string {
	t.Helper()
	uri := testURI()
	brokerOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		conn, err := dialTest(ctx, uri, "amqp1-test-"+runID+"-probe")
		if err != nil {
			brokerErr = err
			return
		}
		brokerVersion, _ = conn.Properties()["version"].(string)
		_ = conn.Close()
	})
	if brokerErr != nil {
		e, _ := parseURI(uri, nil)
		if os.Getenv("CI") == "true" {
			t.Fatalf("no RabbitMQ 4.x with AMQP 1.0 at %s (AMQP1_URI): %v", e.redacted, brokerErr)
		}
		t.Skipf("no RabbitMQ 4.x with AMQP 1.0 at %s (set AMQP1_URI; CI=true makes this a failure): %v", e.redacted, brokerErr)
	}
	return uri
}

// requireBroker43 skips on brokers older than 4.3, which ignore x-opt-delivery-time.
func requireBroker43(t testing.TB) string {
	t.Helper()
	uri := requireBroker(t)
	if !versionAtLeast(brokerVersion, 4, 3) {
		t.Skipf("RabbitMQ %s ignores x-opt-delivery-time on modified (4.3+ honours it)", brokerVersion)
	}
	return uri
}

func versionAtLeast(v string, major, minor int) bool {
	var ma, mi int
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return false
	}
	for _, c := range parts[0] {
		ma = ma*10 + int(c-'0')
	}
	for _, c := range parts[1] {
		mi = mi*10 + int(c-'0')
	}
	return ma > major || (ma == major && mi >= minor)
}

func dialTest(ctx context.Context, uri, containerID string) (*amqp.Conn, error) {
	e, err := parseURI(uri, nil)
	if err != nil {
		return nil, err
	}
	return amqp.Dial(ctx, e.addr, e.connOptions(containerID))
}

// testContext is a context that ends with the test's deadline margin or after max.
func testContext(t testing.TB, max time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), max)
	t.Cleanup(cancel)
	return ctx
}

// queueName returns a queue name unique to this run and deletes the queue (if it was
// created) when the test ends.
func queueName(t testing.TB, name string) string {
	t.Helper()
	q := "amqp1-test-" + runID + "-" + name
	t.Cleanup(func() { deleteQueues(t, q) })
	return q
}

// deleteQueues deletes queues through the management node on a connection of its own.
func deleteQueues(t testing.TB, queues ...string) {
	t.Helper()
	if len(queues) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := dialTest(ctx, testURI(), "amqp1-test-"+runID+"-cleanup")
	if err != nil {
		t.Errorf("cleanup: connect: %v", err)
		return
	}
	defer conn.Close()
	for _, q := range queues {
		err := withManagement(ctx, conn, func(m *management) error { return m.deleteQueue(ctx, q) })
		if err != nil {
			t.Errorf("cleanup: delete queue %q: %v", q, err)
		}
	}
}

// declareQueue declares a queue through the management node.
func declareQueue(t testing.TB, queue, queueType string, args map[string]any) {
	t.Helper()
	ctx := testContext(t, 30*time.Second)
	conn, err := dialTest(ctx, testURI(), "amqp1-test-"+runID+"-declare")
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer conn.Close()
	err = withManagement(ctx, conn, func(m *management) error { return m.declareQueue(ctx, queue, queueType, args) })
	if err != nil {
		t.Fatalf("declare queue %q: %v", queue, err)
	}
}

// queueRecorder records the queues a Subscriber config maps topics to, and deletes
// them all when the test ends.
type queueRecorder struct {
	mu     sync.Mutex
	queues map[string]struct{}
}

func newQueueRecorder(t testing.TB) *queueRecorder {
	r := &queueRecorder{queues: map[string]struct{}{}}
	t.Cleanup(func() {
		r.mu.Lock()
		queues := make([]string, 0, len(r.queues))
		for q := range r.queues {
			queues = append(queues, q)
		}
		r.mu.Unlock()
		deleteQueues(t, queues...)
	})
	return r
}

func (r *queueRecorder) queueName(topic string) string {
	r.mu.Lock()
	r.queues[topic] = struct{}{}
	r.mu.Unlock()
	return topic
}

// rabbitmqctl is the command that runs rabbitmqctl against the test broker:
// AMQP1_RABBITMQCTL, else, when AMQP1_URI is unset (the 4.3 node of
// scripts/rabbitmq4.sh) and the tests run as root, that script's ctl. Tests that need
// it skip without it.
func rabbitmqctl(t testing.TB) []string {
	t.Helper()
	ctl := findRabbitmqctl()
	if ctl == nil {
		t.Skip("no rabbitmqctl for the test broker: set AMQP1_RABBITMQCTL (for example \"scripts/rabbitmq4.sh 4.3 ctl\")")
	}
	return ctl
}

func findRabbitmqctl() []string {
	if ctl := os.Getenv("AMQP1_RABBITMQCTL"); ctl != "" {
		return strings.Fields(ctl)
	}
	if os.Getenv("AMQP1_URI") == "" && os.Geteuid() == 0 {
		script, err := filepath.Abs(filepath.Join("..", "scripts", "rabbitmq4.sh"))
		if err == nil {
			if _, err := os.Stat(script); err == nil {
				return []string{script, "4.3", "ctl"}
			}
		}
	}
	return nil
}

// closeConnections closes, from the broker's side, every connection whose container
// id starts with prefix (only this test's, never another's), and returns their
// container ids.
func closeConnections(ctl []string, prefix string) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	list := exec.CommandContext(ctx, ctl[0], append(ctl[1:], "list_connections", "-q", "--no-table-headers", "pid", "container_id")...)
	var out, stderr bytes.Buffer
	list.Stdout, list.Stderr = &out, &stderr
	if err := list.Run(); err != nil {
		return nil, errorsJoinOutput(err, stderr.String())
	}
	var closed []string
	for _, line := range strings.Split(out.String(), "\n") {
		fields := strings.Fields(line)
		if len(fields) != 2 || !strings.HasPrefix(fields[1], prefix) {
			continue
		}
		closeCmd := exec.CommandContext(ctx, ctl[0], append(ctl[1:], "close_connection", fields[0], "amqp1 test: broker-side close")...)
		if b, err := closeCmd.CombinedOutput(); err != nil {
			return closed, errorsJoinOutput(err, string(b))
		}
		closed = append(closed, fields[1])
	}
	return closed, nil
}

func errorsJoinOutput(err error, output string) error {
	return &cmdError{err: err, output: strings.TrimSpace(output)}
}

type cmdError struct {
	err    error
	output string
}

func (e *cmdError) Error() string { return e.err.Error() + ": " + e.output }

// testLogger logs to stderr when AMQP1_TEST_LOG is set (debug when it is "debug").
func testLogger() watermill.LoggerAdapter {
	switch os.Getenv("AMQP1_TEST_LOG") {
	case "":
		return watermill.NopLogger{}
	case "debug":
		return watermill.NewStdLogger(true, false)
	default:
		return watermill.NewStdLogger(false, false)
	}
}
