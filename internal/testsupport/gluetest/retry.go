package gluetest

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
)

// ScenarioFailThreeTimesThenSucceed is the retry scenario every copying backend must
// pass, changing only the backend name.
func ScenarioFailThreeTimesThenSucceed(t *testing.T, m Major) {
	policyDelays := []time.Duration{300 * time.Millisecond, 1500 * time.Millisecond, 3 * time.Second}
	const precision = 1500 * time.Millisecond
	for _, name := range []delay.Backend{delay.TTLTiers(), delay.BinaryLevels(0), delay.DelayedExchange(), delay.Memory(nil)} {
		t.Run(name.Name(), func(t *testing.T) {
			if testing.Short() && name.Name() != (delay.TTLTiers()).Name() {
				t.Skip("one backend in the quick loop (go test -short)")
			}
			s := newSetup(t, m, name)
			s.cfg.Policy = amqpretry.Policy{MaxAttempts: 5, Delays: policyDelays, Jitter: -1}
			r := newRetry(t, m, s.sub, s.cfg)
			sized, err := backend.Open(s.cfg.Backend, backend.Setup{Prefix: s.prefix})
			if err != nil {
				t.Fatal(err)
			}
			rec := newRecorder(failFirst(3))
			run(t, m, r, s.topic, rec.handle, rec.settle)
			publish(t, m, s.topic, "m1")

			rec.waitSettled(t, 4, 30*time.Second)
			wantStats(t, r, 3, 0) // so no fifth delivery can come
			calls := rec.snapshot()
			if len(calls) != 4 {
				t.Fatalf("handled %d times, want 4", len(calls))
			}
			for i, c := range calls {
				if got := amqpretry.Attempt(c.msg); got != i+1 {
					t.Errorf("call %d saw attempt %d", i+1, got)
				}
				if c.msg.UUID != "m1" || string(c.msg.Payload) != "payload of m1" {
					t.Errorf("call %d got message %s %q", i+1, c.msg.UUID, c.msg.Payload)
				}
			}
			for i := 1; i < len(calls); i++ {
				want, err := sized.Effective(policyDelays[i-1])
				if err != nil {
					t.Fatal(err)
				}
				if got := middleware.ReadEnvelope(calls[i].msg.Metadata).EffectiveDelay; got != want {
					t.Errorf("retry %d: effective delay %s, want %s (policy %s after snapping)", i, got, want, policyDelays[i-1])
				}
				gap := calls[i].at.Sub(calls[i-1].at)
				if gap < want-50*time.Millisecond || gap > want+precision {
					t.Errorf("retry %d came %s after the failure, want %s (+ up to %s)", i, gap, want, precision)
				}
			}
			if name.Name() == (delay.TTLTiers()).Name() {
				// The retries were dead-lettered by the broker: the subscriber consumed
				// them (instead of nacking them forever for their x-death array), and
				// the first death is there for diagnostics.
				info, err := xdeath.FromMetadata(calls[1].msg.Metadata)
				if err != nil {
					t.Fatal(err)
				}
				if info.FirstReason != "expired" {
					t.Errorf("retry carries no expired first death: %+v", info)
				}
				if _, ok := calls[1].msg.Metadata[keys.XDeath]; ok {
					t.Error("x-death was carried into metadata: it is encoded only to be dropped")
				}
			}
		})
	}
}

