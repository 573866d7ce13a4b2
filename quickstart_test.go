package amqpretry_test

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
)

// The quickstarts fail fast when the router cannot start: the library's error is
// printed and the exit status is 1, instead of a wait on Running that never ends
// (issue 33). The router is refused here by a work queue that exists with another type
// than the example's subscriber config asks for: a quorum queue under the
// watermill-amqp quickstart (classic), a classic one under the AMQP 1.0 quickstart
// (quorum, RabbitMQ 4.3).
func TestQuickstartFailsFast(t *testing.T) {
	conn := brokertest.Dial(t)
	v, _ := conn.Properties["version"].(string)
	for _, tc := range []struct {
		name, dir, queueType string
		env                  []string
		want                 []string
	}{
		{
			name: "watermill-amqp", dir: "_examples/quickstart", queueType: "quorum", env: []string{"DELAY_BACKEND=ttl-tiers"},
			want: []string{"it has x-queue-type quorum, the subscriber config asks for ", "docs/switching-backends.md"},
		},
		{
			name: "amqp1", dir: "amqp1/examples/quickstart", queueType: "classic",
			want: []string{"it has x-queue-type classic, the subscriber config asks for quorum", "docs/switching-backends.md"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "amqp1" && !version.DelayedRetry(v) {
				t.Skipf("RabbitMQ %s: the AMQP 1.0 quickstart needs 4.3 or later (scripts/test.sh runs it there)", v)
			}
			queue := brokertest.Prefix(t) + ".orders"
			brokertest.Cleanup(t, []string{queue}, nil)
			ch, err := conn.Channel()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-queue-type": tc.queueType}); err != nil {
				t.Fatal(err)
			}
			_ = ch.Close()
			// The deadline covers building the example; the failure itself takes a
			// connection and a subscribe.
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, "go", "run", ".")
			cmd.Dir = tc.dir
			cmd.Env = append(cmd.Environ(), append(tc.env, "AMQP_URI="+brokertest.URI(), "QUEUE="+queue)...)
			out, err := cmd.CombinedOutput()
			if ctx.Err() != nil {
				t.Fatalf("the quickstart did not end within 5 minutes (the router never started and its error was lost?):\n%s", out)
			}
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != 1 {
				t.Fatalf("the quickstart exited with %v, want status 1:\n%s", err, out)
			}
			for _, w := range append([]string{"quickstart: the router did not start:", fmt.Sprintf("work queue %q", queue)}, tc.want...) {
				if !strings.Contains(string(out), w) {
					t.Errorf("the quickstart printed:\n%s\nnot:\n%s", out, w)
				}
			}
		})
	}
}
