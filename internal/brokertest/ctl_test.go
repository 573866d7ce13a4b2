package brokertest

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"
)

func TestURIPort(t *testing.T) {
	for uri, want := range map[string]int{
		"amqp://guest:guest@127.0.0.1:5674/": 5674,
		"amqp://guest:guest@127.0.0.1/":      5672,
		"amqps://u:p@example.com/vhost":      5671,
	} {
		if got := uriPort(uri); got != want {
			t.Errorf("uriPort(%q) = %d, want %d", uri, got, want)
		}
	}
}

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
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
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