func PoisonAfterMaxAttemptsWithEnvelope(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Policy = amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(*message.Message) error { return fmt.Errorf("charge card: %w", errFlaky) })
	run(t, m, r, s.topic, rec.handle)
	publish(t, m, s.topic, "doomed")

	msg := poisoned(t, s.prefix+".poison", 30*time.Second)
	if n := len(rec.snapshot()); n != 3 {
		t.Errorf("handled %d times before poisoning, want 3", n)
	}
	env := middleware.ReadEnvelope(msg.Metadata)
	want := middleware.Envelope{
		Attempt: 3, MaxAttempts: 3, Reason: amqpretry.ReasonMaxAttempts,
		Error: "charge card: flaky downstream", ErrorTypes: []string{"*fmt.wrapError", "*errors.errorString"},
		Handler: "handler-" + s.topic, Topic: s.topic, Queue: s.topic,
		OriginalExchange: "", OriginalRoutingKey: s.topic,
		FirstFailure: env.FirstFailure, LastFailure: env.LastFailure,
	}
	if fmt.Sprint(env) != fmt.Sprint(want) {
		t.Errorf("envelope\n%+v\nwant\n%+v", env, want)
	}
	if !env.LastFailure.After(env.FirstFailure) {
		t.Errorf("first/last failure %v / %v", env.FirstFailure, env.LastFailure)
	}
	if msg.UUID != "doomed" || string(msg.Payload) != "payload of doomed" {
		t.Errorf("poisoned message is %s %q", msg.UUID, msg.Payload)
	}
	// Nothing of the last retry hop is left on it.
	for _, k := range []string{keys.Tier, keys.Due, keys.RequestedDelay, keys.EffectiveDelay, wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
		if v, ok := msg.Metadata[k]; ok {
			t.Errorf("poisoned copy keeps %s = %q from its last retry", k, v)
		}
	}
}

func PermanentErrorPoisonsOnFirstFailure(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(*message.Message) error { return amqpretry.Permanent(errors.New("malformed order")) })
	run(t, m, r, s.topic, rec.handle, rec.settle)
	publish(t, m, s.topic, "bad")

	msg := poisoned(t, s.prefix+".poison", 30*time.Second)
	if got := middleware.ReadEnvelope(msg.Metadata).Reason; got != amqpretry.ReasonPermanent {
		t.Errorf("reason %q, want permanent", got)
	}
	rec.waitSettled(t, 1, 10*time.Second)
	wantStats(t, r, 0, 1)
	if n := len(rec.snapshot()); n != 1 {
		t.Errorf("handled %d times, want 1", n)
	}
}

func RetryAfterIsHonoured(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Policy = amqpretry.Policy{Delays: []time.Duration{time.Millisecond}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(msg *message.Message) error {
		if amqpretry.Attempt(msg) == 1 {
			return amqpretry.RetryAfter(errors.New("429 too many requests"), 1800*time.Millisecond)
		}
		return nil
	})
	run(t, m, r, s.topic, rec.handle)
	publish(t, m, s.topic, "throttled")

	calls := rec.waitCalls(t, 2, 30*time.Second)
	env := middleware.ReadEnvelope(calls[1].msg.Metadata)
	if env.RequestedDelay != 1800*time.Millisecond || env.EffectiveDelay != 2*time.Second {
		t.Errorf("requested/effective = %s/%s, want 1.8s/2s", env.RequestedDelay, env.EffectiveDelay)
	}
	if gap := calls[1].at.Sub(calls[0].at); gap < 2*time.Second-50*time.Millisecond {
		t.Errorf("retry came back after %s, before the Retry-After", gap)
	}
}

// FanoutRetryReachesOnlyTheFailingQueue: a pub/sub topic with two subscriber queues;
// only one handler fails, and only its queue sees the retry.
func FanoutRetryReachesOnlyTheFailingQueue(t *testing.T, m Major) {
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	topic := prefix + ".events"
	recs := map[string]*recorder{}
	retries := map[string]Retry{}
	for _, group := range []string{"billing", "shipping"} {
		cfg := amqpretry.Config{Prefix: prefix, Backend: delay.TTLTiers(500 * time.Millisecond), Policy: amqpretry.Policy{Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}, Logger: Logger()}
		r := newRetry(t, m, Sub{URI: brokertest.URI(), Group: group}, cfg)
		recs[group] = newRecorder(failFirst(0))
		if group == "billing" {
			recs[group] = newRecorder(failFirst(1))
		}
		retries[group] = r
		run(t, m, r, topic, recs[group].handle, recs[group].settle)
		brokertest.Cleanup(t, []string{topic + "_" + group}, nil)
	}
	brokertest.Cleanup(t, []string{prefix + ".poison"}, []string{topic})

	pub := m.Publisher(t, Sub{URI: brokertest.URI(), Group: "publisher"})
	if err := pub.Publish(topic, message.NewMessage("evt", nil)); err != nil {
		t.Fatal(err)
	}
	recs["billing"].waitSettled(t, 2, 30*time.Second)
	recs["shipping"].waitSettled(t, 1, 30*time.Second)
	wantStats(t, retries["billing"], 1, 0)
	wantStats(t, retries["shipping"], 0, 0)
	if n := brokertest.QueueLength(t, prefix+".delay.500ms"); n != 0 {
		t.Errorf("%d retries still waiting", n)
	}
	if n := len(recs["billing"].snapshot()); n != 2 {
		t.Errorf("billing handled %d times, want 2", n)
	}
	if n := len(recs["shipping"].snapshot()); n != 1 {
		t.Errorf("shipping handled %d times, want 1: a retry leaked to another subscriber group", n)
	}
}

