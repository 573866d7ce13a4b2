// CQRS: a room-booking app on Watermill's CQRS component (commands, events, a queue
// per handler), retried through RabbitMQ by one Retry for every handler.
//
// Two commands, BookRoom and CancelBooking, each with a handler; one event, RoomBooked,
// with two handlers. Each handler's subscriber comes from the Retry's
// SubscriberConfigFor: one line in each processor's SubscriberConstructor. The Retry's
// Middleware is on the router, once. Booking fails once (a timeout), the invoice is
// rate limited once (RetryAfter) and then fails once more, the guest is notified at
// once, and a cancellation is refused for good (Permanent): it is read back from the
// poison queue with PoisonSubscriberConfig. The program checks, per handler and per
// message, that it ran as many times as it failed plus one, that a retry came back
// only to the handler that failed, and that nothing was lost; it exits non-zero
// otherwise.
//
// AMQP_URI is the broker (default amqp://guest:guest@localhost:5672/); DELAY_BACKEND the
// delay backend (default ttl-tiers; delayed-retry on RabbitMQ 4.3). Every run uses
// names of its own (prefix amqpretry-cqrs-<run>) and deletes what it declared.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// The commands and the event.
type (
	BookRoom struct {
		BookingID string
		Room      string
	}
	CancelBooking struct{ BookingID string }
	RoomBooked    struct {
		BookingID string
		Room      string
	}
)

// failures is how many times each handler fails each message before it succeeds.
var failures = map[string]int{"book-room": 1, "send-invoice": 2, "notify-guest": 0}

var bookings = []string{"b-1", "b-2", "b-3"}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "cqrs:", err)
		os.Exit(1)
	}
}

