package topology_test

import (
	"context"
	"errors"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
)

func TestParseMode(t *testing.T) {
	for in, want := range map[string]topology.Mode{"": topology.ModeDeclare, "declare": topology.ModeDeclare, "verify": topology.ModeVerify, "none": topology.ModeNone} {
		if got, err := topology.ParseMode(in); err != nil || got != want {
			t.Errorf("ParseMode(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := topology.ParseMode("passive"); err == nil || !strings.Contains(err.Error(), `"passive"`) {
		t.Errorf("ParseMode(passive) = %v, want an error naming it", err)
	}
	if err := (delay.Config{Topology: "bogus"}).Validate(); err == nil || !strings.Contains(err.Error(), "Topology:") {
		t.Errorf("delay.Config with a bogus mode: %v", err)
	}
}

func TestEnsureModes(t *testing.T) {
	conn := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	top := topology.Topology{
		Exchanges: []topology.Exchange{{Name: prefix + ".x", Kind: amqp.ExchangeDirect}},
		Queues:    []topology.Queue{{Name: prefix + ".q"}},
		Bindings:  []topology.Binding{{Exchange: prefix + ".x", Destination: prefix + ".q", Key: "k"}},
	}
	brokertest.CleanupTopology(t, top)
	ensure := func(mode topology.Mode) error {
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		defer ch.Close()
		return topology.Ensure(ch, mode, top)
	}
	if err := ensure(topology.ModeNone); err != nil {
		t.Fatalf("none: %v", err)
	}
	err := ensure(topology.ModeVerify)
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), prefix+".x") {
		t.Fatalf("verify before declare: %v, want ErrMissing naming the exchange", err)
	}
	if err := ensure(""); err != nil {
		t.Fatalf("declare: %v", err)
	}
	if err := ensure(topology.ModeVerify); err != nil {
		t.Fatalf("verify after declare: %v", err)
	}
	if err := ensure("bogus"); err == nil {
		t.Fatal("unknown mode accepted")
	}
}

// lpUser creates a RabbitMQ user with read and write but no configure permission on
// the vhost, deleted at the end, and returns its URI.
func lpUser(t *testing.T) string {
	t.Helper()
	brokertest.Dial(t)
	words := brokertest.CtlCommand()
	if _, err := exec.LookPath(words[0]); err != nil {
		if brokertest.CI() {
			t.Fatalf("needs %s: %v", words[0], err)
		}
		t.Skipf("needs %s to create a user: %v", words[0], err)
	}
	ctx := context.Background()
	user, pass := "amqpretry-lp-"+watermill.NewShortUUID()[:8], watermill.NewShortUUID()
	if out, err := brokertest.Ctl(ctx, "add_user", user, pass); err != nil {
		if brokertest.CI() {
			t.Fatal(err)
		}
		t.Skipf("cannot create a user: %v\n%s", err, out)
	}
	t.Cleanup(func() { _, _ = brokertest.Ctl(context.Background(), "delete_user", user) })
	vhost := ops.VHost(brokertest.URI())
	if _, err := brokertest.Ctl(ctx, "set_permissions", "-p", vhost, user, "^$", ".*", ".*"); err != nil {
		t.Fatal(err)
	}
	uri := strings.Replace(brokertest.URI(), "guest:guest@", user+":"+pass+"@", 1)
	if uri == brokertest.URI() {
		t.Skip("AMQP_URI does not use guest:guest; cannot derive the least-privilege URI")
	}
	return uri
}

