// Package noloss is the no-loss test of amqpretry (issues 8, 16, 17 and 20): N messages
// through a consumer process that is killed and restarted, brokers whose connections
// are closed and whose application or nodes are stopped, killed and started, each
// while retries wait, and at the end every message accounted for by its UUID. The test
// is TestNoLoss; the consumer is the main package in ./consumer. This file has what
// both share: the variants (backend, and how many retries RabbitMQ 4.3 holds in the
// work queue), the configuration, the fate of a message and the record the consumer
// writes for each message it handled.
//
// Against one broker you may disturb (the test closes every connection of that broker
// and stops its application), here the RabbitMQ 4.3 node of scripts/rabbitmq4.sh:
//
//	AMQPRETRY_NOLOSS=1 AMQPRETRY_BROKER_RESTART=1 \
//	  AMQP_URI=$(scripts/rabbitmq4.sh 4.3 uri) AMQPRETRY_RABBITMQCTL="$PWD/scripts/rabbitmq4.sh 4.3 ctl" \
//	  go test -count=1 -timeout 30m -run '^TestNoLoss$' -v ./internal/testsupport/noloss
//
// TestNoLossSwitch (switch_test.go) changes the backend, tiers, levels and prefix
// mid-run while retries wait in the old storage, stopping the consumer while it works
// at each change; it disturbs nothing else (no AMQPRETRY_BROKER_RESTART):
//
//	AMQPRETRY_NOLOSS=1 go test -count=1 -timeout 20m -run '^TestNoLossSwitch$' -v ./internal/testsupport/noloss
//
// The ordered variants (ttl-tiers+ordered, and delayed-retry+ordered on RabbitMQ 4.3)
// keep each key's order (Config.OrderKey, docs/ordering.md): each message carries one
// of OrderKeys keys, and the test also checks that no message of a key was handled for
// the first time after a later one of its key was (out_of_order on the NOLOSS line).
// TestOrderPartitions (orderpartitions_test.go) shares 40 keys among 6 partition work
// queues consumed by 3 processes, one of them killed while its keys are blocked; it
// disturbs no broker:
//
//	AMQPRETRY_NOLOSS=1 go test -count=1 -timeout 15m -run '^TestOrderPartitions$' -v ./internal/testsupport/noloss
//
// Against the three-node RabbitMQ 4.3 cluster of scripts/cluster.sh, which the test
// starts (building it the first time; root) and stops (see cluster_test.go):
//
//	AMQPRETRY_NOLOSS=1 AMQPRETRY_NOLOSS_CLUSTER=1 go test -count=1 -timeout 30m -run '^TestNoLoss$' -v ./internal/testsupport/noloss
//
// Settings, all from the environment:
//
//	AMQPRETRY_NOLOSS=1               run the test (it skips otherwise)
//	AMQPRETRY_BROKER_RESTART=1       one broker: allow its disturbance (brokertest)
//	AMQP_URI, AMQPRETRY_RABBITMQCTL  one broker: where, and its rabbitmqctl (brokertest)
//	AMQPRETRY_NOLOSS_N               messages per variant (5000, or the variant's N; 2000
//	                                 in the cluster)
//	AMQPRETRY_NOLOSS_MAJOR           watermill-amqp major of the consumer: 3 (default) or 2
//	AMQPRETRY_NOLOSS_BACKENDS        variants to run, comma-separated (Variants' names;
//	                                 default all, in the cluster ttl-tiers,binary-levels)
//	AMQPRETRY_NOLOSS_SABOTAGE        proves the test: each consumer process loses this many
//	                                 messages, and the test must fail
//	AMQPRETRY_NOLOSS_CLUSTER=1       run on the cluster instead of AMQP_URI
//	AMQPRETRY_NOLOSS_CLUSTER_KEEP=1  leave the cluster running at the end
//	AMQPRETRY_NOLOSS_CLUSTER_SCRIPT  path of scripts/cluster.sh
//	AMQPRETRY_NOLOSS_LOGS            a directory for each consumer's log (and, in the
//	                                 cluster, a CSV of every retry's due and arrival times)
package noloss

