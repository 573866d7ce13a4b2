package gluetest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
)

// For says how Major.SubscriberFor builds a subscriber of a Retry.
type For struct {
	// GenerateName is given to SubscriberConfigFor; nil: SubscriberConfig().
	GenerateName func(topic string) string
	// Replace, if set, replaces the config's Queue.GenerateName with what it returns
	// of it: what an application does to a copy of the config.
	Replace func(generateName func(topic string) string) func(topic string) string
	// Connection, if set, is the subscriber's amqp091-go config.
	Connection *amqp.Config
}

// The CQRS application of these tests: room bookings.
type (
	bookRoom      struct{ BookingID string }
	cancelBooking struct{ BookingID string }
	roomBooked    struct{ BookingID string }
)

// CQRSHandlersShareOneRetry: Watermill's CQRS component, a queue per handler (two
// command handlers, two event handlers on one event), all retried by one Retry with
// one router-wide Middleware: each handler's subscriber is built from
// SubscriberConfigFor(its queue). Counted on the broker: one hand-off connection for
// the four subscribers. Each handler runs each message as many times as it fails plus
// one, a retry comes back only to the handler that failed, a permanent failure is
// poisoned, and one Stats counts them all.
// On RabbitMQ 4.3 it runs with delayed-retry too: the broker holds the failed delivery
// in the handler's queue, and the event's two handlers get the same message UUID.
func CQRSHandlersShareOneRetry(t *testing.T, m Major) {
	for _, backend := range []delay.Backend{delay.TTLTiers(), delay.DelayedRetry(0)} {
		t.Run(backend.Name(), func(t *testing.T) { cqrsHandlersShareOneRetry(t, m, backend) })
	}
}

