package main

import (
	"context"
	"fmt"
	"time"

	"github.com/amqpretry/amqpretry/delay"
)

// RSS: the growth of this process's resident memory (VmRSS from /proc/self/status,
// each read after a full GC that returns freed memory to the OS) from before to after
// N retries were scheduled through ttl-tiers, while all N wait in its 10 min tier. The
// broker keeps them; the process should keep nothing per waiting message.

type rssDetail struct {
	n             int
	before, after float64 // MiB
}

const mib = 1 << 20

func runRSS(ctx context.Context, e *env, rep *report) error {
	n := e.sz.rssN
	long := 10 * time.Minute
	r, skip, err := e.newRig(delay.TTLTiers().Name(), "rss", []time.Duration{long})
	if err != nil {
		return err
	}
	if skip != "" {
		return fmt.Errorf("ttl-tiers cannot be built: %s", skip)
	}
	defer r.close()

	before, err := rssBytes()
	if err != nil {
		return err
	}
	err = parallel(ctx, n, 2*e.sz.publishWorkers, func(i int) error {
		return r.schedule(fmt.Sprintf("rss-%06d", i), long)
	})
	if err != nil {
		return err
	}
	after, err := rssBytes()
	if err != nil {
		return err
	}
	conn, err := r.h.Connection()
	if err != nil {
		return err
	}
	tier := e.name("rss", delay.TTLTiers().Name(), "delay", tierName(long))
	depth, err := queueDepth(conn, tier)
	if err != nil {
		return err
	}
	if depth < n {
		return fmt.Errorf("tier queue %s has %d messages, want %d", tier, depth, n)
	}
	d := &rssDetail{n: n, before: float64(before) / mib, after: float64(after) / mib}
	rep.rss = d
	rep.results.RSSGrowthMB = ptr(round(d.after-d.before, 1))
	fmt.Printf("   VmRSS %.1f MiB before, %.1f MiB with %d retries waiting in %s: %+.1f MiB\n",
		d.before, d.after, depth, tier, d.after-d.before)
	return nil
}
