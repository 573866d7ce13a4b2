package brokertest

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"sync"
	"testing"
	"time"
)

// DefaultDeadLetterResend is RabbitMQ's default dead_letter_worker_publisher_confirm_timeout
// (180,000 ms in 3.10.8, 4.0.5 and 4.3.x; set in rabbit's application environment,
// advanced.config only).
const DefaultDeadLetterResend = 3 * time.Minute

// DeadLetterResend returns how long the at-least-once dead-letter worker of a quorum
// queue waits before it sends again a dead-lettered message it could not deliver: the
// broker's dead_letter_worker_publisher_confirm_timeout, read once with rabbitmqctl
// (DefaultDeadLetterResend, logged, if that fails).
//
// It bounds how late a message that expires while the broker starts may come. A broker
// that keeps its metadata in Mnesia (RabbitMQ 3.x; 4.0 to 4.2 unless Khepri is on)
// starts its quorum queues before it restores its bindings (rabbit_vhost:recover); a
// quorum queue expires what is overdue as soon as it has a leader, and its worker keeps
// a message that finds no route and tries again only after this timeout
// (rabbit_fifo_dlx_worker). Late, never lost. With Khepri (4.3) the bindings need no
// restoring.
func DeadLetterResend(t testing.TB) time.Duration {
	t.Helper()
	resendOnce.Do(func() {
		resend, resendErr = readDeadLetterResend()
	})
	if resendErr != nil {
		t.Logf("%v; taking RabbitMQ's default, %s", resendErr, DefaultDeadLetterResend)
		return DefaultDeadLetterResend
	}
	return resend
}

var (
	resendOnce sync.Once
	resend     time.Duration
	resendErr  error
)

var resendValue = regexp.MustCompile(`\{ok,\s*(\d+)\}`)

func readDeadLetterResend() (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := Ctl(ctx, "eval", "application:get_env(rabbit, dead_letter_worker_publisher_confirm_timeout).")
	if err != nil {
		return 0, err
	}
	m := resendValue.FindSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("reading dead_letter_worker_publisher_confirm_timeout: no {ok, Milliseconds} in %q", out)
	}
	ms, err := strconv.ParseInt(string(m[1]), 10, 64)
	if err != nil {
		return 0, err
	}
	return time.Duration(ms) * time.Millisecond, nil
}
