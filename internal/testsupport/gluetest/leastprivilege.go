package gluetest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/topology"
)

// apply declares plan and the work queues, as an administrator running `amqpretry
// topology apply` would, and removes them when the test ends.
func apply(t *testing.T, plan topology.Topology, workQueues ...string) {
	t.Helper()
	for _, q := range workQueues {
		plan.Queues = append([]topology.Queue{{Name: q}}, plan.Queues...)
	}
	brokertest.CleanupTopology(t, plan) // before declaring: a declaration that fails half-way leaves some
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := declare.Unique(plan).Apply(ch, topology.ModeDeclare); err != nil {
		t.Fatal(err)
	}
}

// LeastPrivilegeAfterTopologyApply: an application whose RabbitMQ user may read and
// write but not configure runs in topology mode verify, after an administrator applied
// the topology: retries and poisoning work. Before the apply, it fails at start-up
// naming what is missing and the command that creates it, with its queue; in declare
// mode it is refused with a hint at the verify mode.
func LeastPrivilegeAfterTopologyApply(t *testing.T, m Major) {
	brokertest.Dial(t)
	lpURI := brokertest.RestrictedUser(t)
	prefix := brokertest.Prefix(t)
	queue := prefix + ".orders"
	cfg := amqpretry.Config{
		Prefix:   prefix,
		Backend:  delay.TTLTiers(500 * time.Millisecond),
		Policy:   amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1},
		Topology: topology.ModeVerify,
		Logger:   Logger(),
	}
	sub := Sub{URI: lpURI}

	// Before the apply: verify names what is missing and the command.
	_, err := m.New(sub, cfg)
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), "amqpretry topology apply") {
		t.Fatalf("New before apply = %v, want ErrMissing with the apply command", err)
	}
	// Declaring needs configure permission: refused, with the way out.
	declareCfg := cfg
	declareCfg.Topology = topology.ModeDeclare
	if _, err := m.New(sub, declareCfg); err == nil || !strings.Contains(err.Error(), "ACCESS_REFUSED") || !strings.Contains(err.Error(), "ModeVerify") {
		t.Fatalf("New in declare mode without configure permission = %v, want ACCESS_REFUSED with the verify mode hint", err)
	}

	// The administrator applies the topology, first without the work queue.
	plan, err := cfg.Plan()
	if err != nil {
		t.Fatal(err)
	}
	withQueue, err := cfg.Plan(queue)
	if err != nil {
		t.Fatal(err)
	}
	r := func() Retry {
		// The work queue is still missing: subscribing names it, with --queue.
		apply(t, plan)
		r := newRetry(t, m, sub, cfg)
		s := m.Subscriber(t, r)
		_, err := s.Subscribe(context.Background(), queue)
		if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), "--queue "+queue) {
			t.Fatalf("Subscribe to a missing work queue in verify mode = %v, want ErrMissing with --queue %s", err, queue)
		}
		apply(t, withQueue, queue)
		return r
	}()
	rec := newRecorder(func(msg *message.Message) error {
		if msg.UUID == "bad" {
			return amqpretry.Permanent(errors.New("malformed"))
		}
		if amqpretry.Attempt(msg) == 1 {
			return errFlaky
		}
		return nil
	})
	newRouter(t, func(router *message.Router) {
		if _, err := r.AddHandler(router, "orders", queue, rec.handle); err != nil {
			t.Fatal(err)
		}
	})
	pub := m.Publisher(t, sub)
	for _, id := range []string{"good", "bad"} {
		if err := pub.Publish(queue, message.NewMessage(id, nil)); err != nil {
			t.Fatal(err)
		}
	}
	if msg := poisoned(t, prefix+".poison", 30*time.Second); msg.UUID != "bad" {
		t.Errorf("poisoned %s, want bad", msg.UUID)
	}
	calls := rec.waitCalls(t, 3, 30*time.Second)
	if got := attemptsByUUID(calls); fmt.Sprint(got["good"]) != "[1 2]" || len(got["bad"]) != 1 {
		t.Errorf("handled %v, want good on attempts [1 2] and bad once", got)
	}

	// The quickstart runs the same way: TOPOLOGY=verify on what the admin created.
	qsPrefix, qsQueue := prefix+"-qs", prefix+"-qs.orders"
	qsPlan, err := amqpretry.Config{Prefix: qsPrefix, Backend: delay.TTLTiers(time.Second, 2*time.Second, 4*time.Second)}.Plan(qsQueue)
	if err != nil {
		t.Fatal(err)
	}
	apply(t, qsPlan, qsQueue)
	_, file, _, _ := runtime.Caller(0)
	cmd := exec.Command("go", "run", ".") // a module of its own
	cmd.Dir = filepath.Join(filepath.Dir(file), "..", "..", "..", "_examples", "quickstart")
	cmd.Env = append(os.Environ(), "AMQP_URI="+lpURI, "TOPOLOGY=verify", "PREFIX="+qsPrefix, "QUEUE="+qsQueue, "WATERMILL_AMQP="+m.Name())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("quickstart with TOPOLOGY=verify as the least-privilege user: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "lp-secret") {
		t.Error("the quickstart printed the password")
	}
	t.Logf("quickstart as a user without configure permission:\n%s", out)
}
