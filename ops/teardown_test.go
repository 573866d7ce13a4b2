package ops_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/topology"
)

// exists tells whether a queue (or, with exchange, an exchange) exists.
func exists(t *testing.T, name string, exchange bool) bool {
	t.Helper()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close() //nolint:errcheck // closed by the broker on 404
	if exchange {
		err = ch.ExchangeDeclarePassive(name, amqp.ExchangeDirect, true, false, false, false, nil)
	} else {
		_, err = ch.QueueDeclarePassive(name, true, false, false, false, nil)
	}
	return err == nil
}

// TestTeardownAfterBackendChange: ttl-tiers, then binary-levels under the same prefix
// while two retries wait in the old tier queue. Teardown of the old backend, keeping
// the new one's plan, refuses (dry run or not) while they wait, naming the queue and
// the count; once they are back (retry now), a dry run lists what would go and removes
// nothing, and the teardown removes the tier queue, the delay and delivery exchanges,
// and leaves the new backend, the parking and poison queues and the work queue.
func TestTeardownAfterBackendChange(t *testing.T) {
	t.Parallel()
	old := amqpretry.Config{Backend: delay.TTLTiers(waitDelay)}
	r := waitingRig(t, old, "orders")
	queue := r.queues[0]
	now := amqpretry.Config{Backend: delay.BinaryLevels(3), Prefix: r.prefix, Policy: amqpretry.Policy{Delays: []time.Duration{time.Second}, Jitter: -1}}
	keep, err := now.Plan(queue)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CleanupTopology(t, keep)
	o2, err := ops.New(ops.Config{URI: brokertest.URI(), Retry: now})
	if err != nil {
		t.Fatal(err)
	}
	defer o2.Close()
	if _, err := o2.Apply(context.Background(), queue); err != nil {
		t.Fatal(err)
	}
	r.park(queue, "t-1", 1, time.Now())
	r.park(queue, "t-2", 1, time.Now())
	r.waitWaiting(2)
	tier := r.prefix + ".delay.10m"
	ctx := context.Background()

	for _, dry := range []bool{true, false} {
		res, err := r.ops.Teardown(ctx, ops.TeardownOptions{Keep: keep, DryRun: dry})
		if err == nil || !strings.Contains(err.Error(), tier+": 2") || res.Waiting[tier] != 2 {
			t.Fatalf("teardown (dry run %v) while 2 wait: %v %+v", dry, err, res)
		}
	}
	if !exists(t, tier, false) {
		t.Fatal("a refused teardown removed the tier queue")
	}
	if res, err := r.ops.Redrive(ctx, ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: queue}}); err != nil || res.Done != 2 {
		t.Fatalf("retry now: %v %+v", err, res)
	}
	// The broker's counts (list_queues) lag its stats interval: until they show the
	// queue empty, teardown still refuses.
	var res ops.TeardownResult
	waitFor(t, 30*time.Second, func() bool {
		res, err = r.ops.Teardown(ctx, ops.TeardownOptions{Keep: keep, DryRun: true})
		return err == nil
	})
	// The bindings as rabbitmqctl lists them: the tier queue's, and the old delivery
	// exchange's to the work queue, which stays, named, as the new backend's exchanges.
	if !res.DryRun || !slices.Equal(res.Queues, []string{tier}) ||
		!slices.Equal(res.Exchanges, []string{r.prefix + ".deliver", r.prefix + ".delay"}) || res.Bindings != 2 || len(res.BindingList) != 2 ||
		!slices.Contains(res.Left, ops.Left{Name: queue, Kind: "queue", Why: ops.LeftApplication}) ||
		!slices.Contains(res.Left, ops.Left{Name: r.prefix + ".levels.deliver", Kind: "exchange", Why: ops.LeftKept}) {
		t.Fatalf("dry run: %v %+v", err, res)
	}
	if !exists(t, tier, false) {
		t.Fatal("a dry run removed the tier queue")
	}
	if _, err := r.ops.Teardown(ctx, ops.TeardownOptions{Keep: keep}); err != nil {
		t.Fatal(err)
	}
	for _, gone := range []string{tier} {
		if exists(t, gone, false) {
			t.Errorf("queue %s still exists", gone)
		}
	}
	for _, gone := range []string{r.prefix + ".deliver", r.prefix + ".delay"} {
		if exists(t, gone, true) {
			t.Errorf("exchange %s still exists", gone)
		}
	}
	for _, kept := range []string{queue, r.prefix + ".parking", r.prefix + ".poison", r.prefix + ".level.0"} {
		if !exists(t, kept, false) {
			t.Errorf("queue %s was removed", kept)
		}
	}
	if !exists(t, r.prefix+".levels.deliver", true) {
		t.Error("the new backend's delivery exchange was removed")
	}
	if n := len(brokertest.Drain(t, queue)); n != 2 {
		t.Errorf("work queue holds %d retries, want 2", n)
	}
}

