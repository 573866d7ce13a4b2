package brokertest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// stopTB records how RequireRestart ended a test without ending this one.
type stopTB struct {
	testing.TB
	skipped, failed string
}

func (s *stopTB) Helper() {}
func (s *stopTB) Skip(args ...any) {
	s.skipped = fmt.Sprint(args...)
	runtime.Goexit()
}
func (s *stopTB) Skipf(format string, args ...any) {
	s.skipped = fmt.Sprintf(format, args...)
	runtime.Goexit()
}
func (s *stopTB) Fatal(args ...any) {
	s.failed = fmt.Sprint(args...)
	runtime.Goexit()
}
func (s *stopTB) Fatalf(format string, args ...any) {
	s.failed = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func requireRestart(tb testing.TB) *stopTB {
	s := &stopTB{TB: tb}
	done := make(chan struct{})
	go func() {
		defer close(done)
		RequireRestart(s)
	}()
	<-done
	return s
}

// Ctl and RequireRestart must refuse when the rabbitmqctl command reaches a node other than the
// broker at AMQP_URI. It only reads the node's status.
func TestRequireRestartRefusesAnotherNode(t *testing.T) {
	skipShort(t)
	// Several rabbitmqctl runs, each bounded by ctlTimeout: room for a loaded machine.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	ports, err := ctlAMQPPorts(ctx)
	if err != nil || len(ports) == 0 {
		t.Skipf("no rabbitmqctl that reaches a broker (%s): %v", CtlEnv, err)
	}
	t.Setenv(RestartEnv, "1")

	t.Setenv("AMQP_URI", fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", ports[0]))
	if s := requireRestart(t); s.skipped != "" || s.failed != "" {
		t.Errorf("the node's own port: skipped %q, failed %q", s.skipped, s.failed)
	}

	t.Setenv("AMQP_URI", "amqp://guest:guest@127.0.0.1:1/")
	if out, err := Ctl(ctx, "-q", "list_queues"); !errors.Is(err, errOtherNode) {
		t.Errorf("Ctl on another node's AMQP_URI: %v\n%s", err, out)
	}
	for _, ci := range []string{"", "true"} {
		t.Setenv("CI", ci)
		s := requireRestart(t)
		got := s.skipped
		if ci == "true" {
			got = s.failed
		}
		if !strings.Contains(got, "not on 1 of AMQP_URI") {
			t.Errorf("CI=%q, another port: skipped %q, failed %q", ci, s.skipped, s.failed)
		}
	}
}

// A rabbitmqctl that never answers fails within the bound, naming the command, even
// when the caller's context has no deadline and the command's child keeps its output open.
func TestCtlHungBrokerFailsFast(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("needs sh")
	}
	hung := filepath.Join(t.TempDir(), "hung-rabbitmqctl")
	// A wrapper whose child keeps the output open, as scripts/rabbitmq4.sh ctl's does.
	if err := os.WriteFile(hung, []byte("#!/bin/sh\necho starting\nsleep 600 &\nwait\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv(CtlEnv, hung+" --as-wrapper")
	defer func(d time.Duration) { ctlTimeout = d }(ctlTimeout)
	ctlTimeout = time.Second

	start := time.Now()
	out, err := runCtl(context.Background(), "-q", "list_queues", "name")
	took := time.Since(start)
	if !errors.Is(err, errCtlTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("runCtl on a hung command: %v, want errCtlTimeout and context.DeadlineExceeded", err)
	}
	if err != nil && !strings.Contains(err.Error(), hung+" --as-wrapper -q list_queues name") {
		t.Errorf("the error does not name the command: %v", err)
	}
	if !strings.Contains(string(out), "starting") {
		t.Errorf("output so far %q, want what the command printed before it hung", out)
	}
	if took > ctlTimeout+ctlWaitDelay {
		t.Errorf("took %s, want at most %s", took, ctlTimeout+ctlWaitDelay)
	}

	// The caller's shorter deadline wins, and the error says so.
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	ctlTimeout = time.Minute
	start = time.Now()
	_, err = runCtl(ctx, "await_startup")
	if took := time.Since(start); took > 200*time.Millisecond+ctlWaitDelay {
		t.Errorf("with the caller's 200 ms deadline took %s", took)
	}
	if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errCtlTimeout) || !strings.Contains(err.Error(), "caller's context") {
		t.Errorf("with the caller's deadline: %v", err)
	}
}

func TestCtlLimit(t *testing.T) {
	for args, want := range map[string]time.Duration{
		"-q list_queues name":        ctlTimeout,
		"-q await_startup":           ctlWaitTimeout,
		"stop_app":                   ctlWaitTimeout,
		"set_policy p ^q {}":         ctlTimeout,
		"-q status --formatter json": ctlTimeout,
		"":                           ctlTimeout,
	} {
		if got := ctlLimit(strings.Fields(args)); got != want {
			t.Errorf("ctlLimit(%q) = %s, want %s", args, got, want)
		}
	}
}

// skipShort skips a test that waits on the broker for seconds in the quick loop
// (go test -short); the test script runs it.
func skipShort(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("waits on the broker for seconds: not in -short")
	}
}
