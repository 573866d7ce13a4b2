package amqp1

import (
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
)

// TestPubSub runs Watermill's own Pub/Sub test suite on a Publisher and a Subscriber.
//
// Features, declared for what the Pub/Sub does:
//   - ConsumerGroups false: a topic is one queue; Subscribers of it compete for its
//     messages. Fan-out is the broker's business (bind queues to an exchange and
//     publish to ExchangeAddress).
//   - ExactlyOnceDelivery false: at-least-once; a message whose settlement is lost
//     with its link comes again.
//   - GuaranteedOrder with GuaranteedOrderWithSingleSubscriber: one consumer of a
//     queue gets its messages in order; several consumers interleave.
//   - Persistent true: durable queues, durable messages.
//   - ForceShort unless AMQP1_SUITE_FULL=1: see below.
//   - RestartServiceCommand: closes this test's connections from the broker's side
//     (rabbitmqctl close_connection), when AMQP1_RABBITMQCTL or the 4.3 node's script is
//     at hand and the race detector is off (the suite's TestReconnect races with
//     itself in Watermill v1.5.1); TestReconnect skips otherwise, and
//     TestReconnectBrokerSideClose covers reconnection under -race.
func TestPubSub(t *testing.T) {
	uri := requireBroker(t)
	queues := newQueueRecorder(t)
	// Some tests of the suite leave Subscribers open (TestPublishSubscribeInOrder closes
	// its multiplied subscriber before subscribing: a deferred require.NoError(t,
	// sub.Close()) evaluates Close at once). Open, they would declare their queue again
	// after the cleanup deleted it: close every one first (cleanups run last-in,
	// first-out).
	var (
		subsMu sync.Mutex
		subs   []*Subscriber
	)
	t.Cleanup(func() {
		subsMu.Lock()
		defer subsMu.Unlock()
		for _, sub := range subs {
			_ = sub.Close()
		}
	})
	containerPrefix := "amqp1-test-" + runID + "-suite-"

	// The suite's full mode reads 10,000 messages within fixed budgets (45 s in
	// TestPublisherClose, 60 s in TestReconnect, which has no short mode). On quorum
	// queues, on 2 cores shared with other work, TestPublisherClose took 35 s (quiet
	// machine) to 65 s (load 14), TestReconnect 60-69 s: the default run is the suite's
	// short mode (ForceShort), and AMQP1_SUITE_FULL=1 runs the full mode, with credit
	// 10 (everything else, one message at a time per Subscribe, order, acks, is the
	// same at any credit).
	full := os.Getenv("AMQP1_SUITE_FULL") == "1"
	credit := 0 // the default, 1
	if full {
		credit = 10
	}

	features := tests.Features{
		ForceShort:                          !full,
		ConsumerGroups:                      false,
		ExactlyOnceDelivery:                 false,
		GuaranteedOrder:                     true,
		GuaranteedOrderWithSingleSubscriber: true,
		Persistent:                          true,
		GenerateTopicFunc: func(tctx tests.TestContext) string {
			return "amqp1-test-" + runID + "-" + string(tctx.TestID)
		},
	}
	if ctl := findRabbitmqctl(); ctl != nil && !raceEnabled {
		// The suite runs this command while it publishes; it must not touch other
		// clients of the broker, so it closes only the connections of this test.
		script := `set -e
pids=$("$@" list_connections -q --no-table-headers pid container_id | awk -v p="$PREFIX" 'index($2, p) == 1 {print $1}')
for pid in $pids; do "$@" close_connection "$pid" "amqp1 test: broker-side close" >/dev/null; done`
		features.RestartServiceCommand = append([]string{"env", "PREFIX=" + containerPrefix, "bash", "-c", script, "ctl"}, ctl...)
	}

	constructor := func(t *testing.T) (message.Publisher, message.Subscriber) {
		pub, err := NewPublisher(PublisherConfig{
			URI:         uri,
			ContainerID: containerPrefix + "pub-" + strings.ReplaceAll(t.Name(), "/", "-"),
		}, testLogger())
		if err != nil {
			t.Fatal(err)
		}
		sub, err := NewSubscriber(SubscriberConfig{
			URI:          uri,
			ContainerID:  containerPrefix + "sub-" + strings.ReplaceAll(t.Name(), "/", "-"),
			QueueName:    queues.queueName,
			CloseTimeout: 5 * time.Second,
			Credit:       credit,
		}, testLogger())
		if err != nil {
			t.Fatal(err)
		}
		subsMu.Lock()
		subs = append(subs, sub)
		subsMu.Unlock()
		return pub, sub
	}
	tests.TestPubSub(t, features, constructor, nil)
}
