package amqpretry_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"net/http"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// Broker-side retry on a Watermill router, with watermill-amqp v3.
func Example() {
	logger := watermill.NewStdLogger(false, false)
	amqpCfg := amqp.NewDurableQueueConfig("amqp://guest:guest@localhost:5672/")
	retry, err := wamqp3.New(amqpCfg, amqpretry.Config{
		Policy: amqpretry.Policy{MaxAttempts: 5},
		Logger: logger,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer retry.Close()

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	// The subscriber, the handler and the retry middleware, wired in one call.
	if _, err := retry.AddHandler(router, "orders", "orders", chargeCard); err != nil {
		log.Fatal(err)
	}
	_ = router.Run(context.Background())
}

func chargeCard(*message.Message) error { return nil }

var errMalformed = errors.New("malformed order")

// A handler marks an error that no retry can fix: the message is poisoned at once,
// with its failure envelope.
func ExamplePermanent() {
	_ = func(msg *message.Message) error {
		if len(msg.Payload) == 0 {
			return amqpretry.Permanent(errMalformed)
		}
		return nil
	}
}

// A handler honours the Retry-After of a throttled API: the next attempt comes after
// that delay instead of the policy's.
func ExampleRetryAfter() {
	_ = func(msg *message.Message) error {
		resp, err := http.Post("https://api.example.com/charge", "application/json", nil)
		if err != nil {
			return err // retried with the policy's backoff
		}
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusTooManyRequests {
			return amqpretry.RetryAfter(errors.New("429 too many requests"), 30*time.Second)
		}
		return nil
	}
}

// Attempt tells a handler which attempt it is on, from 1.
func ExampleAttempt() {
	_ = func(msg *message.Message) error {
		if amqpretry.Attempt(msg) > 3 {
			log.Printf("message %s: attempt %d", msg.UUID, amqpretry.Attempt(msg))
		}
		return nil
	}
}

// A Watermill CQRS handler is given the message's context, not the message: it reads
// its attempt from the context.
func ExampleAttemptFromContext() {
	type OrderPlaced struct{ ID string }
	_ = cqrs.NewEventHandler("on-order-placed", func(ctx context.Context, e *OrderPlaced) error {
		if n := amqpretry.AttemptFromContext(ctx); n > 3 {
			log.Printf("order %s: attempt %d", e.ID, n)
		}
		return nil
	})
}

// A payload that cannot decode is poisoned at once by default (DecisionOf). A Classify
// retries such errors instead: for a consumer deployed before the producer's schema
// change, say. A Permanent mark on the same error is then not honoured either.
func ExampleConfig_retryDecodeErrors() {
	_ = amqpretry.Config{
		Classify: func(p amqpretry.ClassifyParams) amqpretry.Decision {
			var syntax *json.SyntaxError
			var typ *json.UnmarshalTypeError
			if errors.As(p.Err, &syntax) || errors.As(p.Err, &typ) {
				p.Default.Permanent = false // retried on the policy's schedule
			}
			return p.Default
		},
	}
}

// Classify decides for errors the handler does not mark: here, errors of a library
// that are never worth a retry, and a back-off for a busy database.
func ExampleConfig_classify() {
	errBusy := errors.New("database busy")
	_ = amqpretry.Config{
		Classify: func(p amqpretry.ClassifyParams) amqpretry.Decision {
			switch {
			case errors.Is(p.Err, errMalformed):
				return amqpretry.Decision{Permanent: true}
			case errors.Is(p.Err, errBusy):
				return amqpretry.Decision{Delay: time.Duration(p.Attempt) * 10 * time.Second}
			}
			return p.Default // the error's own marks, then the policy
		},
	}
}

// Each backend is a value with its own settings; the rest of the code does not
// change. A name read from configuration gives its value with delay.Parse.
func ExampleConfig_backends() {
	_ = []amqpretry.Config{
		// A ladder of delay queues; a delay snaps up to the next tier.
		{Backend: delay.TTLTiers(time.Second, 10*time.Second, time.Minute, 10*time.Minute)},
		// Any delay up to 2^Levels-1 seconds, in 1 s steps.
		{Backend: delay.BinaryLevels(20)},
		// RabbitMQ 4.3: retries held in the (quorum) work queue, 2s apart, no copy.
		{Backend: delay.DelayedRetry(2 * time.Second), Policy: amqpretry.Policy{MaxAttempts: 4}},
		// RabbitMQ 4.3: the first two retries held in the work queue, later ones on
		// ttl-tiers with exponential backoff.
		{Backend: delay.HeldRetries(2, 200*time.Millisecond, delay.TTLTiers())},
	}
	// The backend named by the environment ("" for ttl-tiers), with the settings it
	// has among those given.
	b, err := delay.Parse(os.Getenv("DELAY_BACKEND"), delay.Settings{Levels: 20})
	if err != nil {
		log.Fatal(err)
	}
	_ = amqpretry.Config{Backend: b}
}

// Plan lists what a configuration needs on the broker, without a broker: for an
// administrator, or for a definitions file.
func ExampleConfig_Plan() {
	plan, err := amqpretry.Config{Backend: delay.TTLTiers(time.Second, time.Minute)}.Plan("orders")
	if err != nil {
		log.Fatal(err)
	}
	for _, q := range plan.Queues {
		fmt.Println(q.Name, q.Args["x-queue-type"])
	}
	// Output:
	// amqpretry.parking quorum
	// amqpretry.delay.1s quorum
	// amqpretry.delay.1m quorum
	// amqpretry.poison quorum
}

// Connecting to a three-node cluster: each connection goes to a node that answers, and
// moves to another when its node is lost.
func ExampleCluster() {
	nodes := amqpretry.Cluster("rabbit-1:5672", "rabbit-2:5672", "rabbit-3:5672")
	amqpCfg := amqp.NewDurableQueueConfig("amqp://app:secret@rabbit-1:5672/")
	amqpCfg.Connection.AmqpConfig = nodes // the subscriber and the library's hand-off
	pubCfg := amqp.NewDurableQueueConfig("amqp://app:secret@rabbit-1:5672/")
	pubCfg.Connection.AmqpConfig = nodes // your publishers
	_, _ = wamqp3.New(amqpCfg, amqpretry.Config{})
}

// Duplicates dropped, retries never: the Retry remembers a message for a week once its
// handler has succeeded (here in this process's memory; a DedupStore such as the
// pgdedup module's keeps it in PostgreSQL).
func ExampleConfig_dedup() {
	amqpCfg := amqp.NewDurableQueueConfig("amqp://guest:guest@localhost:5672/")
	retry, err := wamqp3.New(amqpCfg, amqpretry.Config{Dedup: 7 * 24 * time.Hour})
	if err != nil {
		log.Fatal(err)
	}
	defer retry.Close()
}

// Watermill's Deduplicator beside the Retry, keyed so that a retry, which has the next
// attempt, is not taken for a duplicate of the attempt that failed.
func ExampleDedupKey() {
	logger := watermill.NewStdLogger(false, false)
	retry, err := wamqp3.New(amqp.NewDurableQueueConfig("amqp://guest:guest@localhost:5672/"), amqpretry.Config{Logger: logger})
	if err != nil {
		log.Fatal(err)
	}
	defer retry.Close()
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	dedup := &wmiddleware.Deduplicator{KeyFactory: amqpretry.DedupKey}
	router.AddMiddleware(dedup.Middleware) // outside the Retry; on the handler after AddHandler works too
	if _, err := retry.AddHandler(router, "orders", "orders", chargeCard); err != nil {
		log.Fatal(err)
	}
	_ = router.Run(context.Background())
}

// Exponential builds a growing schedule for Policy.Delays: 500ms doubling, each delay
// at most 30s, which then repeats. Jitter (±20% by default) randomises every delay,
// never past the longest; -1 keeps them exact.
func ExampleExponential() {
	policy := amqpretry.Policy{MaxAttempts: 8, Delays: amqpretry.Exponential(500*time.Millisecond, 2, 30*time.Second), Jitter: -1}
	fmt.Println(policy.Delays)
	// Output: [500ms 1s 2s 4s 8s 16s 30s]
}