// TestTeardownForceAndUnknown: without rabbitmqctl what waits is unknown and teardown
// refuses, saying so (and names the queue once a retry shows there); forced, it
// removes the queue with what waits in it.
func TestTeardownForceAndUnknown(t *testing.T) {
	t.Parallel()
	r := waitingRig(t, amqpretry.Config{Backend: delay.TTLTiers(waitDelay)}, "orders")
	blind, err := ops.New(ops.Config{URI: brokertest.URI(), Retry: r.cfg.Retry})
	if err != nil {
		t.Fatal(err)
	}
	defer blind.Close()
	if _, err := blind.Teardown(context.Background(), ops.TeardownOptions{}); err == nil || !strings.Contains(err.Error(), "unknown without rabbitmqctl") {
		t.Fatalf("teardown without counts: %v", err)
	}
	r.park(r.queues[0], "f-1", 1, time.Now())
	r.waitWaiting(1)
	if _, err := blind.Teardown(context.Background(), ops.TeardownOptions{}); err == nil || !strings.Contains(err.Error(), ".delay.10m: 1") {
		t.Fatalf("teardown without counts, a retry ready: %v", err)
	}
	res, err := r.ops.Teardown(context.Background(), ops.TeardownOptions{Force: true})
	if err != nil || res.Waiting[r.prefix+".delay.10m"] != 1 {
		t.Fatalf("forced teardown: %v %+v", err, res)
	}
	if exists(t, r.prefix+".delay.10m", false) || !exists(t, r.prefix+".parking", false) {
		t.Error("forced teardown: the tier queue is still there, or the parking queue went")
	}
}

// TestTeardownCountsOnlyWhatItFinds (issue 33): a prefix under which nothing is
// declared made teardown report "removed 0 queues, 0 exchanges, 34 bindings" and
// succeed. It fails, saying nothing is there, and counts no binding; on a real
// topology it counts only the bindings whose two ends exist.
func TestTeardownCountsOnlyWhatItFinds(t *testing.T) {
	r := newRigWith(t, amqpretry.Config{}) // the default ladder: 34 tiers, nothing declared
	for _, dry := range []bool{true, false} {
		res, err := r.ops.Teardown(context.Background(), ops.TeardownOptions{DryRun: dry, Force: true})
		if err == nil || !strings.Contains(err.Error(), `teardown: nothing to remove: no queue or exchange of any backend under prefix "`+r.prefix+`"`) ||
			res.Bindings != 0 || len(res.Queues) != 0 || len(res.Exchanges) != 0 {
			t.Errorf("teardown (dry run %v) of a prefix with nothing declared: %v %+v", dry, err, res)
		}
	}

	r = newRigWith(t, amqpretry.Config{Backend: delay.TTLTiers(waitDelay)}, "orders")
	r.apply()
	tier := r.prefix + ".delay.10m"
	opts := ops.TeardownOptions{DryRun: true, Force: true} // no rabbitmqctl: forced, as what waits is unknown
	res, err := r.ops.Teardown(context.Background(), opts)
	// The delay exchange's binding to the tier queue; the parking exchange and queue stay.
	if err != nil || !slices.Equal(res.Queues, []string{tier}) || len(res.Exchanges) != 2 || res.Bindings != 1 {
		t.Fatalf("dry run: %v %+v", err, res)
	}
	// Issue 43: what it found and left is named, and why; without rabbitmqctl, what it
	// could not look for.
	shared := []ops.Left{
		{Name: r.prefix + ".parking", Kind: "queue", Why: ops.LeftShared},
		{Name: r.prefix + ".poison", Kind: "queue", Why: ops.LeftShared},
		{Name: r.prefix + ".parking", Kind: "exchange", Why: ops.LeftShared},
	}
	if !slices.Equal(res.Left, shared) || !slices.Equal(res.Unsearched, []string{r.prefix + ".delay.*"}) {
		t.Errorf("dry run: left %+v, unsearched %v", res.Left, res.Unsearched)
	}
	// Only what Only names goes (what a confirmation showed): the rest is left, named.
	only := opts
	only.Only = []string{tier}
	res, err = r.ops.Teardown(context.Background(), only)
	if err != nil || !slices.Equal(res.Queues, []string{tier}) || len(res.Exchanges) != 0 ||
		len(res.Left) != 5 || res.Left[3].Why != ops.LeftNotShown || res.Left[4].Why != ops.LeftNotShown {
		t.Errorf("dry run with Only: %v %+v", err, res)
	}
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDelete(tier, false, false, false); err != nil {
		t.Fatal(err)
	}
	res, err = r.ops.Teardown(context.Background(), opts)
	if err != nil || len(res.Queues) != 0 || len(res.Exchanges) != 2 || res.Bindings != 0 {
		t.Errorf("dry run without the tier queue: %v %+v, want its binding not counted", err, res)
	}
}

