package wamqp3_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/testsupport/gluetest"
	"github.com/amqpretry/amqpretry/wamqp3"
	"github.com/amqpretry/amqpretry/xdeath"
)

// TestSuite runs the transport packages' test suite (internal/testsupport/gluetest) on
// watermill-amqp v3, against the broker at AMQP_URI.
func TestSuite(t *testing.T) { gluetest.Run(t, major{}) }

// major is watermill-amqp v3 for the suite.
type major struct{}

func (major) Name() string { return "3" }

func config(sub gluetest.Sub) amqp.Config {
	var c amqp.Config
	if sub.Group != "" {
		c = amqp.NewDurablePubSubConfig(sub.URI, amqp.GenerateQueueNameTopicNameWithSuffix(sub.Group))
	} else {
		c = amqp.NewDurableQueueConfig(sub.URI)
	}
	c.Queue.Arguments = sub.QueueArgs
	c.Consume.NoRequeueOnNack = sub.NoRequeueOnNack
	if sub.Prefetch != 0 {
		c.Consume.Qos.PrefetchCount = sub.Prefetch
	}
	if sub.Connection != nil {
		c.Connection.AmqpConfig = sub.Connection
	}
	return c
}

func (major) New(sub gluetest.Sub, cfg amqpretry.Config) (gluetest.Retry, error) {
	r, err := wamqp3.New(config(sub), cfg)
	if err != nil {
		return nil, err // not a typed nil
	}
	return r, nil
}

func (major) Subscriber(t testing.TB, r gluetest.Retry) message.Subscriber {
	t.Helper()
	s, err := amqp.NewSubscriber(r.(*wamqp3.Retry).SubscriberConfig(), gluetest.Logger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func (major) PlainSubscriber(t testing.TB, sub gluetest.Sub) message.Subscriber {
	t.Helper()
	c := config(sub)
	c.Marshaler = xdeath.Marshaler{}
	s, err := amqp.NewSubscriber(c, gluetest.Logger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func (major) Publisher(t testing.TB, sub gluetest.Sub) message.Publisher {
	t.Helper()
	c := config(sub)
	if sub.Group != "" {
		c = amqp.NewDurablePubSubConfig(sub.URI, nil)
	}
	p, err := amqp.NewPublisher(c, gluetest.Logger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func (major) SubscriberFor(t testing.TB, r gluetest.Retry, o gluetest.For) (message.Subscriber, error) {
	c := r.(*wamqp3.Retry).SubscriberConfig()
	if o.GenerateName != nil {
		c = r.(*wamqp3.Retry).SubscriberConfigFor(o.GenerateName)
	}
	if o.Replace != nil {
		c.Queue.GenerateName = o.Replace(c.Queue.GenerateName)
	}
	if o.Connection != nil {
		c.Connection.AmqpConfig = o.Connection
	}
	s, err := amqp.NewSubscriber(c, gluetest.Logger())
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { _ = s.Close() })
	return s, nil
}

func (major) PoisonSubscriber(t testing.TB, r gluetest.Retry) message.Subscriber {
	t.Helper()
	s, err := amqp.NewSubscriber(r.(*wamqp3.Retry).PoisonSubscriberConfig(), gluetest.Logger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}
