// Command consumer is the consumer process of the no-loss test
// (internal/testsupport/noloss). It wires amqpretry the way the README says
// (wamqp3.New, or wamqp2.New with AMQPRETRY_NOLOSS_MAJOR=2, then Retry.AddHandler: a
// subscriber from SubscriberConfig with the Middleware on the handler) and handles the
// work queue of a run: each message's fate is read from its payload (fates.Of), and
// every message handled successfully is recorded, before the handler returns nil, by a
// persistent message with its UUID published with a publisher confirm to the run's
// results queue. A record whose delivery's ack is then lost (SIGKILL, a closed
// connection, a node gone) shows up twice: a duplicate, never a loss. Each record also
// carries when the delivery arrived (to the nanosecond: the order of handling, which
// the ordered runs check) and, for a retry, how late it was against its due time, the
// work queue it came from and the process that handled it. -queues consumes several
// work queues (the order partitions).
//
// The broker URI is read from AMQP_URI (never from the command line, never printed); in
// a cluster, -nodes lists the nodes' host:port and every connection (subscribers,
// hand-off, records) goes through amqpretry.Cluster. It prints noloss.Ready on stdout
// once its handlers are subscribed, logs to stderr, and stops cleanly on SIGTERM or
// SIGINT.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss/fates"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
)

func main() {
	variant := flag.String("variant", "", "the run's variant (noloss.Variants)")
	prefix := flag.String("prefix", "", "the run's prefix (queue and exchange names)")
	nodes := flag.String("nodes", "", "a cluster's nodes, host:port, comma-separated (none: the broker at AMQP_URI)")
	handlers := flag.Int("handlers", 4, "handlers (consumers) on each work queue")
	queues := flag.String("queues", "", "the work queues to consume, comma-separated (default: the run's one, noloss.WorkQueue of -prefix)")
	sabotage := flag.Int("sabotage", 0, "FOR PROVING THE TEST ONLY: ack this many transient messages on their first attempt without handing them off or recording them, i.e. lose them")
	// A run that changes backends while retries wait (TestNoLossSwitch) starts one
	// consumer per configuration.
	var st stage
	flag.StringVar(&st.prefix, "storage-prefix", "", "Config.Prefix, if not -prefix (the run's queues keep -prefix)")
	flag.StringVar(&st.tiers, "tiers", "", "the tiers of ttl-tiers, comma-separated durations (default: the policy's delays)")
	flag.IntVar(&st.levels, "levels", 0, "the levels of binary-levels (default: noloss.Setup.Levels)")
	flag.BoolVar(&st.quorum, "quorum", false, "the work and results queues are quorum queues, whatever the variant")
	flag.StringVar(&st.topology, "topology", "", "Config.Topology (default: declare)")
	flag.StringVar(&st.heldLog, "held-log", "", "a file where the due time of each retry held in the work queue, and each retry that failed, is appended, and read at start: the consumers of one run share it")
	flag.Parse()
	if err := run(*variant, *prefix, *nodes, *queues, *handlers, *sabotage, st); err != nil {
		fmt.Fprintln(os.Stderr, "noloss-consumer:", err)
		os.Exit(1)
	}
}

// stage is a consumer's own configuration in a run that changes backends.
type stage struct {
	prefix, tiers, topology, heldLog string
	levels                           int
	quorum                           bool
}

