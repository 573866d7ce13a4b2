// Example: broker-side retries with Prometheus metrics.
//
// It runs ORDERS orders (default 200, published at RATE a second, default 200) through
// a Watermill router whose handler fails some of them (30% once, 10% twice, 2% for
// good), on RabbitMQ at AMQP_URI through watermill-amqp v3 (wamqp3) with the backend
// named by DELAY_BACKEND (default ttl-tiers; delayed-retry needs RabbitMQ 4.3), and
// HELD_RETRIES=N to have RabbitMQ 4.3 hold the first N retries in the work queue;
// or in-process on a GoChannel with the memory backend when AMQP_URI is unset. With
// METRICS_ADDR=host:port it serves /metrics while it runs (and METRICS_LINGER=30s keeps
// serving that long after). At the end it prints the final metrics in Prometheus text
// format, and deletes the queues and exchanges it declared (their names start with a
// prefix of its own per run).
//
//	cd metrics && go run ./example
//	AMQP_URI=amqp://guest:guest@127.0.0.1:5672/ METRICS_ADDR=127.0.0.1:9464 go run ./example
//	AMQP_URI=amqp://guest:guest@127.0.0.1:5675/ DELAY_BACKEND=delayed-retry go run ./example
package main

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/metrics"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/wamqp3"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "metrics example:", err)
		os.Exit(1)
	}
}

// failures decides, from the order's id, how many attempts fail (-1: for good).
func failures(id string) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(id))
	switch p := h.Sum32() % 100; {
	case p < 2:
		return -1
	case p < 12:
		return 2
	case p < 42:
		return 1
	}
	return 0
}