func cqrsHandlersShareOneRetry(t *testing.T, m Major, backend delay.Backend) {
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	handoffName, subName := prefix+".handoff", prefix+".sub"
	s := Sub{URI: brokertest.URI(), Group: "bookings", Connection: &amqp.Config{Properties: amqp.Table{"connection_name": handoffName}}}
	cfg := amqpretry.Config{Backend: withTiers(backend, 500*time.Millisecond), Prefix: prefix, Policy: amqpretry.Policy{Delays: []time.Duration{500 * time.Millisecond}, Jitter: -1}, Logger: Logger()}
	if backend == (delay.DelayedRetry(0)) {
		need43(t)
		s.QueueArgs, cfg.Backend = quorum, delay.DelayedRetry(400*time.Millisecond)
		cfg.Policy = amqpretry.Policy{} // the queue's one delay
	}
	r := newRetry(t, m, s, cfg)
	if got, want := cfg.WithDefaults().PoisonQueue, prefix+".poison"; got != want {
		t.Errorf("WithDefaults().PoisonQueue %q, want %q", got, want)
	}

	topic := func(name string) string { return prefix + "." + name }
	queue := func(handler string) func(string) string {
		return func(topic string) string { return topic + "_" + handler }
	}
	marshaler := cqrs.JSONMarshaler{}
	handlers := map[string]string{ // handler: the topic it consumes
		"book": topic(marshaler.Name(&bookRoom{})), "cancel": topic(marshaler.Name(&cancelBooking{})),
		"invoice": topic(marshaler.Name(&roomBooked{})), "notify": topic(marshaler.Name(&roomBooked{})),
	}
	var queues, exchanges []string
	for h, tp := range handlers {
		queues = append(queues, queue(h)(tp))
		exchanges = append(exchanges, tp)
	}
	brokertest.Cleanup(t, queues, exchanges)

	var mu sync.Mutex
	runs := map[string][]int{} // "handler uuid": the attempts it ran with
	ran := func(ctx context.Context, handler string) int {
		msg := cqrs.OriginalMessageFromCtx(ctx)
		attempt := amqpretry.Attempt(msg)
		mu.Lock()
		runs[handler+" "+msg.UUID] = append(runs[handler+" "+msg.UUID], attempt)
		mu.Unlock()
		return attempt
	}
	settled := make(chan string, 100)
	settle := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			defer func() { settled <- message.HandlerNameFromCtx(msg.Context()) }()
			return h(msg)
		}
	}

	pub := m.Publisher(t, Sub{URI: brokertest.URI(), Group: "publisher"})
	generate := func(name string) (string, error) { return topic(name), nil }
	var built sync.WaitGroup
	subscriber := func(handler string) (message.Subscriber, error) {
		defer built.Done()
		return m.SubscriberFor(t, r, For{GenerateName: queue(handler), Connection: &amqp.Config{Properties: amqp.Table{"connection_name": subName}}})
	}
	built.Add(len(handlers))
	var eventBus *cqrs.EventBus
	newRouter(t, func(router *message.Router) {
		var err error
		eventBus, err = cqrs.NewEventBusWithConfig(pub, cqrs.EventBusConfig{
			GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return generate(p.EventName) },
			Marshaler:            marshaler,
		})
		if err != nil {
			t.Fatal(err)
		}
		commands, err := cqrs.NewCommandProcessorWithConfig(router, cqrs.CommandProcessorConfig{
			GenerateSubscribeTopic: func(p cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) {
				return generate(p.CommandName)
			},
			SubscriberConstructor: func(p cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
				return subscriber(p.HandlerName)
			},
			Marshaler: marshaler,
		})
		if err != nil {
			t.Fatal(err)
		}
		events, err := cqrs.NewEventProcessorWithConfig(router, cqrs.EventProcessorConfig{
			GenerateSubscribeTopic: func(p cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) {
				return generate(p.EventName)
			},
			SubscriberConstructor: func(p cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
				return subscriber(p.HandlerName)
			},
			Marshaler: marshaler,
		})
		if err != nil {
			t.Fatal(err)
		}
		err = commands.AddHandlers(
			cqrs.NewCommandHandler("book", func(ctx context.Context, c *bookRoom) error {
				if ran(ctx, "book") < 2 {
					return errFlaky
				}
				return eventBus.Publish(ctx, &roomBooked{BookingID: c.BookingID})
			}),
			cqrs.NewCommandHandler("cancel", func(ctx context.Context, _ *cancelBooking) error {
				ran(ctx, "cancel")
				return amqpretry.Permanent(errors.New("booking already checked in"))
			}),
		)
		if err != nil {
			t.Fatal(err)
		}
		err = events.AddHandlers(
			cqrs.NewEventHandler("invoice", func(ctx context.Context, _ *roomBooked) error {
				if ran(ctx, "invoice") < 3 {
					return errFlaky
				}
				return nil
			}),
			cqrs.NewEventHandler("notify", func(ctx context.Context, _ *roomBooked) error {
				ran(ctx, "notify")
				return nil
			}),
		)
		if err != nil {
			t.Fatal(err)
		}
	}, settle, r.Middleware)
	built.Wait()
	waitConnections(t, subName, func(n int) bool { return n == len(handlers) }, "the four subscribers' connections")
	waitConnections(t, handoffName, func(n int) bool { return n == 1 }, "one hand-off connection")

	bus, err := cqrs.NewCommandBusWithConfig(pub, cqrs.CommandBusConfig{
		GeneratePublishTopic: func(p cqrs.CommandBusGeneratePublishTopicParams) (string, error) { return generate(p.CommandName) },
		Marshaler:            marshaler,
	})
	if err != nil {
		t.Fatal(err)
	}
	const bookings = 3
	for i := range bookings {
		if err := bus.Send(context.Background(), &bookRoom{BookingID: fmt.Sprint(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := bus.Send(context.Background(), &cancelBooking{BookingID: "0"}); err != nil {
		t.Fatal(err)
	}

	// book: 2 runs each; invoice: 3; notify: 1; cancel: 1, poisoned.
	want := map[string]int{"book": 2 * bookings, "invoice": 3 * bookings, "notify": bookings, "cancel": 1}
	got := map[string]int{}
	deadline := time.After(60 * time.Second)
	for n := 0; n < 2*bookings+3*bookings+bookings+1; n++ {
		select {
		case h := <-settled:
			got[h]++
		case <-deadline:
			t.Fatalf("settled %v within 60s, want %v", got, want)
		}
	}
	wantStats(t, r, bookings*(1+2), 1) // so nothing more is on its way
	for h, n := range want {
		if got[h] != n {
			t.Errorf("handler %s settled %d deliveries, want %d", h, got[h], n)
		}
	}
	mu.Lock()
	perHandler := map[string]int{}
	for key, attempts := range runs {
		h, _, _ := strings.Cut(key, " ")
		perHandler[h]++
		wantAttempts := map[string][]int{"book": {1, 2}, "invoice": {1, 2, 3}, "notify": {1}, "cancel": {1}}[h]
		if !slices.Equal(attempts, wantAttempts) {
			t.Errorf("%s ran on attempts %v, want %v", key, attempts, wantAttempts)
		}
	}
	mu.Unlock()
	if want := map[string]int{"book": bookings, "invoice": bookings, "notify": bookings, "cancel": 1}; !mapsEqual(perHandler, want) {
		t.Errorf("messages per handler %v, want %v (none lost)", perHandler, want)
	}
	msg := poisoned(t, prefix+".poison", 10*time.Second)
	if env := middleware.ReadEnvelope(msg.Metadata); env.Reason != amqpretry.ReasonPermanent || env.Queue != queue("cancel")(handlers["cancel"]) {
		t.Errorf("poisoned with reason %q from queue %q, want permanent from %q", env.Reason, env.Queue, queue("cancel")(handlers["cancel"]))
	}
	for _, q := range queues {
		if n := brokertest.QueueLength(t, q); n != 0 {
			t.Errorf("%d messages left in %s", n, q)
		}
	}
}

func mapsEqual(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// MiswiredSubscriberIsRefusedAtSubscribe: a subscriber whose queue the Retry would not
// send retries to is refused when it subscribes, before anything is declared, naming
// the queue and the fix: a copy of SubscriberConfig() with a Queue.GenerateName of its
// own, a config of SubscriberConfigFor whose GenerateName was wrapped, and a
// subscriber with retries on the poison queue.
func MiswiredSubscriberIsRefusedAtSubscribe(t *testing.T, m Major) {
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	r := newRetry(t, m, Sub{URI: brokertest.URI(), Group: "bookings"}, amqpretry.Config{Prefix: prefix, Backend: delay.TTLTiers(time.Second), Logger: Logger()})
	topic := prefix + ".main.roomBooked"
	perHandler := func(topic string) string { return topic + "_invoice" }
	brokertest.Cleanup(t, []string{prefix + ".poison", topic + "_invoice", topic + "_invoice.v2", topic + "_bookings"}, []string{topic, prefix + ".poison"})
	for _, tc := range []struct {
		name  string
		o     For
		topic string
		want  []string // in the error
	}{
		{"copied SubscriberConfig with its own GenerateName", For{Replace: func(func(string) string) func(string) string { return perHandler }},
			topic, []string{`queue "` + topic + `_invoice"`, "SubscriberConfigFor(", "SubscriberConfig()"}},
		{"a queue the Retry would not send retries to", For{GenerateName: perHandler, Replace: func(g func(string) string) func(string) string {
			return func(topic string) string { return g(topic) + ".v2" }
		}}, topic, []string{`queue "` + topic + `_invoice.v2"`, "SubscriberConfigFor("}},
		{"retries on the poison queue", For{GenerateName: func(string) string { return prefix + ".poison" }},
			prefix + ".poison", []string{`queue "` + prefix + `.poison"`, "poison queue", "PoisonSubscriberConfig()"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sub, err := m.SubscriberFor(t, r, tc.o)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			_, err = sub.Subscribe(ctx, tc.topic)
			if err == nil {
				t.Fatal("subscribed, want refused")
			}
			t.Log(err)
			if !errors.Is(err, amqpretry.ErrNotWired) {
				t.Errorf("error %v, want ErrNotWired", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not name %s", err, w)
				}
			}
		})
	}
	if m.Name() == "3" { // the builder knows the topic: it names where retries would go
		sub, err := m.SubscriberFor(t, r, For{GenerateName: perHandler, Replace: func(g func(string) string) func(string) string {
			return func(topic string) string { return g(topic) + ".v2" }
		}})
		if err != nil {
			t.Fatal(err)
		}
		_, err = sub.Subscribe(context.Background(), topic)
		if want := `to queue "` + topic + `_invoice"`; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not say %s", err, want)
		}
	}
	for _, q := range []string{topic + "_invoice", topic + "_invoice.v2"} {
		if queueExists(t, q) {
			t.Errorf("queue %s was declared before the subscriber was refused", q)
		}
	}
}

// queueExists tells whether queue exists on the broker.
func queueExists(t *testing.T, queue string) bool {
	t.Helper()
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ch.Close() }()
	_, err = ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

// PoisonQueueReadFromGo: the poison queue is read, as docs/cqrs.md says, with a
// subscriber built from PoisonSubscriberConfig(), whatever the topic: each message
// carries its Envelope, and an acked one is gone.
func PoisonQueueReadFromGo(t *testing.T, m Major) {
	s := newSetup(t, m, delay.TTLTiers())
	r := newRetry(t, m, s.sub, s.cfg)
	rec := newRecorder(func(*message.Message) error { return amqpretry.Permanent(errors.New("room does not exist")) })
	run(t, m, r, s.topic, rec.handle, rec.settle)
	publish(t, m, s.topic, "room-404")
	rec.waitSettled(t, 1, 30*time.Second)
	wantStats(t, r, 0, 1)

	poison := s.cfg.WithDefaults().PoisonQueue
	sub := m.PoisonSubscriber(t, r)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, "any topic")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case msg := <-msgs:
		env := middleware.ReadEnvelope(msg.Metadata)
		if msg.UUID != "room-404" || env.Reason != amqpretry.ReasonPermanent || env.Queue != s.topic || !strings.Contains(env.Error, "room does not exist") {
			t.Errorf("read %s with envelope %+v, want room-404, permanent, from %s", msg.UUID, env, s.topic)
		}
		msg.Ack()
	case <-ctx.Done():
		t.Fatalf("nothing read from poison queue %s within 30s", poison)
	}
	waitFor(t, 10*time.Second, "the acked message to leave the poison queue", func() bool { return brokertest.QueueLength(t, poison) == 0 })
}

// CQRSWarmingHandlerNeverStallsItsQueue (issue 49): a room-booking app on Watermill's
// CQRS processors, four handlers (book and cancel, commands; invoice and notify, on
// the roomBooked event), each on its own queue, one Retry with outage detection as it
// comes. 100 bookings; invoice fails the first two attempts of a third of its events,
// as a dependency that is slow to warm up does. Its queue must not be taken for one
// whose dependency is down: every message runs once per attempt (the third on 1, 2,
// 3; the others once), nothing is poisoned, and an outage, if one is judged to begin,
// ends at its first probe. Asserted through the Observe events and the counts.
func CQRSWarmingHandlerNeverStallsItsQueue(t *testing.T, m Major) {
	brokertest.Dial(t)
	prefix := brokertest.Prefix(t)
	obs := &events{}
	cfg := amqpretry.Config{
		Backend: delay.TTLTiers(time.Second),
		Prefix:  prefix,
		Policy:  amqpretry.Policy{Delays: []time.Duration{time.Second}, Jitter: -1},
		Observe: obs.observe,
		Logger:  Logger(),
	}
	r := newRetry(t, m, Sub{URI: brokertest.URI(), Group: "bookings"}, cfg)

	topic := func(name string) string { return prefix + "." + name }
	queue := func(handler string) func(string) string {
		return func(topic string) string { return topic + "_" + handler }
	}
	marshaler := cqrs.JSONMarshaler{}
	handlers := map[string]string{ // handler: the topic it consumes
		"book": topic(marshaler.Name(&bookRoom{})), "cancel": topic(marshaler.Name(&cancelBooking{})),
		"invoice": topic(marshaler.Name(&roomBooked{})), "notify": topic(marshaler.Name(&roomBooked{})),
	}
	var queues, exchanges []string
	for h, tp := range handlers {
		queues = append(queues, queue(h)(tp))
		exchanges = append(exchanges, tp)
	}
	brokertest.Cleanup(t, queues, exchanges)

	const bookings, cancellations = 100, 10
	warming := func(id string) bool { // a third of the bookings
		i, _ := strconv.Atoi(id)
		return i%3 == 0
	}
	var mu sync.Mutex
	runs := map[string][]int{} // "handler booking": the attempts it ran on
	ran := func(ctx context.Context, handler, id string) int {
		attempt := amqpretry.Attempt(cqrs.OriginalMessageFromCtx(ctx))
		mu.Lock()
		runs[handler+" "+id] = append(runs[handler+" "+id], attempt)
		mu.Unlock()
		return attempt
	}
	settled := make(chan string, 2*bookings)
	settle := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			defer func() { settled <- message.HandlerNameFromCtx(msg.Context()) }()
			return h(msg)
		}
	}
	pub := m.Publisher(t, Sub{URI: brokertest.URI(), Group: "publisher"})
	generate := func(name string) (string, error) { return topic(name), nil }
	subscriber := func(handler string) (message.Subscriber, error) {
		return m.SubscriberFor(t, r, For{GenerateName: queue(handler)})
	}
	errWarming := errors.New("invoice service warming up: connection pool not ready")
	newRouter(t, func(router *message.Router) {
		eventBus, err := cqrs.NewEventBusWithConfig(pub, cqrs.EventBusConfig{
			GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return generate(p.EventName) },
			Marshaler:            marshaler,
		})
		if err != nil {
			t.Fatal(err)
		}
		commands, err := cqrs.NewCommandProcessorWithConfig(router, cqrs.CommandProcessorConfig{
			GenerateSubscribeTopic: func(p cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) {
				return generate(p.CommandName)
			},
			SubscriberConstructor: func(p cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
				return subscriber(p.HandlerName)
			},
			Marshaler: marshaler,
		})
		if err != nil {
			t.Fatal(err)
		}
		events, err := cqrs.NewEventProcessorWithConfig(router, cqrs.EventProcessorConfig{
			GenerateSubscribeTopic: func(p cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) {
				return generate(p.EventName)
			},
			SubscriberConstructor: func(p cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
				return subscriber(p.HandlerName)
			},
			Marshaler: marshaler,
		})
		if err != nil {
			t.Fatal(err)
		}
		err = commands.AddHandlers(
			cqrs.NewCommandHandler("book", func(ctx context.Context, c *bookRoom) error {
				ran(ctx, "book", c.BookingID)
				return eventBus.Publish(ctx, &roomBooked{BookingID: c.BookingID})
			}),
			cqrs.NewCommandHandler("cancel", func(ctx context.Context, c *cancelBooking) error {
				ran(ctx, "cancel", c.BookingID)
				return nil
			}),
		)
		if err != nil {
			t.Fatal(err)
		}
		err = events.AddHandlers(
			cqrs.NewEventHandler("invoice", func(ctx context.Context, e *roomBooked) error {
				if ran(ctx, "invoice", e.BookingID) <= 2 && warming(e.BookingID) {
					return errWarming
				}
				return nil
			}),
			cqrs.NewEventHandler("notify", func(ctx context.Context, e *roomBooked) error {
				ran(ctx, "notify", e.BookingID)
				return nil
			}),
		)
		if err != nil {
			t.Fatal(err)
		}
	}, settle, r.Middleware)

	bus, err := cqrs.NewCommandBusWithConfig(pub, cqrs.CommandBusConfig{
		GeneratePublishTopic: func(p cqrs.CommandBusGeneratePublishTopicParams) (string, error) { return generate(p.CommandName) },
		Marshaler:            marshaler,
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range bookings {
		if err := bus.Send(context.Background(), &bookRoom{BookingID: strconv.Itoa(i)}); err != nil {
			t.Fatal(err)
		}
		if i%10 == 5 {
			if err := bus.Send(context.Background(), &cancelBooking{BookingID: strconv.Itoa(i)}); err != nil {
				t.Fatal(err)
			}
		}
	}

	third := 0
	for i := range bookings {
		if warming(strconv.Itoa(i)) {
			third++
		}
	}
	want := map[string]int{"book": bookings, "cancel": cancellations, "notify": bookings, "invoice": bookings + 2*third}
	got := map[string]int{}
	deadline := time.After(time.Minute)
	for n := 0; n < bookings+cancellations+bookings+bookings+2*third; n++ {
		select {
		case h := <-settled:
			got[h]++
		case <-deadline:
			t.Fatalf("settled %v within 1 min, want %v; %d outages begun, %d probes (a queue stalled)",
				got, want, len(obs.of(amqpretry.EventOutageStarted)), len(obs.of(amqpretry.EventProbe)))
		}
	}
	wantStats(t, r, int64(2*third), 0) // so nothing more is on its way
	if !mapsEqual(got, want) {
		t.Errorf("settled deliveries per handler %v, want %v", got, want)
	}
	mu.Lock()
	perHandler := map[string]int{}
	for key, attempts := range runs {
		h, id, _ := strings.Cut(key, " ")
		perHandler[h]++
		wantAttempts := []int{1}
		if h == "invoice" && warming(id) {
			wantAttempts = []int{1, 2, 3}
		}
		if !slices.Equal(attempts, wantAttempts) {
			t.Errorf("%s ran on attempts %v, want %v: once per attempt", key, attempts, wantAttempts)
		}
	}
	mu.Unlock()
	if want := map[string]int{"book": bookings, "cancel": cancellations, "invoice": bookings, "notify": bookings}; !mapsEqual(perHandler, want) {
		t.Errorf("messages per handler %v, want %v (none lost)", perHandler, want)
	}
	// Each outage, per queue: begun, then its first probe succeeds and ends it.
	trips := 0
	obs.mu.Lock()
	next := map[string]string{} // queue: the outage event expected next
	for _, ev := range obs.all {
		switch ev.Kind {
		case amqpretry.EventOutageStarted:
			trips++
			if next[ev.Queue] != "" {
				t.Errorf("queue %s: an outage began while %s", ev.Queue, next[ev.Queue])
			}
			next[ev.Queue] = "its first probe"
		case amqpretry.EventProbe:
			if next[ev.Queue] != "its first probe" {
				t.Errorf("queue %s: a probe (attempt %d, %v) while %s was expected", ev.Queue, ev.Attempt, ev.Err, next[ev.Queue])
			} else if ev.Err != nil {
				t.Errorf("queue %s: the outage's first probe failed (attempt %d: %v): a false trip must end at its first probe", ev.Queue, ev.Attempt, ev.Err)
			}
			next[ev.Queue] = "the outage's end"
		case amqpretry.EventOutageEnded:
			if next[ev.Queue] != "the outage's end" {
				t.Errorf("queue %s: an outage ended while %s was expected", ev.Queue, next[ev.Queue])
			}
			delete(next, ev.Queue)
		}
	}
	obs.mu.Unlock()
	for q, what := range next {
		t.Errorf("queue %s: still waiting for %s", q, what)
	}
	t.Logf("%d bookings, invoice failing the first two attempts of %d: %d outages begun; stats %+v", bookings, third, trips, r.Stats())
	for _, q := range queues {
		if n := brokertest.QueueLength(t, q); n != 0 {
			t.Errorf("%d messages left in %s", n, q)
		}
	}
}
