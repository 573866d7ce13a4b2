package delay_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
)

// TestDelayedExchangeShutdownWindow reproduces the window the README documents for the
// delayed-exchange backend: the plugin routes a message that comes due fire-and-forget,
// so retries due while the broker stops its application may be lost (measured 15 of
// 3,000). It schedules 3,000 confirmed retries whose due times span a stop_app and
// start_app, counts what reaches the work queue, and holds the loss to the README's
// bound of 1%. ttl-tiers and binary-levels lose nothing in the same situation
// (TestConformanceSurvivesBrokerRestart and the no-loss test).
func TestDelayedExchangeShutdownWindow(t *testing.T) {
	brokertest.RequireRestart(t)
	r := newRig(t, backendCase{name: delay.BackendDelayedExchange, precision: time.Second, durable: true, skip: skipWithoutPlugin})
	const n = 3000
	start := time.Now()
	for i := range n {
		// Due from 3 s on, one per millisecond: the restart begins while they come due.
		due := 3*time.Second + time.Duration(i)*time.Millisecond - time.Since(start)
		r.schedule(r.queue, fmt.Sprintf("w-%d", i), max(due, time.Millisecond))
	}
	time.Sleep(3*time.Second + n*time.Millisecond/2 - time.Since(start))
	restartBroker(t)

	// Everything not lost is due by now; wait until the work queue stops growing.
	got, last := 0, -1
	for deadline := time.Now().Add(time.Minute); got != last && time.Now().Before(deadline); {
		last = got
		time.Sleep(2 * time.Second)
		got = brokertest.QueueLength(t, r.queue)
	}
	lost := n - got
	t.Logf("delayed-exchange: %d of %d retries due across stop_app/start_app reached the work queue, %d lost", got, n, lost)
	if lost < 0 || lost > n/100 {
		t.Errorf("lost %d of %d, outside the README's bound of 1%%", lost, n)
	}
}