// TestLeastPrivilegeVerifyMode: after `topology apply` by an administrator, an
// application whose user has read and write but no configure permission runs in the
// verify mode: delay.New and the subscriber's Builder check instead of declaring,
// retries come back and poisoning works.
func TestLeastPrivilegeVerifyMode(t *testing.T) {
	lpURI := lpUser(t)
	prefix := brokertest.Prefix(t)
	tiers := []time.Duration{time.Second, 2 * time.Second}
	queue := prefix + ".orders"
	adminCfg := ops.Config{URI: brokertest.URI(), Delay: delay.Config{Prefix: prefix, Tiers: tiers}}
	plan, err := ops.PlanTopology(adminCfg, queue)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, plan.Topology)
	brokertest.Cleanup(t, []string{queue}, nil)

	h, err := delay.Dial(delay.HandoffConfig{URI: lpURI})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	dcfg := delay.Config{Prefix: prefix, Tiers: tiers, Handoff: h, Topology: topology.ModeVerify}

	// Before apply: the verify mode names what is missing and the command creating it.
	_, err = delay.New(dcfg)
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), "amqpretry topology apply --backend ttl-tiers --prefix "+prefix+" --tiers 1s,2s") {
		t.Fatalf("verify mode before apply: %v", err)
	}

	admin, err := ops.New(adminCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	if _, err := admin.Apply(context.Background(), queue); err != nil {
		t.Fatal(err)
	}

	// The user really may not configure: declaring fails, even what exists...
	declareCfg := dcfg
	declareCfg.Topology = topology.ModeDeclare
	if _, err := delay.New(declareCfg); err == nil || !strings.Contains(err.Error(), "403") {
		t.Fatalf("declare mode without configure permission: %v, want 403 ACCESS_REFUSED", err)
	}
	// ...but queue.bind needs only write on the queue and read on the exchange.
	lpConn, err := amqp.Dial(lpURI)
	if err != nil {
		t.Fatal(err)
	}
	defer lpConn.Close()
	ch, err := lpConn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(queue, queue, prefix+".deliver", false, nil); err != nil {
		t.Fatalf("queue.bind without configure permission: %v", err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err == nil {
		t.Fatal("queue.declare succeeded without configure permission")
	}

	backend, err := delay.New(dcfg)
	if err != nil {
		t.Fatalf("verify mode after apply: %v", err)
	}
	defer backend.Close()

	logger := watermill.NopLogger{}
	subCfg := wamqp.NewDurableQueueConfig(lpURI)
	subCfg.Marshaler = xdeath.Marshaler{}
	subCfg.TopologyBuilder = topology.Builder{Binder: backend, Mode: topology.ModeVerify}
	sub, err := wamqp.NewSubscriber(subCfg, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	poisonQueue := prefix + ".poison"
	retry, err := middleware.NewRetry(middleware.RetryConfig{
		Policy:      middleware.Policy{MaxAttempts: 3, Delays: []time.Duration{time.Second}},
		Delay:       backend,
		Poison:      h.QueuePublisher(),
		PoisonTopic: poisonQueue,
	})
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(retry.Middleware)
	var (
		mu       sync.Mutex
		attempts = map[string]int{}
		handled  = make(chan string, 10)
	)
	router.AddConsumerHandler("orders", queue, sub, func(msg *message.Message) error {
		mu.Lock()
		attempts[msg.UUID] = middleware.Attempt(msg)
		mu.Unlock()
		if msg.UUID == "doomed" || middleware.Attempt(msg) < 2 {
			return errors.New("warehouse offline")
		}
		handled <- msg.UUID
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	for _, id := range []string{"flaky", "doomed"} {
		if err := h.PublishMessage(ctx, "", queue, message.NewMessage(id, []byte(id)), nil); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case id := <-handled:
		if id != "flaky" {
			t.Fatalf("handled %s", id)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the retry of flaky never came back")
	}
	var poisoned ops.ListResult
	deadline := time.Now().Add(30 * time.Second)
	for len(poisoned.Messages) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("doomed never reached the poison queue")
		}
		time.Sleep(300 * time.Millisecond)
		if poisoned, err = admin.ListPoison(ctx, ops.ListOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	m := poisoned.Messages[0]
	if m.UUID != "doomed" || m.Reason != middleware.PoisonMaxAttempts || m.Attempt != 3 || m.Queue != queue || m.Error != "warehouse offline" {
		t.Errorf("poisoned: %+v", m)
	}
	mu.Lock()
	defer mu.Unlock()
	if attempts["flaky"] != 2 || attempts["doomed"] != 3 {
		t.Errorf("attempts: %v", attempts)
	}
}

// TestBuilderVerifyNamesMissingQueue: in the verify mode the subscriber's topology
// builder declares nothing and names a missing work queue and the apply command.
func TestBuilderVerifyNamesMissingQueue(t *testing.T) {
	conn := brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	planner, err := delay.NewPlanner(delay.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	b := topology.Builder{Binder: planner, Mode: topology.ModeVerify}
	err = b.BuildTopology(ch, prefix+".orders", "", wamqp.NewDurableQueueConfig(brokertest.URI()), watermill.NopLogger{})
	if !errors.Is(err, topology.ErrMissing) || !strings.Contains(err.Error(), `queue "`+prefix+`.orders"`) ||
		!strings.Contains(err.Error(), "amqpretry topology apply --backend ttl-tiers --prefix "+prefix+" --queue "+prefix+".orders") {
		t.Fatalf("builder verify on a missing queue: %v", err)
	}
	if err := (topology.Builder{Binder: planner, Mode: topology.ModeNone}).BuildTopology(nil, "whatever", "", wamqp.Config{}, watermill.NopLogger{}); err != nil {
		t.Fatalf("none mode: %v", err)
	}
}
