// Quickstart: a Watermill router whose handler fails, retried through the broker.
//
// With AMQP_URI unset it runs in this process on Watermill's GoChannel and the memory
// delay backend: no broker needed. With AMQP_URI set it runs the same flow on RabbitMQ
// with the backend named by DELAY_BACKEND (default ttl-tiers), through watermill-amqp
// v3 (WATERMILL_AMQP=2 for v2). HELD_RETRIES=N holds the first N retries in the work
// queue itself (RabbitMQ 4.3+); DELAY_BACKEND=delivery-time runs the AMQP 1.0 quickstart
// of module amqp1 (RabbitMQ 4.3+). Every run uses names of its own (prefix
// amqpretry-qs-<run>), so runs can share a broker, and deletes what it declared.
//
// TOPOLOGY=verify (or none) runs it as a user without configure permission would:
// nothing is declared, and PREFIX and QUEUE name what an administrator created with
// `amqpretry topology apply --prefix $PREFIX --tiers 1s,2s,4s --queue $QUEUE`.
package main

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"

	"github.com/ThreeDotsLabs/watermill"
	amqp2 "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/wamqp2"
	"github.com/amqpretry/amqpretry/wamqp3"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run() error {
	logger := newLogger()
	if os.Getenv("DELAY_BACKEND") == (delay.DeliveryTime()).Name() {
		return runAMQP1()
	}
	uri := os.Getenv("AMQP_URI")
	runID := watermill.NewShortUUID()[:8]
	cfg := scenarioConfig(runID, logger)
	if cfg.Backend.Name() == delay.DelayedRetry(0).Name() {
		cfg.Policy = amqpretry.Policy{MaxAttempts: 4} // one delay per work queue: the backend's Delay
	}
	topic := scenarioTopic(cfg)

	var (
		s   setup
		err error
	)
	if uri == "" {
		goChannel := gochannel.NewGoChannel(gochannel.Config{}, logger)
		cfg.Backend = delay.Memory(goChannel)
		s.Retry, err = wamqp3.New(amqp3.Config{}, cfg)
		s.Publisher, s.Poison = goChannel, goChannel
		fmt.Println("AMQP_URI is unset: running in-process on GoChannel with the memory delay backend (not durable).")
	} else {
		major := "3"
		if os.Getenv("WATERMILL_AMQP") == "2" {
			major = "2"
			s, err = withV2(uri, cfg)
		} else {
			s, err = withV3(uri, cfg)
		}
		if err == nil {
			fmt.Printf("RabbitMQ at %s, delay backend %s, watermill-amqp v%s.\n", redactURI(uri), cfg.WithDefaults().Backend, major)
		}
		if cfg.Topology != topology.ModeVerify && cfg.Topology != topology.ModeNone {
			s.Cleanup = func() { removeTopology(uri, cfg, topic) }
		}
	}
	if err != nil {
		return err
	}
	s.PoisonQueue = cfg.WithDefaults().PoisonQueue
	return runScenario(runID, topic, s, logger)
}

// runAMQP1 runs the AMQP 1.0 quickstart of this repository, a module of its own
// (amqp1/examples/quickstart), which keeps the AMQP 1.0 dependencies out of this one.
func runAMQP1() error {
	_, file, _, _ := runtime.Caller(0)
	cmd := exec.Command("go", "run", ".")
	cmd.Dir = filepath.Join(filepath.Dir(file), "..", "..", "amqp1", "examples", "quickstart")
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	fmt.Println("DELAY_BACKEND=delivery-time: running the AMQP 1.0 quickstart (module amqp1).")
	return cmd.Run()
}

func withV3(uri string, cfg amqpretry.Config) (setup, error) {
	// With retries held in the work queue (delayed-retry, HELD_RETRIES), the Retry's
	// subscriber config declares it as RabbitMQ 4.3 needs: no queue arguments here.
	amqpCfg := amqp3.NewDurableQueueConfig(uri)
	pub, err := amqp3.NewPublisher(amqpCfg, cfg.Logger)
	if err != nil {
		return setup{}, err
	}
	if cfg.Backend.Name() == delay.Memory(nil).Name() {
		cfg.Backend = delay.Memory(pub) // the retry waits in this process, then is published to its queue
	}
	retry, err := wamqp3.New(amqpCfg, cfg)
	if err != nil {
		return setup{}, errors.Join(err, pub.Close())
	}
	// The poison queue, read as docs/cqrs.md says: whatever the topic subscribed to.
	sub, err := amqp3.NewSubscriber(retry.PoisonSubscriberConfig(), cfg.Logger)
	if err != nil {
		return setup{}, errors.Join(err, retry.Close(), pub.Close())
	}
	return setup{Retry: retry, Publisher: pub, Poison: sub}, nil
}

func withV2(uri string, cfg amqpretry.Config) (setup, error) {
	amqpCfg := amqp2.NewDurableQueueConfig(uri)
	pub, err := amqp2.NewPublisher(amqpCfg, cfg.Logger)
	if err != nil {
		return setup{}, err
	}
	if cfg.Backend.Name() == delay.Memory(nil).Name() {
		cfg.Backend = delay.Memory(pub) // the retry waits in this process, then is published to its queue
	}
	retry, err := wamqp2.New(amqpCfg, cfg)
	if err != nil {
		return setup{}, errors.Join(err, pub.Close())
	}
	sub, err := amqp2.NewSubscriber(retry.PoisonSubscriberConfig(), cfg.Logger)
	if err != nil {
		return setup{}, errors.Join(err, retry.Close(), pub.Close())
	}
	return setup{Retry: retry, Publisher: pub, Poison: sub}, nil
}

// removeTopology deletes what this run declared, its work queue and every queue and
// exchange of its plan, and says so.
func removeTopology(uri string, cfg amqpretry.Config, queue string) {
	plan, err := cfg.Plan(queue)
	if cfg.Backend.Name() == delay.Memory(nil).Name() { // nothing of the backend's on the broker
		plan, err = topology.Topology{Queues: []topology.Queue{{Name: cfg.WithDefaults().PoisonQueue}}}, nil
	}
	if err != nil {
		return
	}
	conn, err := amqp.Dial(uri)
	if err != nil {
		fmt.Println("left on the broker (could not connect to delete it):", len(plan.Queues)+1, "queues and", len(plan.Exchanges), "exchanges of prefix", cfg.Prefix)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	defer ch.Close()
	queues, exchanges := 0, 0
	if _, err := ch.QueueDelete(queue, false, false, false); err == nil {
		queues++
	}
	for _, q := range plan.Queues {
		if q.Name == queue {
			continue
		}
		if _, err := ch.QueueDelete(q.Name, false, false, false); err == nil {
			queues++
		}
	}
	for _, e := range plan.Exchanges {
		if err := ch.ExchangeDelete(e.Name, false, false); err == nil {
			exchanges++
		}
	}
	fmt.Printf("removed what this run declared: %d queues, %d exchanges (prefix %s)\n", queues, exchanges, cfg.Prefix)
}

// redactURI hides the password of uri, for printing.
func redactURI(uri string) string {
	u, err := url.Parse(uri)
	if err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") || u.Host == "" || u.Opaque != "" {
		return "(unparseable amqp uri)" // url.Parse takes "amqp//user:pass@host/" for a path
	}
	return u.Redacted()
}