// TestTeardownNamesTheApplications (issue 51): teardown left the work queues and the
// application's topic exchanges and said nothing of them, and counted no binding to a
// work queue, though those went with the delivery exchange. With rabbitmqctl it lists
// the bindings that go, those to the work queue included, and names, as the
// application's, the work queue bound from the delivery exchange and the exchange the
// application bound to it; both stay, and the binding is gone.
func TestTeardownNamesTheApplications(t *testing.T) {
	t.Parallel()
	r := waitingRig(t, amqpretry.Config{Backend: delay.TTLTiers(waitDelay)}, "orders")
	queue := r.queues[0]
	topic := r.prefix + ".topic.orders" // as watermill-amqp's pub/sub config declares one
	brokertest.Cleanup(t, nil, []string{topic})
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.ExchangeDeclare(topic, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(queue, "", topic, false, nil); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	deliver := func(b topology.Binding) bool {
		return b.Exchange == r.prefix+".deliver" && b.Destination == queue && b.Key == queue && !b.ToExchange
	}
	application := []ops.Left{{Name: queue, Kind: "queue", Why: ops.LeftApplication}, {Name: topic, Kind: "exchange", Why: ops.LeftApplication}}
	for _, dry := range []bool{true, false} {
		res, err := r.ops.Teardown(ctx, ops.TeardownOptions{DryRun: dry})
		if err != nil || !slices.ContainsFunc(res.BindingList, deliver) || res.Bindings != 2 || len(res.BindingList) != 2 || !slices.Equal(res.Left[len(res.Left)-2:], application) {
			t.Fatalf("teardown (dry run %v): %v %+v", dry, err, res)
		}
		if slices.ContainsFunc(res.BindingList, func(b topology.Binding) bool { return b.Exchange == topic }) {
			t.Errorf("teardown (dry run %v) counts the application's binding %s -> %s: %+v", dry, topic, queue, res.BindingList)
		}
		if exists(t, r.prefix+".deliver", true) == !dry {
			t.Errorf("teardown (dry run %v): the delivery exchange exists: %v", dry, !dry)
		}
	}
	if !exists(t, queue, false) || !exists(t, topic, true) {
		t.Error("teardown removed the work queue or the application's exchange")
	}
	out, err := brokertest.Ctl(ctx, "-q", "list_bindings", "source_name", "destination_name", "--no-table-headers")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), r.prefix+".deliver\t") || !strings.Contains(string(out), topic+"\t"+queue) {
		t.Errorf("after teardown, the bindings to %s:\n%s", queue, out)
	}
}

// TestWaitingOnDelayedExchangeRefuses (issue 33): on delayed-exchange, list, retry
// now and purge of the waiting retries reported "0 of 0" (or asked for rabbitmqctl).
// They refuse, saying why, naming the backend's exchange and what to do.
func TestWaitingOnDelayedExchangeRefuses(t *testing.T) {
	r := newRigWith(t, amqpretry.Config{Backend: delay.DelayedExchange()}, "orders")
	if _, err := brokertest.Ctl(context.Background(), "-q", "list_queues", "name"); err == nil {
		r.cfg.Rabbitmqctl = brokertest.Ctl
		o, err := ops.New(r.cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer o.Close()
		r.ops = o
	}
	ctx := context.Background()
	check := func(what string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), "the delayed-message plugin offers no way to list, bring back or drop the retries it keeps") || !strings.Contains(err.Error(), r.prefix+".delayed") || !strings.Contains(err.Error(), "amqpretry status") {
			t.Errorf("%s on delayed-exchange: %v", what, err)
		}
	}
	_, err := r.ops.List(ctx, ops.Waiting, ops.ListOptions{})
	check("list", err)
	_, err = r.ops.Redrive(ctx, ops.Waiting, ops.MoveOptions{Filter: ops.Filter{Queue: r.queues[0]}, DryRun: true})
	check("retry now", err)
	_, err = r.ops.Purge(ctx, ops.Waiting, ops.MoveOptions{All: true, DryRun: true})
	check("purge", err)
}

