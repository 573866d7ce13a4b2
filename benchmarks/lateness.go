package main

import (
	"context"
	"fmt"
	"time"
)

// Lateness: for every backend benchBackends() lists, N retries with delays 1 s to 10 s
// (retry i waits (i mod 10) + 1 s), scheduled from several goroutines through the
// backend's Publish, read back from the work queue by a plain consumer. Lateness is the
// time a retry was read minus its due time, the keys.Due schedule recorded (the
// hand-off time plus the effective delay). ttl-tiers gets tiers 1s..10s, so its
// effective delay is the requested one.

var latenessTiers = func() []time.Duration {
	t := make([]time.Duration, 10)
	for i := range t {
		t[i] = time.Duration(i+1) * time.Second
	}
	return t
}()

type latenessDetail struct {
	q        quantiles
	min      float64 // ms; negative means early
	received int
}

func runLateness(ctx context.Context, e *env, rep *report) error {
	for _, name := range benchBackends() {
		d, skip, err := e.latenessOne(ctx, name)
		switch {
		case err != nil:
			rep.results.LatenessMS[name] = map[string]string{"error": err.Error()}
			fmt.Printf("   %-18s FAILED: %v\n", name, err)
			rep.noteFailure(fmt.Errorf("lateness %s: %w", name, err))
		case skip != "":
			rep.results.LatenessMS[name] = skipped{skip}
			rep.latenessSkipped = append(rep.latenessSkipped, name)
			fmt.Printf("   %-18s skipped: %s\n", name, skip)
		default:
			rep.results.LatenessMS[name] = d.q
			rep.lateness = append(rep.lateness, namedLateness{name, d})
			fmt.Printf("   %-18s p50 %7.1f  p95 %7.1f  p99 %7.1f  max %7.1f  min %7.1f ms (%d retries)\n",
				name, d.q.P50, d.q.P95, d.q.P99, d.q.Max, d.min, d.received)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	return nil
}

func (e *env) latenessOne(ctx context.Context, name string) (*latenessDetail, string, error) {
	n := e.sz.latenessN
	r, skip, err := e.newRig(name, "lat", latenessTiers)
	if err != nil || skip != "" {
		return nil, skip, err
	}
	defer r.close()
	c, err := e.consume(r.queue, 2*n)
	if err != nil {
		return nil, "", err
	}
	defer c.close()

	err = parallel(ctx, n, e.sz.publishWorkers, func(i int) error {
		return r.schedule(fmt.Sprintf("lat-%04d", i), time.Duration(i%10+1)*time.Second)
	})
	if err != nil {
		return nil, "", err
	}
	deadline := time.After(10*time.Second + time.Minute)
	seen := map[string]bool{}
	var late []time.Duration
	for len(seen) < n {
		a, err := c.next(ctx, deadline)
		if err != nil {
			return nil, "", fmt.Errorf("%d of %d retries back: %w", len(seen), n, err)
		}
		if seen[a.msg.UUID] { // a duplicate (at least once): its first arrival counts
			continue
		}
		seen[a.msg.UUID] = true
		due, err := dueOf(a.msg)
		if err != nil {
			return nil, "", err
		}
		late = append(late, a.at.Sub(due))
	}
	lo := late[0]
	for _, l := range late {
		lo = min(lo, l)
	}
	return &latenessDetail{q: quantilesOf(late), min: ms(lo), received: len(late)}, "", nil
}