func run() error {
	n := 200
	if v := os.Getenv("ORDERS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil {
			return fmt.Errorf("ORDERS: %w", err)
		}
	}
	logger := watermill.NopLogger{}
	uri := os.Getenv("AMQP_URI")
	runID := watermill.NewShortUUID()[:8]
	prefix := "amqpretry-metrics-example." + runID
	topic := prefix + ".orders"

	amqpCfg := amqp3.NewDurableQueueConfig(uri)
	var goChannel *gochannel.GoChannel
	if uri == "" {
		goChannel = gochannel.NewGoChannel(gochannel.Config{}, logger)
		amqpCfg = amqp3.Config{}
	}
	settings := delay.Settings{Tiers: []time.Duration{time.Second, 2 * time.Second}, Delay: time.Second}
	if v := os.Getenv("HELD_RETRIES"); v != "" {
		var err error
		if settings.HeldRetries, err = strconv.Atoi(v); err != nil {
			return fmt.Errorf("HELD_RETRIES: %w", err)
		}
	}
	name := os.Getenv("DELAY_BACKEND")
	if goChannel != nil {
		name, settings.Publisher = delay.Memory(nil).Name(), goChannel
	}
	backend, err := delay.Parse(name, settings)
	if err != nil {
		return err
	}
	cfg := amqpretry.Config{
		Backend: backend,
		Prefix:  prefix,
		Policy:  amqpretry.Policy{MaxAttempts: 4, Delays: []time.Duration{time.Second, 2 * time.Second}, Jitter: -1},
		Logger:  logger,
	}
	if name == (delay.DelayedRetry(0)).Name() {
		// One constant delay per work queue: RabbitMQ 4.3 holds every retry for it.
		cfg.Policy = amqpretry.Policy{MaxAttempts: 4}
	}

	reg := prometheus.NewRegistry()
	mx, err := metrics.New(metrics.Config{Registerer: reg})
	if err != nil {
		return err
	}
	cfg.Observe = mx.Observe
	if uri != "" {
		defer deleteDeclared(uri, cfg, topic)
	}
	retry, err := wamqp3.New(amqpCfg, cfg)
	if err != nil {
		return err
	}
	defer retry.Close()
	var pub message.Publisher = goChannel
	if uri != "" {
		// The publisher declares the work queue as the subscriber does (with delayed
		// retries, a quorum queue with the arguments RabbitMQ 4.3 needs).
		amqpPub, err := amqp3.NewPublisher(retry.SubscriberConfig(), logger)
		if err != nil {
			return err
		}
		defer amqpPub.Close()
		pub = amqpPub
	}

	handler := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	if addr := os.Getenv("METRICS_ADDR"); addr != "" {
		srv := &http.Server{Addr: addr, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if uri != "" {
				_ = mx.RefreshQueues(uri, cfg)
			}
			handler.ServeHTTP(w, r)
		}), ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.ListenAndServe() }()
		defer srv.Close()
		fmt.Fprintf(os.Stderr, "serving http://%s/metrics\n", addr)
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	var done atomic.Int64
	_, err = retry.AddHandler(router, "orders", topic, func(msg *message.Message) error {
		f := failures(msg.UUID)
		switch {
		case f < 0:
			done.Add(1)
			return amqpretry.Permanent(errors.New("malformed order"))
		case amqpretry.Attempt(msg) <= f:
			return errors.New("payment service timeout")
		}
		done.Add(1)
		return nil
	})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = router.Run(ctx) }()
	select {
	case <-router.Running():
	case <-time.After(30 * time.Second):
		return errors.New("router not running after 30 s")
	}
	defer router.Close()

	rate := 200 // orders a second, so that the lateness measured is the backend's, not a backlog's
	if v := os.Getenv("RATE"); v != "" {
		if rate, err = strconv.Atoi(v); err != nil || rate < 1 {
			return fmt.Errorf("RATE: %q, want a positive integer", v)
		}
	}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for i := range n {
		<-tick.C
		if err := pub.Publish(topic, message.NewMessage(fmt.Sprintf("%s-%d", runID, i), nil)); err != nil {
			return err
		}
	}
	for deadline := time.Now().Add(time.Minute); done.Load() < int64(n); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d orders done within a minute of the last publish", done.Load(), n)
		}
	}
	time.Sleep(200 * time.Millisecond) // the last poisonings are recorded after the handler returns
	if uri != "" {
		if err := mx.RefreshQueues(uri, cfg); err != nil {
			return err
		}
	}
	// METRICS_LINGER: how long to keep serving before the end. METRICS_HOLD, its old
	// name, is still read when METRICS_LINGER is unset.
	linger, ok := os.LookupEnv("METRICS_LINGER")
	if !ok {
		linger = os.Getenv("METRICS_HOLD")
	}
	if d, err := time.ParseDuration(linger); err == nil {
		time.Sleep(d)
	}
	rec := httptest.NewRecorder()
	handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	fmt.Print(rec.Body.String())
	return nil
}

// deleteDeclared deletes, within 30 s, the work queue and everything cfg declares on
// the broker (cfg.Plan): the run's names are its own.
func deleteDeclared(uri string, cfg amqpretry.Config, topic string) {
	// The work queue and the poison queue whatever the plan says (an invalid plan must
	// not leave them behind), then the plan's.
	queues := []topology.Queue{{Name: topic}, {Name: cfg.WithDefaults().PoisonQueue}}
	var exchanges []topology.Exchange
	if plan, err := cfg.Plan(topic); err == nil {
		queues, exchanges = append(queues, plan.Queues...), plan.Exchanges
	}
	conn, err := amqp.DialConfig(uri, amqp.Config{Dial: amqp.DefaultDial(10 * time.Second)})
	if err != nil {
		fmt.Fprintln(os.Stderr, "metrics example: clean-up: cannot connect; delete the queues and exchanges named", cfg.Prefix+".*")
		return
	}
	defer conn.Close()
	deadline := time.Now().Add(30 * time.Second)
	each := func(f func(*amqp.Channel) error) {
		if ch, err := conn.Channel(); err == nil && time.Now().Before(deadline) {
			_ = f(ch)
			_ = ch.Close()
		}
	}
	for _, q := range queues {
		each(func(ch *amqp.Channel) error { _, err := ch.QueueDelete(q.Name, false, false, false); return err })
	}
	for _, x := range exchanges {
		each(func(ch *amqp.Channel) error { return ch.ExchangeDelete(x.Name, false, false) })
	}
}