// TestTeardownBehindQueues (issue 48): the behind queues of blocked order keys are
// under the prefix and belong to the configuration in use, whatever its backend: a
// teardown leaves them, named as shared; with Shared it refuses while messages wait
// behind a key, naming the fix (release the keys), and once none waits it removes
// them with the rest. Without rabbitmqctl, Shared says they could not be looked for.
func TestTeardownBehindQueues(t *testing.T) {
	t.Parallel()
	r := waitingRig(t, amqpretry.Config{Backend: delay.TTLTiers(waitDelay)}, "orders")
	queue := r.queues[0]
	full := names.Names{Prefix: r.prefix}.Behind(queue, "acc-1")
	empty := names.Names{Prefix: r.prefix}.Behind(queue, "acc-2")
	brokertest.Cleanup(t, []string{full, empty}, nil)
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	for key, q := range map[string]string{"acc-1": full, "acc-2": empty} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table(declare.BehindQueue(q, queue, key).Args)); err != nil {
			t.Fatal(err)
		}
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		dc, err := ch.PublishWithDeferredConfirmWithContext(t.Context(), "", full, true, false, amqp.Publishing{Body: []byte("e"), DeliveryMode: amqp.Persistent})
		if err != nil || !dc.Wait() {
			t.Fatalf("publish behind acc-1: %v", err)
		}
	}
	ctx := context.Background()
	res, err := r.ops.Teardown(ctx, ops.TeardownOptions{DryRun: true})
	shared := []ops.Left{{Name: full, Kind: "queue", Why: ops.LeftShared}, {Name: empty, Kind: "queue", Why: ops.LeftShared}}
	if err != nil || slices.Contains(res.Queues, full) || slices.Contains(res.Queues, empty) ||
		!slices.ContainsFunc(res.Left, func(l ops.Left) bool { return l == shared[0] }) || !slices.ContainsFunc(res.Left, func(l ops.Left) bool { return l == shared[1] }) {
		t.Fatalf("teardown without Shared: %v %+v", err, res)
	}
	for _, dry := range []bool{true, false} {
		res, err = r.ops.Teardown(ctx, ops.TeardownOptions{Shared: true, DryRun: dry})
		if err == nil || !strings.Contains(err.Error(), "teardown refused: messages wait in "+full+": 2; for the messages behind blocked order keys ("+r.prefix+".behind.*): release the keys first (`amqpretry blocked list` shows them, `amqpretry blocked release` releases one)") ||
			strings.Contains(err.Error(), "retry-now") || res.Waiting[full] != 2 || !slices.Contains(res.Queues, empty) {
			t.Fatalf("teardown with Shared (dry run %v) while 2 wait behind a key: %v %+v", dry, err, res)
		}
	}
	if !exists(t, full, false) || !exists(t, empty, false) {
		t.Fatal("a refused teardown removed a behind queue")
	}
	blind, err := ops.New(ops.Config{URI: brokertest.URI(), Retry: r.cfg.Retry})
	if err != nil {
		t.Fatal(err)
	}
	defer blind.Close()
	if res, err := blind.Teardown(ctx, ops.TeardownOptions{Shared: true, DryRun: true, Force: true}); err != nil || !slices.Contains(res.Unsearched, r.prefix+".behind.*") {
		t.Errorf("teardown with Shared, without rabbitmqctl: %v, unsearched %v", err, res.Unsearched)
	}
	if _, err := ch.QueuePurge(full, false); err != nil {
		t.Fatal(err)
	}
	// The broker's counts lag its stats interval: until they show the queue empty,
	// teardown still refuses.
	waitFor(t, 30*time.Second, func() bool {
		_, err = r.ops.Teardown(ctx, ops.TeardownOptions{Shared: true, DryRun: true})
		return err == nil
	})
	if res, err = r.ops.Teardown(ctx, ops.TeardownOptions{Shared: true}); err != nil || !slices.Contains(res.Queues, full) || !slices.Contains(res.Queues, empty) {
		t.Fatalf("teardown with Shared, nothing behind: %v %+v", err, res)
	}
	if exists(t, full, false) || exists(t, empty, false) {
		t.Error("a behind queue is still there")
	}
}