func run() error {
	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = "amqp://guest:guest@localhost:5672/"
	}
	logger := newLogger()
	prefix := "amqpretry-cqrs-" + watermill.NewShortUUID()[:8]
	// The backend named by DELAY_BACKEND ("" for the default), with the ladder it
	// takes if it is ttl-tiers.
	backend, err := delay.Parse(os.Getenv("DELAY_BACKEND"), delay.Settings{Tiers: []time.Duration{time.Second, 2 * time.Second}})
	if err != nil {
		return err
	}
	cfg := amqpretry.Config{
		Backend: backend,
		Prefix:  prefix,
		Policy:  amqpretry.Policy{MaxAttempts: 4, Jitter: -1},
		Logger:  logger,
	}
	topic := func(name string) string { return prefix + "." + name }

	// A pub/sub config: a fanout exchange per topic; each handler's queue,
	// "<topic>_<handler>", is bound to it. With delayed-retry (RabbitMQ 4.3) the Retry's
	// subscriber configs declare the queues as it needs to hold retries: no queue
	// arguments here.
	amqpCfg := amqp.NewDurablePubSubConfig(uri, amqp.GenerateQueueNameTopicNameWithSuffix("bookings"))
	retry, err := wamqp3.New(amqpCfg, cfg)
	if err != nil {
		return err
	}
	defer retry.Close() // after the router
	resolved := cfg.WithDefaults()
	fmt.Printf("RabbitMQ, delay backend %s, poison queue %s.\n", resolved.Backend, resolved.PoisonQueue)

	pub, err := amqp.NewPublisher(amqp.NewDurablePubSubConfig(uri, nil), logger)
	if err != nil {
		return err
	}
	defer pub.Close()

	app := newApp()
	var declared []string // the handlers' queues, to delete
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	// Outermost first: the app's count of settled deliveries, then the retry.
	router.AddMiddleware(app.settle, retry.Middleware)

	marshaler := cqrs.JSONMarshaler{}
	eventBus, err := cqrs.NewEventBusWithConfig(pub, cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return topic(p.EventName), nil },
		Marshaler:            marshaler,
	})
	if err != nil {
		return err
	}
	commandProcessor, err := cqrs.NewCommandProcessorWithConfig(router, cqrs.CommandProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) {
			return topic(p.CommandName), nil
		},
		SubscriberConstructor: func(p cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			declared = append(declared, topic(p.CommandName)+"_"+p.HandlerName)
			return amqp.NewSubscriber(retry.SubscriberConfigFor(amqp.GenerateQueueNameTopicNameWithSuffix(p.HandlerName)), logger)
		},
		Marshaler: marshaler,
	})
	if err != nil {
		return err
	}
	eventProcessor, err := cqrs.NewEventProcessorWithConfig(router, cqrs.EventProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) {
			return topic(p.EventName), nil
		},
		SubscriberConstructor: func(p cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			declared = append(declared, topic(p.EventName)+"_"+p.HandlerName)
			return amqp.NewSubscriber(retry.SubscriberConfigFor(amqp.GenerateQueueNameTopicNameWithSuffix(p.HandlerName)), logger)
		},
		Marshaler: marshaler,
	})
	if err != nil {
		return err
	}
	defer func() { removeTopology(uri, resolved, declared, topic, marshaler) }()

	err = commandProcessor.AddHandlers(
		cqrs.NewCommandHandler("book-room", func(ctx context.Context, cmd *BookRoom) error {
			if app.ran(ctx, "book-room") <= failures["book-room"] {
				return errors.New("room inventory timeout")
			}
			return eventBus.Publish(ctx, &RoomBooked{BookingID: cmd.BookingID, Room: cmd.Room})
		}),
		cqrs.NewCommandHandler("cancel-booking", func(ctx context.Context, cmd *CancelBooking) error {
			app.ran(ctx, "cancel-booking")
			return amqpretry.Permanent(fmt.Errorf("booking %s: the guest has checked in", cmd.BookingID))
		}),
	)
	if err != nil {
		return err
	}
	err = eventProcessor.AddHandlers(
		cqrs.NewEventHandler("send-invoice", func(ctx context.Context, ev *RoomBooked) error {
			switch app.ran(ctx, "send-invoice") {
			case 1:
				return amqpretry.RetryAfter(errors.New("billing API: 429 too many requests"), 1500*time.Millisecond)
			case 2:
				return errors.New("billing API: 503")
			}
			return nil
		}),
		cqrs.NewEventHandler("notify-guest", func(ctx context.Context, ev *RoomBooked) error {
			app.ran(ctx, "notify-guest")
			return nil
		}),
	)
	if err != nil {
		return err
	}

	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-ran:
		return fmt.Errorf("router: %w", err)
	}
	defer router.Close()

	commandBus, err := cqrs.NewCommandBusWithConfig(pub, cqrs.CommandBusConfig{
		GeneratePublishTopic: func(p cqrs.CommandBusGeneratePublishTopicParams) (string, error) { return topic(p.CommandName), nil },
		Marshaler:            marshaler,
	})
	if err != nil {
		return err
	}
	for i, id := range bookings {
		if err := commandBus.Send(ctx, &BookRoom{BookingID: id, Room: fmt.Sprint(101 + i)}); err != nil {
			return err
		}
	}
	if err := commandBus.Send(ctx, &CancelBooking{BookingID: "b-1"}); err != nil {
		return err
	}

	// Each handler runs each message failures+1 times; the cancellation once.
	want := 1
	for _, n := range failures {
		want += len(bookings) * (n + 1)
	}
	if err := app.waitSettled(ctx, want); err != nil {
		return err
	}
	poisoned, err := readPoison(ctx, retry, logger)
	if err != nil {
		return err
	}
	return app.check(retry.Stats(), poisoned, topic(marshaler.Name(&CancelBooking{}))+"_cancel-booking")
}

// readPoison reads the one poisoned message from the poison queue, as an operator's
// tool would: a subscriber from PoisonSubscriberConfig, whatever the topic.
func readPoison(ctx context.Context, retry *wamqp3.Retry, logger watermill.LoggerAdapter) (middleware.Envelope, error) {
	sub, err := amqp.NewSubscriber(retry.PoisonSubscriberConfig(), logger)
	if err != nil {
		return middleware.Envelope{}, err
	}
	defer sub.Close()
	messages, err := sub.Subscribe(ctx, "poison")
	if err != nil {
		return middleware.Envelope{}, err
	}
	select {
	case msg := <-messages:
		msg.Ack()
		env := middleware.ReadEnvelope(msg.Metadata)
		fmt.Printf("poison queue: %s, %s on attempt %d in %s: %s\n", msg.UUID, env.Reason, env.Attempt, env.Queue, env.Error)
		return env, nil
	case <-ctx.Done():
		return middleware.Envelope{}, errors.New("nothing in the poison queue")
	}
}

// app records, per handler and message, the attempts each ran with.
type app struct {
	mu      sync.Mutex
	runs    map[string]map[string][]int // handler: booking message UUID: attempts
	settled chan struct{}
}

func newApp() *app {
	return &app{runs: map[string]map[string][]int{}, settled: make(chan struct{}, 1000)}
}

// ranKey has, in a delivery's context, whether the handler ran it (settle).
type ranKey struct{}

