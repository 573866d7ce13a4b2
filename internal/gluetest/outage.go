package gluetest

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
)

// OutageIsNotAPoison: the scenario of issue 41, scaled to a test. Messages flow at a
// steady rate; one in 25 is bad for good (Permanent), one in 5 fails once at random;
// and in the middle the handler's dependency is down for longer than the whole retry
// schedule. With outage detection (the default), the outage poisons nothing, every
// Permanent message is poisoned, nothing is lost, the handler runs while down are
// bounded by the threshold and the probes (not by the traffic), and the fail-once
// messages begin no outage of their own. On ttl-tiers and binary-levels on any broker,
// and on delayed-retry and held retries on RabbitMQ 4.3.
func OutageIsNotAPoison(t *testing.T, m Major) {
	for _, tc := range []struct {
		name    delay.Backend
		held    int
		need43  bool
		quorum  bool
		variant string
	}{
		{name: delay.TTLTiers},
		{name: delay.BinaryLevels},
		{name: delay.DelayedRetry, need43: true, quorum: true},
		{name: delay.TTLTiers, held: 2, need43: true, quorum: true, variant: "+held"},
	} {
		t.Run(string(tc.name)+tc.variant, func(t *testing.T) {
			if tc.need43 {
				need43(t)
			}
			s := newSetup(t, m, tc.name)
			if tc.quorum {
				s.sub.QueueArgs = quorum
			}
			s.cfg.HeldRetries = tc.held
			s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3, InitialInterval: 500 * time.Millisecond, MaxInterval: time.Second, NoJitter: true}
			if tc.name == delay.DelayedRetry {
				s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3}
				s.cfg.DelayedRetryDelay = 500 * time.Millisecond
			} else {
				s.cfg.Tiers = []time.Duration{500 * time.Millisecond, time.Second}
			}
			s.cfg.Outage = amqpretry.Outage{ProbeInterval: 200 * time.Millisecond, MaxProbeInterval: time.Second}
			obs := &events{}
			s.cfg.Observe = obs.observe
			r := newRetry(t, m, s.sub, s.cfg)

			const total = 120
			var down atomic.Bool
			var runsDown atomic.Int64
			var mu sync.Mutex
			succeeded := map[string]bool{}
			failedOnce := map[string]bool{}
			handle := func(msg *message.Message) error {
				i, _ := strconv.Atoi(msg.UUID[1:])
				if i%25 == 0 {
					return amqpretry.Permanent(errors.New("malformed"))
				}
				if down.Load() {
					runsDown.Add(1)
					return errors.New("dial tcp 10.0.0.5:5432: connection refused")
				}
				mu.Lock()
				defer mu.Unlock()
				if i%5 == 1 && !failedOnce[msg.UUID] {
					failedOnce[msg.UUID] = true
					return errFlaky
				}
				succeeded[msg.UUID] = true
				return nil
			}
			run(t, m, r, s.topic, handle)
			pub := m.Publisher(t, Sub{URI: brokertest.URI()})
			// 40 a second; the dependency is down from message 30 to message 90 and
			// a while after: longer than the whole retry schedule (0.5 s + 1 s).
			for i := range total {
				switch i {
				case 30:
					down.Store(true)
				}
				if err := pub.Publish(s.topic, message.NewMessage(fmt.Sprintf("m%03d", i), []byte("booking"))); err != nil {
					t.Fatal(err)
				}
				time.Sleep(25 * time.Millisecond) // pacing the traffic, not a wait for a result
				if i == 90 {
					waitFor(t, 10*time.Second, "the outage to begin", func() bool { return len(obs.of(amqpretry.EventOutageStarted)) > 0 })
					time.Sleep(2 * time.Second) // the outage lasts beyond the retry schedule
					down.Store(false)
				}
			}
			wantOK := 0
			for i := range total {
				if i%25 != 0 {
					wantOK++
				}
			}
			waitFor(t, 60*time.Second, "every good message handled", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(succeeded) == wantOK
			})
			perm := total / 25
			if total%25 != 0 {
				perm++
			}
			waitFor(t, 20*time.Second, "the permanent ones poisoned", func() bool { return r.Stats().Poisoned >= int64(perm) })
			poisonedIDs := map[string]amqpretry.Reason{}
			for range perm {
				msg := poisoned(t, s.prefix+".poison", 10*time.Second)
				poisonedIDs[msg.UUID] = middleware.ReadEnvelope(msg.Metadata).Reason
			}
			for id, reason := range poisonedIDs {
				if i, _ := strconv.Atoi(id[1:]); i%25 != 0 || reason != amqpretry.ReasonPermanent {
					t.Errorf("poisoned %s for %s: only the Permanent ones may be", id, reason)
				}
			}
			if st := r.Stats(); st.Poisoned != int64(perm) {
				t.Errorf("poisoned %d, want the %d Permanent ones", st.Poisoned, perm)
			}
			started, ended, probes := obs.of(amqpretry.EventOutageStarted), obs.of(amqpretry.EventOutageEnded), obs.of(amqpretry.EventProbe)
			if len(started) != 1 || len(ended) != 1 {
				t.Errorf("outages started %d, ended %d; want exactly one each (the fail-once fifth begins none)", len(started), len(ended))
			}
			// Before the outage begins: the first-attempt failures until a retry
			// fails (the retry delay's worth of traffic, 0.5 s at 40 a second, and
			// the threshold), then the probes. Not one run per message per attempt.
			bound := int64(s.cfg.WithDefaults().Outage.Consecutive + 40 + len(probes) + 5)
			t.Logf("%s: handler runs while down %d (bound %d), probes %d, retries %d, outage lasted %v",
				tc.name, runsDown.Load(), bound, len(probes), r.Stats().Retries, durations(ended))
			if got := runsDown.Load(); got > bound {
				t.Errorf("handler ran %d times while down, want at most %d: the threshold, a retry delay of traffic and the probes", got, bound)
			}
		})
	}
}

func durations(evs []amqpretry.Event) []time.Duration {
	var out []time.Duration
	for _, ev := range evs {
		out = append(out, ev.Duration.Round(time.Millisecond))
	}
	return out
}
