package amqpretry_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/topology"
)

// leastPrivilegeURI creates a RabbitMQ user with read and write but no configure
// permission on the test broker's vhost, removed when the test ends, and returns the
// broker URI with its credentials.
func leastPrivilegeURI(t *testing.T) string {
	t.Helper()
	ctx := context.Background()
	if out, err := brokertest.Ctl(ctx, "-q", "status"); err != nil {
		if brokertest.CI() {
			t.Fatalf("rabbitmqctl is needed to create a user: %v\n%s", err, out)
		}
		t.Skipf("rabbitmqctl is needed to create a user: %v", err)
	}
	u, err := url.Parse(brokertest.URI())
	if err != nil {
		t.Fatal(err)
	}
	vhost := strings.TrimPrefix(u.Path, "/")
	if vhost == "" {
		vhost = "/"
	}
	user, pass := "amqpretry-lp-"+strings.ReplaceAll(brokertest.Prefix(t)[len("amqpretry-test."):], ".", "-"), "lp-secret"
	user = user[:min(len(user), 60)]
	for _, args := range [][]string{
		{"add_user", user, pass},
		{"set_permissions", "-p", vhost, user, "^$", ".*", ".*"},
	} {
		if out, err := brokertest.Ctl(ctx, args...); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
	}
	t.Cleanup(func() { _, _ = brokertest.Ctl(ctx, "delete_user", user) })
	u.User = url.UserPassword(user, pass)
	return u.String()
}

// TestLeastPrivilegeAfterTopologyApply: an application whose RabbitMQ user may read and
// write but not configure runs in topology mode verify, after an administrator applied
// the topology: retries and poisoning work. Before the apply, it fails at start-up
// naming what is missing and the command that creates it; in declare mode it is refused.
func TestLeastPrivilegeAfterTopologyApply(t *testing.T) {
	brokertest.Dial(t)
	lpURI := leastPrivilegeURI(t)
	prefix := brokertest.Prefix(t)
	queue := prefix + ".orders"
	dcfg := delay.Config{Prefix: prefix, Tiers: []time.Duration{500 * time.Millisecond}}
	cfg := amqpretry.Config{
		Subscriber: wamqp.NewDurableQueueConfig(lpURI),
		Delay:      dcfg,
		Policy:     middleware.Policy{MaxAttempts: 3, Delays: []time.Duration{500 * time.Millisecond}},
		Topology:   topology.ModeVerify,
		Logger:     testLogger(),
	}

	// Before the apply: verify names what is missing and the command.
	_, err := amqpretry.New(cfg)
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), "amqpretry topology apply") {
		t.Fatalf("New before apply = %v, want ErrMissing with the apply command", err)
	}
	// Declaring needs configure permission.
	declare := cfg
	declare.Topology = topology.ModeDeclare
	if _, err := amqpretry.New(declare); err == nil || !strings.Contains(err.Error(), "ACCESS_REFUSED") {
		t.Fatalf("New in declare mode without configure permission = %v, want ACCESS_REFUSED", err)
	}

	// The administrator applies the topology, work queue included.
	admin, err := ops.New(ops.Config{URI: brokertest.URI(), Delay: dcfg})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	applied, err := admin.Apply(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, applied.Plan.Topology)
	brokertest.Cleanup(t, []string{queue}, nil)

	r := newRetry(t, cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "bad" {
			return middleware.Permanent(errors.New("malformed"))
		}
		if middleware.Attempt(msg) == 1 {
			return errFlaky
		}
		return nil
	})
	newRouter(t, func(router *message.Router) {
		if _, err := r.AddHandler(router, "orders", queue, rec.handle); err != nil {
			t.Fatal(err)
		}
	})
	pub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(lpURI), testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	for _, id := range []string{"good", "bad"} {
		if err := pub.Publish(queue, message.NewMessage(id, nil)); err != nil {
			t.Fatal(err)
		}
	}
	if msg := poisoned(t, r.PoisonQueue(), 30*time.Second); msg.UUID != "bad" {
		t.Errorf("poisoned %s, want bad", msg.UUID)
	}
	calls := rec.waitCalls(t, 3, 30*time.Second)
	if got := attemptsByUUID(calls); fmt.Sprint(got["good"]) != "[1 2]" || len(got["bad"]) != 1 {
		t.Errorf("handled %v, want good on attempts [1 2] and bad once", got)
	}

	// The quickstart runs the same way: TOPOLOGY=verify on a queue the admin created.
	qsQueue := prefix + ".quickstart"
	qsAdmin, err := ops.New(ops.Config{URI: brokertest.URI(), Delay: delay.Config{Prefix: "amqpretry-quickstart", Tiers: []time.Duration{time.Second, 2 * time.Second, 4 * time.Second}}})
	if err != nil {
		t.Fatal(err)
	}
	defer qsAdmin.Close()
	if _, err := qsAdmin.Apply(context.Background(), qsQueue); err != nil {
		t.Fatal(err)
	}
	brokertest.Cleanup(t, []string{qsQueue}, nil)
	cmd := exec.Command("go", "run", "./_examples/quickstart")
	cmd.Env = append(os.Environ(), "AMQP_URI="+lpURI, "TOPOLOGY=verify", "QUEUE="+qsQueue)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("quickstart with TOPOLOGY=verify as the least-privilege user: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "lp-secret") {
		t.Error("the quickstart printed the password")
	}
	t.Logf("quickstart as a user without configure permission:\n%s", out)
}