// ran records a run of handler on the message of ctx, and returns its attempt.
func (a *app) ran(ctx context.Context, handler string) int {
	msg := cqrs.OriginalMessageFromCtx(ctx)
	if ran, ok := ctx.Value(ranKey{}).(*atomic.Bool); ok {
		ran.Store(true)
	}
	attempt := amqpretry.Attempt(msg)
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.runs[handler] == nil {
		a.runs[handler] = map[string][]int{}
	}
	a.runs[handler][msg.UUID] = append(a.runs[handler][msg.UUID], attempt)
	return attempt
}

// settle is the outermost middleware: it counts each run of a handler once it is
// handled to the end (its retry or poisoning handed off). A delivery the handler did
// not run (a retry held again until its RetryAfter is over, with delayed-retry) does
// not count.
func (a *app) settle(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ran := &atomic.Bool{}
		msg.SetContext(context.WithValue(msg.Context(), ranKey{}, ran))
		defer func() {
			if ran.Load() {
				a.settled <- struct{}{}
			}
		}()
		return h(msg)
	}
}

func (a *app) waitSettled(ctx context.Context, n int) error {
	for i := range n {
		select {
		case <-a.settled:
		case <-ctx.Done():
			return fmt.Errorf("%d of %d deliveries handled before the deadline", i, n)
		}
	}
	return nil
}

// check prints each handler's runs and fails unless each message ran failures+1
// times in each handler, the cancellation was poisoned once, and Stats agree.
func (a *app) check(st middleware.Stats, poisoned middleware.Envelope, cancelQueue string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	var errs []error
	handlers := make([]string, 0, len(a.runs))
	for h := range a.runs {
		handlers = append(handlers, h)
	}
	sort.Strings(handlers)
	retries := 0
	for _, h := range handlers {
		for uuid, attempts := range a.runs[h] {
			fmt.Printf("%-15s %s ran on attempts %v\n", h, uuid[:8], attempts)
		}
	}
	for h, n := range failures {
		if got := len(a.runs[h]); got != len(bookings) {
			errs = append(errs, fmt.Errorf("%s handled %d messages, want %d: lost", h, got, len(bookings)))
		}
		for uuid, attempts := range a.runs[h] {
			if len(attempts) != n+1 {
				errs = append(errs, fmt.Errorf("%s ran message %s %d times, want %d (failures plus one)", h, uuid, len(attempts), n+1))
			}
		}
		retries += len(bookings) * n
	}
	if n := len(a.runs["cancel-booking"]); n != 1 {
		errs = append(errs, fmt.Errorf("cancel-booking handled %d messages, want 1", n))
	}
	if poisoned.Reason != amqpretry.ReasonPermanent || poisoned.Queue != cancelQueue {
		errs = append(errs, fmt.Errorf("poisoned %s from queue %q, want permanent from %q", poisoned.Reason, poisoned.Queue, cancelQueue))
	}
	if st.Retries != int64(retries) || st.Poisoned != 1 || st.HandoffFailures != 0 {
		errs = append(errs, fmt.Errorf("stats %+v, want %d retries, 1 poisoned, no failed hand-off", st, retries))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	fmt.Printf("every handler ran each message its failures plus one times; %d retries, each back to the handler that failed only; 1 poisoned, read back; 0 lost\n", retries)
	return nil
}

// removeTopology deletes the handlers' queues, the topics' exchanges and what the
// Retry declared.
func removeTopology(uri string, cfg amqpretry.Config, queues []string, topic func(string) string, m cqrs.JSONMarshaler) {
	plan, err := cfg.Plan()
	if err != nil {
		return
	}
	conn, err := amqp091.Dial(uri)
	if err != nil {
		fmt.Println("left on the broker (could not connect to delete it): the queues and exchanges of prefix", cfg.Prefix)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	defer ch.Close()
	for _, q := range plan.Queues {
		queues = append(queues, q.Name)
	}
	exchanges := []string{topic(m.Name(&BookRoom{})), topic(m.Name(&CancelBooking{})), topic(m.Name(&RoomBooked{}))}
	for _, e := range plan.Exchanges {
		exchanges = append(exchanges, e.Name)
	}
	for _, q := range queues {
		_, _ = ch.QueueDelete(q, false, false, false)
	}
	for _, e := range exchanges {
		_ = ch.ExchangeDelete(e, false, false)
	}
	fmt.Printf("removed what this run declared: %d queues, %d exchanges (prefix %s)\n", len(queues), len(exchanges), cfg.Prefix)
}
