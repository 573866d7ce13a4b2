package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/topology"
)

// Head of line: L retries of a long delay (10 min) are scheduled first, then one 1 s
// retry, the probe. The figure is the probe's lateness: the time it was read from the
// work queue minus its due time. Every backend benchBackends() lists is measured
// (ttl-tiers with tiers 1s and 10m), and so is the baseline the seeds describe: ONE
// classic wait queue with per-message TTL (`expiration`) dead-lettering to the work
// queue. RabbitMQ expires messages only at the head of a queue, so the baseline's probe
// waits for the long messages ahead of it; quick mode gives those a shorter delay (20 s)
// and the key names it.

const probeDelay = time.Second

func runHeadOfLine(ctx context.Context, e *env, rep *report) error {
	for _, name := range benchBackends() {
		late, skip, err := e.headOfLineOne(ctx, name)
		switch {
		case err != nil:
			rep.results.HeadOfLineMS[name] = map[string]string{"error": err.Error()}
			fmt.Printf("   %-18s FAILED: %v\n", name, err)
			rep.noteFailure(fmt.Errorf("head of line %s: %w", name, err))
		case skip != "":
			rep.results.HeadOfLineMS[name] = skipped{skip}
			fmt.Printf("   %-18s skipped: %s\n", name, skip)
		default:
			rep.results.HeadOfLineMS[name] = ms(late)
			rep.headOfLine = append(rep.headOfLine, namedValue{name, ms(late)})
			fmt.Printf("   %-18s 1 s retry behind %d of %s: %.1f ms late\n", name, e.sz.holLong, tierName(e.sz.holLongDelay), ms(late))
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	late, err := e.headOfLineBaseline(ctx)
	if err != nil {
		return fmt.Errorf("per-message TTL baseline: %w", err)
	}
	key := baselineKey(e.sz.baselineDelay)
	rep.results.HeadOfLineMS[key] = ms(late)
	rep.headOfLine = append(rep.headOfLine, namedValue{key, ms(late)})
	fmt.Printf("   %-18s 1 s retry behind %d of %s in one per-message-TTL queue: %.1f ms late\n",
		"baseline", e.sz.holLong, tierName(e.sz.baselineDelay), ms(late))
	return nil
}

func baselineKey(long time.Duration) string {
	return "per-message-ttl-baseline-behind-" + tierName(long)
}

func (e *env) headOfLineOne(ctx context.Context, name string) (time.Duration, string, error) {
	r, skip, err := e.newRig(name, "hol", []time.Duration{probeDelay, e.sz.holLongDelay})
	if err != nil || skip != "" {
		return 0, skip, err
	}
	defer r.close()
	c, err := e.consume(r.queue, e.sz.holLong+10)
	if err != nil {
		return 0, "", err
	}
	defer c.close()

	err = parallel(ctx, e.sz.holLong, e.sz.publishWorkers, func(i int) error {
		return r.schedule(fmt.Sprintf("hol-long-%04d", i), e.sz.holLongDelay)
	})
	if err != nil {
		return 0, "", err
	}
	if err := r.schedule("hol-probe", probeDelay); err != nil {
		return 0, "", err
	}
	late, err := waitProbe(ctx, c, "hol-probe", time.After(2*time.Minute), nil)
	return late, "", err
}

// waitProbe reads arrivals until the probe; its lateness is measured from due, or from
// the keys.Due metadata when due is nil.
func waitProbe(ctx context.Context, c *consumer, id string, deadline <-chan time.Time, due *time.Time) (time.Duration, error) {
	for {
		a, err := c.next(ctx, deadline)
		if err != nil {
			return 0, fmt.Errorf("probe not back: %w", err)
		}
		if a.msg.UUID != id {
			continue // the baseline's long messages, expired ahead of the probe
		}
		if due == nil {
			d, err := dueOf(a.msg)
			if err != nil {
				return 0, err
			}
			due = &d
		}
		return a.at.Sub(*due), nil
	}
}

func (e *env) headOfLineBaseline(ctx context.Context) (time.Duration, error) {
	conn, err := e.dial()
	if err != nil {
		return 0, err
	}
	defer conn.Close() //nolint:errcheck
	work, wait := e.name("hol", "baseline", "work"), e.name("hol", "baseline", "wait")
	err = e.declare(conn, topology.Topology{Queues: []topology.Queue{
		{Name: work},
		{Name: wait, Args: amqp.Table{declare.DeadLetterExchangeArg: "", deadLetterRoutingKeyArg: work}},
	}})
	if err != nil {
		return 0, err
	}
	c, err := e.consume(work, e.sz.holLong+10)
	if err != nil {
		return 0, err
	}
	defer c.close()

	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	defer ch.Close() //nolint:errcheck
	if err := ch.Confirm(false); err != nil {
		return 0, err
	}
	publish := func(id string, ttl time.Duration) error {
		p, err := wamqp.DefaultMarshaler{}.Marshal(message.NewMessage(id, []byte(id)))
		if err != nil {
			return err
		}
		p.Expiration = strconv.FormatInt(ttl.Milliseconds(), 10)
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", wait, true, false, p)
		if err != nil {
			return err
		}
		if ok, err := dc.WaitContext(ctx); err != nil || !ok {
			return fmt.Errorf("publish %s not confirmed (%v)", id, err)
		}
		return nil
	}
	for i := range e.sz.holLong {
		if err := publish(fmt.Sprintf("base-long-%04d", i), e.sz.baselineDelay); err != nil {
			return 0, err
		}
	}
	due := time.Now().Add(probeDelay) // as a backend stamps it: before the publish
	if err := publish("base-probe", probeDelay); err != nil {
		return 0, err
	}
	return waitProbe(ctx, c, "base-probe", time.After(e.sz.baselineDelay+2*time.Minute), &due)
}