func run(variant, prefix, nodes, queues string, handlers, sabotage int, st stage) error {
	uri := os.Getenv("AMQP_URI")
	v, ok := noloss.VariantNamed(variant)
	if uri == "" || prefix == "" || handlers < 1 || !ok {
		return errors.New("need AMQP_URI, -variant (a known one), -prefix and -handlers >= 1")
	}
	major, err := noloss.ParseMajor(os.Getenv(noloss.MajorEnv))
	if err != nil {
		return err
	}
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	s := noloss.Setup{URI: uri, Variant: v, Prefix: prefix, Major: major, Logger: logger}
	if nodes != "" {
		s.Nodes = strings.Split(nodes, ",")
	}
	s.StoragePrefix, s.LevelsOf, s.QuorumWork, s.Topology = st.prefix, st.levels, st.quorum, topology.Mode(st.topology)
	if st.tiers != "" {
		for _, f := range strings.Split(st.tiers, ",") {
			d, err := time.ParseDuration(f)
			if err != nil {
				return fmt.Errorf("-tiers: %w", err)
			}
			s.Tiers = append(s.Tiers, d)
		}
	}

	retry, err := noloss.New(s)
	if err != nil {
		return err
	}
	defer retry.Close()
	rec := &recorder{setup: s, queue: noloss.ResultsQueue(prefix), logger: logger}
	defer rec.close()
	c := &consumer{rec: rec, variant: v, heldDelay: s.HeldDelay(), sabotage: int64(sabotage), logger: logger, held: map[string]time.Time{}, hops: map[string][]string{}}
	if st.heldLog != "" {
		if err := c.openHeldLog(st.heldLog); err != nil {
			return err
		}
		defer c.heldLog.Close()
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, logger)
	if err != nil {
		return err
	}
	topics := []string{noloss.WorkQueue(prefix)}
	if queues != "" {
		topics = strings.Split(queues, ",")
	}
	for qi, topic := range topics {
		for i := range handlers {
			// The README's one-call wiring: a subscriber from retry.SubscriberConfig()
			// and retry.Middleware on the handler. Several handlers on the topic
			// overlap the confirm waits (one consumer each; with an order key, one of
			// them is the queue's single active consumer, the others wait their turn).
			name := fmt.Sprintf("noloss-%d", i)
			if len(topics) > 1 {
				name = fmt.Sprintf("noloss-%d-%d", qi, i)
			}
			handle := func(msg *message.Message) error { return c.handle(topic, msg) }
			if _, err := retry.AddHandler(router, name, topic, handle); err != nil {
				return err
			}
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
		fmt.Printf("%s (watermill-amqp v%d)\n", noloss.Ready, major)
	case err := <-done:
		return fmt.Errorf("router stopped before running: %w", err)
	}
	return <-done
}

type consumer struct {
	rec       *recorder
	variant   noloss.Variant
	heldDelay time.Duration
	sabotage  int64
	dropped   atomic.Int64
	logger    watermill.LoggerAdapter

	// held maps the UUID of a message whose retry RabbitMQ holds in the work queue to
	// when that retry is due (such a retry comes back unchanged: no envelope tells).
	// hops maps the UUID of a message to its earlier retries that failed, "arrived
	// ms:late ms" each, for its record (lost with the process: a sample, not the
	// accounting).
	mu   sync.Mutex
	held map[string]time.Time
	hops map[string][]string
	// heldLog, if set, gets a line "held UUID due-Unix-ms" per retry held and "hop UUID
	// arrived:late" per retry that failed (written under mu): the next consumer of a
	// run that changes backends reads it at start.
	heldLog *os.File
}

// openHeldLog reads the held retries' due times and the failed retries that earlier
// consumers of the run wrote to path, and opens it to append this one's.
func (c *consumer) openHeldLog(path string) error {
	b, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	for _, line := range strings.Split(string(b), "\n") {
		switch f := strings.Fields(line); {
		case len(f) == 3 && f[0] == "held":
			if v, err := strconv.ParseInt(f[2], 10, 64); err == nil {
				c.held[f[1]] = time.UnixMilli(v)
			}
		case len(f) == 3 && f[0] == "hop":
			c.hops[f[1]] = append(c.hops[f[1]], f[2])
		}
	}
	c.heldLog, err = os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	return err
}

var errTransient = errors.New("noloss: transient failure (by the message's fate)")

func (c *consumer) handle(queue string, msg *message.Message) error {
	arrived := time.Now()
	fate, err := fates.Of(msg.Payload)
	if err != nil {
		return amqpretry.Permanent(err)
	}
	attempt := amqpretry.Attempt(msg)
	due := middleware.ReadEnvelope(msg.Metadata).Due
	c.mu.Lock()
	if held, ok := c.held[msg.UUID]; ok {
		if due.IsZero() {
			due = held
		}
		delete(c.held, msg.UUID)
	}
	hops := c.hops[msg.UUID]
	delete(c.hops, msg.UUID)
	c.mu.Unlock()
	switch {
	case fate == fates.Permanent:
		return amqpretry.Permanent(errors.New("noloss: permanent failure (by the message's fate)"))
	case fate == fates.Once && attempt == 1:
		return fmt.Errorf("attempt %d: %w", attempt, errTransient)
	case fate == fates.Transient && attempt <= c.variant.Failures:
		if attempt == 1 && c.sabotage > 0 && c.dropped.Add(1) <= c.sabotage {
			c.logger.Error("SABOTAGE: acking a message without handing it off or recording it", errSabotage, watermill.LogFields{"message_uuid": msg.UUID})
			return nil
		}
		c.mu.Lock()
		if c.variant.Backend == (delay.DelayedRetry(0)) || attempt <= c.variant.HeldRetries {
			c.held[msg.UUID] = arrived.Add(c.heldDelay)
			if c.heldLog != nil {
				fmt.Fprintf(c.heldLog, "held %s %d\n", msg.UUID, arrived.Add(c.heldDelay).UnixMilli())
			}
		}
		if !due.IsZero() {
			hop := fmt.Sprintf("%d:%d", arrived.UnixMilli(), arrived.Sub(due).Milliseconds())
			c.hops[msg.UUID] = append(hops, hop)
			if c.heldLog != nil {
				fmt.Fprintf(c.heldLog, "hop %s %s\n", msg.UUID, hop)
			}
		}
		c.mu.Unlock()
		return fmt.Errorf("attempt %d: %w", attempt, errTransient)
	}
	return c.rec.record(msg.Context(), msg.UUID, queue, attempt, arrived, due, hops)
}

// recorder publishes one persistent record per handled message to the results queue,
// on a confirm-mode channel of its own connection shared by the handlers (deferred
// confirms), reconnecting as needed.
type recorder struct {
	setup  noloss.Setup
	queue  string
	logger watermill.LoggerAdapter

	mu   sync.Mutex // guards conn and ch, never locked while waiting for the broker
	conn *amqp.Connection
	ch   *amqp.Channel
}

// record returns once the broker has confirmed the record, trying again (with a fresh
// connection) until it does. It gives up only when ctx ends (the router is closing);
// the handler then fails and the message is retried, never dropped. due is when the
// delivery was due, zero if unknown (a first delivery); hops are the message's earlier
// retries, for noloss.HopsHeader.
func (r *recorder) record(ctx context.Context, uuid, queue string, attempt int, arrived, due time.Time, hops []string) error {
	headers := amqp.Table{noloss.AttemptHeader: int32(attempt), noloss.ArrivedHeader: arrived.UnixMilli(),
		noloss.HandledHeader: arrived.UnixNano(), noloss.QueueHeader: queue, noloss.PIDHeader: int32(os.Getpid())}
	if !due.IsZero() {
		headers[noloss.LateHeader] = arrived.Sub(due).Milliseconds()
	}
	if len(hops) > 0 {
		headers[noloss.HopsHeader] = strings.Join(hops, ",")
	}
	for {
		ch, err := r.channel()
		if err == nil {
			err = r.publish(ctx, ch, uuid, headers)
			if err != nil {
				r.reset(ch)
			}
		}
		if err == nil {
			return nil
		}
		r.logger.Error("Could not record a handled message, trying again", err, watermill.LogFields{"message_uuid": uuid})
		select {
		case <-ctx.Done():
			return fmt.Errorf("record %s: %w (last error: %w)", uuid, ctx.Err(), err)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// channel returns the open confirm channel, connecting when there is none.
func (r *recorder) channel() (*amqp.Channel, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ch != nil && !r.ch.IsClosed() {
		return r.ch, nil
	}
	r.closeLocked()
	conn, err := r.setup.Dial()
	if err != nil {
		return nil, errors.New("dial failed (address withheld)")
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		go noloss.CloseConn(conn)
		return nil, err
	}
	r.conn, r.ch = conn, ch
	return ch, nil
}

func (r *recorder) publish(ctx context.Context, ch *amqp.Channel, uuid string, headers amqp.Table) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", r.queue, false, false, amqp.Publishing{
		DeliveryMode: amqp.Persistent,
		MessageId:    uuid,
		Headers:      headers,
		Body:         []byte(uuid),
	})
	if err != nil {
		return err
	}
	ok, err := dc.WaitContext(ctx)
	switch {
	case err != nil:
		return err
	case !ok:
		return errors.New("record nacked (or its channel closed)")
	}
	return nil
}

// reset drops ch's connection, if it is still the current one.
func (r *recorder) reset(ch *amqp.Channel) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ch == ch {
		r.closeLocked()
	}
}

func (r *recorder) closeLocked() {
	if r.conn != nil {
		go noloss.CloseConn(r.conn) // bounded, and no handler waits for it
	}
	r.conn, r.ch = nil, nil
}

func (r *recorder) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.conn != nil {
		noloss.CloseConn(r.conn)
	}
	r.conn, r.ch = nil, nil
}

// errSabotage is the error the deliberate loss of a message is logged with.
var errSabotage = errors.New("sabotage asked for: the message is dropped on purpose")