// DeletedDelayExchangeIsDeclaredAgainAtTheFirstHandoff removes the delay exchange
// under a running router: the first hand-off finds it gone (404), declares the
// backend's topology again and goes through, so the message is retried once, as if
// nothing had happened, and nothing is parked.
func DeletedDelayExchangeIsDeclaredAgainAtTheFirstHandoff(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	s.cfg.Policy = amqpretry.Policy{Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}
	r := newRetry(t, m, s.sub, s.cfg)

	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDelete(s.prefix+".delay", false, false); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder(failFirst(1))
	run(t, m, r, s.topic, rec.handle)
	publish(t, m, s.topic, "survivor")

	calls := rec.waitCalls(t, 2, 30*time.Second)
	for i, c := range calls {
		if got := amqpretry.Attempt(c.msg); got != i+1 {
			t.Errorf("call %d saw attempt %d, want %d", i+1, got, i+1)
		}
	}
	if err := ch.ExchangeDeclarePassive(s.prefix+".delay", amqp.ExchangeHeaders, true, false, false, false, nil); err != nil {
		t.Errorf("delay exchange not declared again: %v", err)
	}
	if n := brokertest.QueueLength(t, s.prefix+".parking"); n != 0 {
		t.Errorf("%d messages parked", n)
	}
}

// SchedulerParksAMessageFromOtherCode: code other than the middleware schedules a
// delayed message through the backend with Watermill's delay metadata; it arrives at
// its queue after the delay, without that metadata (which would delay it again).
func SchedulerParksAMessageFromOtherCode(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(nil)
	run(t, m, r, s.topic, rec.handle)
	msg := message.NewMessage("scheduled", []byte("later"))
	wdelay.Message(msg, wdelay.For(1500*time.Millisecond))
	start := time.Now()
	if err := scheduler(r).Publish(s.topic, msg); err != nil {
		t.Fatal(err)
	}
	calls := rec.waitCalls(t, 1, 30*time.Second)
	if gap := calls[0].at.Sub(start); gap < 2*time.Second-50*time.Millisecond {
		t.Errorf("arrived after %s, before its tier of 2s", gap)
	}
	for _, k := range []string{wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
		if _, ok := calls[0].msg.Metadata[k]; ok {
			t.Errorf("the scheduled message kept %s", k)
		}
	}
	if len(msg.Metadata[wdelay.DelayedForKey]) == 0 {
		t.Error("Publish modified the caller's message")
	}
}