import (
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp2lib "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wamqp3lib "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/wamqp2"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// Variant is one way of retrying that the test runs: a backend, and how many retries
// RabbitMQ 4.3 holds in the work queue first.
type Variant struct {
	// Name is the variant's name on the NOLOSS line: the backend's, or
	// "ttl-tiers+held-retries" for the two-stage form.
	Name    string
	Backend delay.Backend
	// delay.HeldRetries is amqpretry.delay.HeldRetries.
	HeldRetries int
	// Failures is how many attempts of a fates.Transient message fail: every retry of
	// the variant's stages is used (the two-stage form needs one more failure than
	// the retries it holds in the work queue to reach its copying backend).
	Failures int
	// Ordered keeps each key's order (amqpretry.Config.OrderKey: OrderKeyOf): the
	// messages carry one of OrderKeys keys, each key's published in the order of
	// their index, and the work queue has a single active consumer.
	Ordered bool
	// N is the variant's number of messages when the test is not told one (0: the
	// test's default).
	N int
}

// Variants lists every variant, in the order the test runs them.
func Variants() []Variant {
	return []Variant{
		{Name: delay.TTLTiers().Name(), Backend: delay.TTLTiers(), Failures: 2},
		{Name: delay.BinaryLevels(0).Name(), Backend: delay.BinaryLevels(0), Failures: 2},
		{Name: delay.DelayedExchange().Name(), Backend: delay.DelayedExchange(), Failures: 2},
		{Name: delay.DelayedRetry(0).Name(), Backend: delay.DelayedRetry(0), Failures: 2},
		{Name: delay.TTLTiers().Name() + "+held-retries", Backend: delay.TTLTiers(), HeldRetries: 2, Failures: 3},
		{Name: delay.TTLTiers().Name() + "+ordered", Backend: delay.TTLTiers(), Failures: 2, Ordered: true},
		// A key's transient message holds the key back for two held delays (16 s), and
		// about one message in five of each key is transient: 1,000 messages, about 21
		// per key, keep each key's chain of retries near a minute and a half.
		{Name: delay.DelayedRetry(0).Name() + "+ordered", Backend: delay.DelayedRetry(0), Failures: 2, Ordered: true, N: 1000},
	}
}

// OrderKeys is how many order keys the messages of an ordered variant carry: message i
// has key OrderKeyName(i % OrderKeys). A prime, so that every key gets the fates of
// fates.For in the same proportions (1% permanent, 20% transient).
const OrderKeys = 47

// KeyMetadata is the metadata that carries a message's order key.
const KeyMetadata = "noloss-key"

// OrderKeyName is the name of order key k.
func OrderKeyName(k int) string { return fmt.Sprintf("k%02d", k) }

// OrderKeyOf is the Config.OrderKey of an ordered run: the message's KeyMetadata.
func OrderKeyOf(msg *message.Message) string { return msg.Metadata.Get(KeyMetadata) }

// VariantNamed returns the variant called name.
func VariantNamed(name string) (Variant, bool) {
	for _, v := range Variants() {
		if v.Name == name {
			return v, true
		}
	}
	return Variant{}, false
}

// HoldsRetries tells whether retries of v wait in the work queue itself (RabbitMQ 4.3's
// delayed retry of quorum queues).
func (v Variant) HoldsRetries() bool { return v.Backend == delay.DelayedRetry(0) || v.HeldRetries > 0 }

// Copies tells whether retries of v are copies parked in delay queues (some of them
// at least).
func (v Variant) Copies() bool { return v.Backend != delay.DelayedRetry(0) }

// Policy is the retry policy of the run: short, so that a run takes a minute or two.
// MaxAttempts leaves one attempt spare after the transient failures: a message
// poisoned with max-attempts is a failure of the run, not an expected outcome. The
// delayed-retry backend takes no schedule: it retries every HeldDelay. Against one
// broker copies wait 1 s, then 2 s; in a cluster 5 s, then 10 s, so that retries
// still wait when a node is killed or restarted: finding the node to kill and killing
// it takes seconds (rabbitmqctl, scripts/cluster.sh).
func (s Setup) Policy() amqpretry.Policy {
	v := s.Variant
	p := amqpretry.Policy{MaxAttempts: v.Failures + 2}
	switch {
	case v.Backend == delay.DelayedRetry(0):
	case len(s.Nodes) > 0:
		p.Delays = []time.Duration{5 * time.Second, 10 * time.Second}
	default:
		p.Delays = []time.Duration{time.Second, 2 * time.Second}
	}
	if len(p.Delays) > 0 {
		p.Jitter = -1 // one tier per delay (Setup.Config): none jittered off it
	}
	return p
}

// Levels is the binary-levels backend's level count in this test: delays up to 7 s
// against one broker, 15 s in a cluster.
func (s Setup) Levels() int {
	if len(s.Nodes) > 0 {
		return 4
	}
	return 3
}

// Setup is what the test and the consumer build a run's configuration from.
type Setup struct {
	// URI gives the credentials and vhost (and, for one broker, the address).
	URI string
	// Nodes, "host:port", are the nodes of a cluster: connections then go through
	// amqpretry.Cluster(Nodes...). Empty for one broker.
	Nodes   []string
	Variant Variant
	Prefix  string
	// Major is watermill-amqp's major version: 2 or 3.
	Major  int
	Logger watermill.LoggerAdapter

	// What a run that changes backends while retries wait (TestNoLossSwitch) sets for
	// each of its configurations; the zero values keep the variant's own.
	//
	// StoragePrefix is Config.Prefix (default Prefix, which also names the run's work,
	// results and poison queues: the poison queue stays "<Prefix>.poison").
	StoragePrefix string
	// Tiers are the tiers of ttl-tiers (default: one tier per delay of the policy).
	Tiers []time.Duration
	// LevelsOf are the levels of binary-levels (default Levels()).
	LevelsOf int
	// QuorumWork makes the work and results queues quorum queues whatever the variant.
	QuorumWork bool
	// Topology is Config.Topology (default: declare).
	Topology topology.Mode
	// Netns, a network namespace's path (/run/netns/NAME), is where the connections
	// of AMQPConfig are made, the process staying where it is (the partition test's
	// own connections, Linux only). Empty: the process's namespace.
	Netns string
}

// Quorum tells whether the run's work and results queues are quorum queues: in a
// cluster (replicated, as a cluster's users declare them), and wherever RabbitMQ
// holds retries in the work queue (which needs one).
func (s Setup) Quorum() bool { return len(s.Nodes) > 0 || s.Variant.HoldsRetries() || s.QuorumWork }

// HeldDelay is how long RabbitMQ 4.3 holds a retry in the work queue
// (delay.HeldRetries's delay, or delay.DelayedRetry's): long enough for the test to see retries waiting there
// through rabbitmqctl, whose every run takes seconds, before and while a fault is
// injected (each retry of a transient message is held twice in a row). 8 s against
// one broker; 15 s in a cluster, where rabbitmqctl answers slower while a node
// restarts.
func (s Setup) HeldDelay() time.Duration {
	if len(s.Nodes) > 0 {
		return 15 * time.Second
	}
	return 8 * time.Second
}

// AMQPConfig is the amqp091-go configuration of every connection of the run: nil for
// one broker, amqpretry.Cluster(Nodes...) for a cluster. Each call returns a new
// dialer.
func (s Setup) AMQPConfig() *amqp.Config {
	if len(s.Nodes) == 0 {
		return nil
	}
	c := amqpretry.Cluster(s.Nodes...)
	if s.Netns != "" {
		c.Dial = dialIn(s.Netns, c.Dial)
	}
	return c
}

// CloseConn closes conn, waiting at most 2 s for the broker's close-ok: a node that
// lost its cluster's majority may never answer, and amqp091-go's Close waits for it
// for as long as heartbeats flow.
func CloseConn(conn *amqp.Connection) {
	_ = conn.CloseDeadline(time.Now().Add(2 * time.Second))
}

// Dial opens a connection as the run's connections are opened.
func (s Setup) Dial() (*amqp.Connection, error) {
	if c := s.AMQPConfig(); c != nil {
		return amqp.DialConfig(s.URI, *c)
	}
	return amqp.Dial(s.URI)
}

// QueueArgs are the arguments of the work and results queues.
func (s Setup) QueueArgs() amqp.Table {
	if s.Quorum() {
		return amqp.Table{"x-queue-type": "quorum"}
	}
	return nil
}

// Config is the amqpretry configuration of the run, the same in the test (which builds
// it once to declare the topology and to find out whether the broker can run the
// variant) and in the consumer.
func (s Setup) Config() amqpretry.Config {
	v := s.Variant
	cfg := amqpretry.Config{
		Backend: delay.HeldRetries(v.HeldRetries, s.HeldDelay(), v.Backend),
		Prefix:  s.Prefix,
		Policy:  s.Policy(),
		// The fates fail messages by attempt, in waves (a transient message fails its
		// first two attempts): a first delivery failing and the wave of retries behind
		// it failing again is what an outage looks like (docs/outage.md), and the
		// queue would then go at the probes' pace. This test counts retries under
		// faults; the outage has tests of its own, its Close included.
		Outage: amqpretry.Outage{Consecutive: -1},
		Logger: s.Logger,
	}
	switch v.Backend.Name() {
	case delay.TTLTiers().Name():
		tiers := cfg.Policy.Delays // one tier per delay of the policy
		if s.Tiers != nil {
			tiers = s.Tiers
		}
		cfg.Backend = delay.TTLTiers(tiers...)
	case delay.BinaryLevels(0).Name():
		levels := s.Levels()
		if s.LevelsOf != 0 {
			levels = s.LevelsOf
		}
		cfg.Backend = delay.BinaryLevels(levels)
	case delay.DelayedRetry(0).Name():
		cfg.Backend = delay.DelayedRetry(s.HeldDelay())
	}
	if s.StoragePrefix != "" {
		cfg.Prefix, cfg.PoisonQueue = s.StoragePrefix, s.Prefix+".poison"
	}
	cfg.Topology = s.Topology
	if v.Ordered {
		cfg.OrderKey = OrderKeyOf
	}
	return cfg
}

// Retry is what the consumer uses of wamqp2.Retry and wamqp3.Retry.
type Retry interface {
	AddHandler(router *message.Router, handlerName, topic string, handler message.NoPublishHandlerFunc) (*message.Handler, error)
	Close() error
}

// New builds the run's Retry with watermill-amqp s.Major: a durable-queue subscriber
// config for s.URI (quorum queues as Quorum says, connections through
// amqpretry.Cluster in a cluster) and Config().
func New(s Setup) (Retry, error) {
	switch s.Major {
	case 2:
		sub := wamqp2lib.NewDurableQueueConfig(s.URI)
		sub.Queue.Arguments = s.QueueArgs()
		sub.Connection.AmqpConfig = s.AMQPConfig()
		return wamqp2.New(sub, s.Config())
	case 3:
		sub := wamqp3lib.NewDurableQueueConfig(s.URI)
		sub.Queue.Arguments = s.QueueArgs()
		sub.Connection.AmqpConfig = s.AMQPConfig()
		return wamqp3.New(sub, s.Config())
	}
	return nil, fmt.Errorf("watermill-amqp major %d: want 2 or 3", s.Major)
}

// ErrMajor is returned by ParseMajor for anything but "", "2" and "3".
var ErrMajor = errors.New("want 2 or 3")

// MajorEnv selects watermill-amqp's major version for the consumer: "2" or "3" (the
// default).
const MajorEnv = "AMQPRETRY_NOLOSS_MAJOR"

// ParseMajor reads MajorEnv's value: "" is 3.
func ParseMajor(s string) (int, error) {
	switch s {
	case "", "3":
		return 3, nil
	case "2":
		return 2, nil
	}
	return 0, fmt.Errorf("%s=%q: %w", MajorEnv, s, ErrMajor)
}

// Names of the queues of a run with the given prefix.
func WorkQueue(prefix string) string    { return prefix + ".work" }
func ResultsQueue(prefix string) string { return prefix + ".results" }

// Headers of a result record.
const (
	// AttemptHeader carries the attempt that succeeded.
	AttemptHeader = "noloss-attempt"
	// ArrivedHeader carries when the delivery that succeeded arrived (Unix ms).
	ArrivedHeader = "noloss-arrived-ms"
	// LateHeader carries how late that delivery was, a retry, against the time it was
	// due (ms; absent on a first delivery): its envelope's Due for a copy, the time of
	// the failure plus Setup.HeldDelay for a retry held in the work queue.
	LateHeader = "noloss-late-ms"
	// HopsHeader lists the message's earlier retries that failed, as the consumer
	// process that handled it saw them: "arrived ms:late ms", comma-separated.
	HopsHeader = "noloss-hops"
	// HandledHeader carries when the handler began the run that succeeded (Unix ns):
	// the order in which the messages were handled, across the consumer processes of
	// a run (one machine, one clock).
	HandledHeader = "noloss-handled-ns"
	// QueueHeader names the work queue the message was handled from, and PIDHeader
	// the consumer process that handled it.
	QueueHeader = "noloss-queue"
	PIDHeader   = "noloss-pid"
)

// Ready is the line the consumer prints on stdout once its handlers are subscribed.
const Ready = "noloss-consumer ready"