func TopologyClashNamesQueueAndArgument(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	clash := s.prefix + ".delay.500ms"
	if _, err := ch.QueueDeclare(clash, true, false, false, false, amqp.Table{"x-message-ttl": int32(1234)}); err != nil {
		t.Fatal(err)
	}
	brokertest.Cleanup(t, []string{clash, s.prefix + ".parking"}, []string{s.prefix + ".delay", s.prefix + ".deliver", s.prefix + ".parking"})
	_, err = m.New(s.sub, s.cfg)
	if !errors.Is(err, topology.ErrMismatch) {
		t.Fatalf("New = %v, want ErrMismatch", err)
	}
	for _, want := range []string{clash, "x-message-ttl"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
}

func CredentialsNeverInErrors(t *testing.T, m Major) {
	for _, uri := range []string{
		"amqp://guest:s3cr3t@127.0.0.1:1/",        // nothing listens
		"amqp://guest:s3cr3t@127.0.0.1:notaport/", // unparseable
		"amqp://user:s3cr3t@host:badport/",        // unparseable port, from issue 18
		"amqp//guest:s3cr3t@127.0.0.1/",           // no scheme: url.Parse takes it for a path
	} {
		_, err := m.New(Sub{URI: uri}, amqpretry.Config{})
		if err == nil {
			t.Fatalf("New(%s) succeeded", uri)
		}
		if strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("error leaks the password: %v", err)
		}
	}
	// A broker that answers, a wrong password.
	u := strings.Replace(brokertest.URI(), "guest:guest@", "guest:s3cr3t@", 1)
	if u != brokertest.URI() {
		if _, err := m.New(Sub{URI: u}, amqpretry.Config{}); err == nil || strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("New with a wrong password = %v", err)
		}
	}
}

func InvalidConfigNamesTheField(t *testing.T, m Major) {
	uri := "amqp://guest:guest@127.0.0.1:1/" // validation fails before any dial
	queue := Sub{URI: uri}
	tests := []struct {
		name  string
		sub   Sub
		cfg   amqpretry.Config
		field string
	}{
		{"no broker", Sub{}, amqpretry.Config{}, "Subscriber: Connection.AmqpURI"},
		{"no requeue", Sub{URI: uri, NoRequeueOnNack: true}, amqpretry.Config{}, "Subscriber: Consume.NoRequeueOnNack"},
		{"bad policy", queue, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: -1}}, "MaxAttempts"},
		{"backend setting", queue, amqpretry.Config{Backend: delay.BinaryLevels(30)}, "Levels: 30"},
		{"duplicate tier", queue, amqpretry.Config{Backend: delay.TTLTiers(time.Second, time.Second)}, "Tiers[1]"},
		{"prefix too long", queue, amqpretry.Config{Prefix: strings.Repeat("p", 250)}, "Prefix"},
		{"poison queue too long", queue, amqpretry.Config{PoisonQueue: strings.Repeat("q", 256)}, "PoisonQueue"},
		{"policy past the backend", queue, amqpretry.Config{Backend: delay.BinaryLevels(3)}, "Policy.Delays: delay too long"},
		{"memory without publisher", Sub{}, amqpretry.Config{Backend: delay.Memory(nil)}, "Backend.Publisher"},
		{"unknown topology mode", queue, amqpretry.Config{Topology: "passive"}, "Topology"},
		{"schedule on delayed-retry", queue, amqpretry.Config{Backend: delay.DelayedRetry(0), Policy: amqpretry.Policy{Delays: amqpretry.Exponential(2*time.Second, 2, 10*time.Minute), Jitter: -1}}, "Policy.Delays"},
		{"held retries with immediate", queue, amqpretry.Config{Backend: delay.HeldRetries(2, 0, nil), Policy: amqpretry.Policy{Immediate: 1}}, "HeldRetries"},
		{"held retries on a classic work queue", Sub{URI: uri, QueueArgs: amqp.Table{"x-queue-type": "classic"}}, amqpretry.Config{Backend: delay.HeldRetries(1, 0, nil)}, "Queue.Arguments"},
		{"delayed retry delay below 1ms", queue, amqpretry.Config{Backend: delay.DelayedRetry(time.Microsecond)}, "delay.DelayedRetry(delay)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := m.New(tt.sub, tt.cfg)
			if err == nil || !strings.Contains(err.Error(), "invalid config") || !strings.Contains(err.Error(), tt.field) {
				t.Fatalf("New = %v, want an invalid config error naming %s", err, tt.field)
			}
		})
	}
}

// InvalidConfigTouchesNothingOnTheBroker: a policy the backend cannot serve is refused
// before New connects, so no queue or exchange is declared.
func InvalidConfigTouchesNothingOnTheBroker(t *testing.T, m Major) {
	s := newSetup(t, m, delay.BinaryLevels(4)) // up to 15 s
	s.cfg.Policy = amqpretry.Policy{Delays: []time.Duration{time.Second, 20 * time.Second}, Jitter: -1}
	_, err := m.New(s.sub, s.cfg)
	if !errors.Is(err, delay.ErrDelayTooLong) || !strings.Contains(err.Error(), "invalid config") || !strings.Contains(err.Error(), "Policy") || !strings.Contains(err.Error(), "20s") {
		t.Fatalf("New = %v, want an invalid config error naming Policy and the 20s delay", err)
	}
	conn := brokertest.Dial(t)
	for _, q := range []string{s.prefix + ".poison", s.prefix + ".parking", s.prefix + ".level.0", s.prefix + ".level.3"} {
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDeclarePassive(q, true, false, false, false, nil); err == nil {
			t.Errorf("queue %s was declared by an invalid config", q)
			brokertest.Cleanup(t, []string{q}, nil)
		}
	}
}

// LowDeliveryLimitOnQuorumWorkQueueIsWarned: before RabbitMQ 4.3 a quorum queue
// counts every nack against its delivery limit; a limit below the attempts is logged.
// 4.3 counts nacks apart: nothing is logged there.
func LowDeliveryLimitOnQuorumWorkQueueIsWarned(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	logs := &logCapture{}
	s.cfg.Logger = logs
	s.sub.QueueArgs = amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(2)}
	newRetry(t, m, s.sub, s.cfg)
	v := brokerVersion(t)
	warned := hasLine(logs, watermill.ErrorLogLevel, "Work queues may lose retries", "x-delivery-limit 2")
	switch counts := !version.DelayedRetry(v); {
	case counts && !warned:
		t.Fatalf("RabbitMQ %s: no warning about x-delivery-limit 2 below 5 attempts; error logs: %+v", v, logs.at(watermill.ErrorLogLevel))
	case !counts && warned:
		t.Fatalf("RabbitMQ %s does not count nacks against the delivery limit, but a warning was logged", v)
	}
}

// QuorumWorkQueueWithoutDeadLetterIsWarned: past its delivery limit a quorum work
// queue without a dead-letter exchange drops a message, one no client can read among
// them (UnreadableHeadersEndInThePoisonQueue): New logs it, naming the arguments that
// send it to the poison queue, also where the backend makes the work queue a quorum
// queue (delayed-retry, RabbitMQ 4.3, whose default limit is 20); not with them.
func QuorumWorkQueueWithoutDeadLetterIsWarned(t *testing.T, m Major) {
	for _, tc := range []struct {
		name    string
		backend delay.Backend
		args    amqp.Table
		warned  bool
	}{
		{"limit without dead-letter exchange", delay.TTLTiers(), amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(5)}, true},
		{"limit with dead-letter exchange", delay.TTLTiers(), amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(5), "x-dead-letter-exchange": ""}, false},
		// The subscriber config gives the work queue the poison queue as its
		// dead-letter target (issue 51: logged at ERROR before).
		{"delayed-retry, its subscriber config's dead-letter target", delay.DelayedRetry(0), nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.backend == (delay.DelayedRetry(0)) {
				need43(t)
			}
			s := newSetup(t, m, tc.backend)
			logs := &logCapture{}
			s.cfg.Logger = logs
			s.sub.QueueArgs = tc.args
			newRetry(t, m, s.sub, s.cfg)
			fix := fmt.Sprintf("x-dead-letter-routing-key %q (the poison queue)", s.prefix+".poison")
			if warned := hasLine(logs, watermill.ErrorLogLevel, "Work queues drop what they cannot deliver", fix); warned != tc.warned {
				t.Fatalf("warned %v, want %v; error logs: %+v", warned, tc.warned, logs.at(watermill.ErrorLogLevel))
			}
		})
	}
}
