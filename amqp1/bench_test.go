package amqp1

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// The redelivery benchmarks measure the broker-side retry path on RabbitMQ 4.3: 3,000
// messages (AMQP1_BENCH_MESSAGES), each failing once, settled modified{delivery-failed,
// x-opt-delivery-time: now+1ms}, then accepted when it comes back. One iteration is
// the whole run; run them with
//
//	go test -run '^$' -bench Redeliver -benchtime 1x
//
// msgs/s counts messages done (accepted after their one failure); deliveries/s counts
// both deliveries of each.

func benchMessages() int {
	n := 3000
	if s := getenvInt("AMQP1_BENCH_MESSAGES"); s > 0 {
		n = s
	}
	return n
}

// BenchmarkRedeliverRaw: go-amqp alone, one receiver.
func BenchmarkRedeliverRaw(b *testing.B) {
	for _, credit := range []int32{1, 50} {
		b.Run(fmt.Sprintf("credit=%d", credit), func(b *testing.B) {
			uri := requireBroker43(b)
			n := benchMessages()
			for i := 0; i < b.N; i++ {
				queue := queueName(b, fmt.Sprintf("bench-raw-%d-%d", credit, i))
				declareQueue(b, queue, "quorum", nil)
				prefill(b, uri, queue, n)
				ctx := testContext(b, 5*time.Minute)
				conn, err := dialTest(ctx, uri, "amqp1-test-"+runID+"-bench")
				if err != nil {
					b.Fatal(err)
				}
				session, err := conn.NewSession(ctx, nil)
				if err != nil {
					b.Fatal(err)
				}
				rcv, err := session.NewReceiver(ctx, QueueAddress(queue), &amqp.ReceiverOptions{
					Credit:                    credit,
					RequestedSenderSettleMode: amqp.SenderSettleModeUnsettled.Ptr(),
					SettlementMode:            amqp.ReceiverSettleModeFirst.Ptr(),
				})
				if err != nil {
					b.Fatal(err)
				}
				b.ResetTimer()
				start := time.Now()
				done, deliveries := 0, 0
				for done < n {
					m, err := rcv.Receive(ctx, nil)
					if err != nil {
						b.Fatalf("after %d done: %v", done, err)
					}
					deliveries++
					if m.Header == nil || m.Header.DeliveryCount == 0 {
						err = rcv.ModifyMessage(ctx, m, &amqp.ModifyMessageOptions{
							DeliveryFailed: true,
							Annotations:    amqp.Annotations{deliveryTimeAnnotation: time.Now().Add(time.Millisecond).UnixMilli()},
						})
					} else {
						err = rcv.AcceptMessage(ctx, m)
						done++
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				elapsed := time.Since(start)
				b.StopTimer()
				report(b, n, deliveries, elapsed)
				_ = conn.Close()
			}
		})
	}
}

// BenchmarkRedeliverRouter: a Subscriber behind Watermill's router, with a middleware
// that calls Redeliver and returns an error on each message's first delivery.
func BenchmarkRedeliverRouter(b *testing.B) {
	for _, credit := range []int{1, 50} {
		b.Run(fmt.Sprintf("credit=%d", credit), func(b *testing.B) {
			uri := requireBroker43(b)
			n := benchMessages()
			for i := 0; i < b.N; i++ {
				queue := queueName(b, fmt.Sprintf("bench-router-%d-%d", credit, i))
				declareQueue(b, queue, "quorum", nil)
				prefill(b, uri, queue, n)
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
				sub, err := NewSubscriber(SubscriberConfig{URI: uri, Credit: credit}, nil)
				if err != nil {
					b.Fatal(err)
				}
				router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
				if err != nil {
					b.Fatal(err)
				}
				var done, deliveries atomic.Int64
				finished := make(chan struct{})
				errFirst := errors.New("first delivery fails")
				router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
					return func(msg *message.Message) ([]*message.Message, error) {
						out, err := h(msg)
						if err != nil {
							if rerr := Redeliver(msg, time.Now().Add(time.Millisecond), nil); rerr != nil {
								return nil, errors.Join(err, rerr)
							}
						}
						return out, err
					}
				})
				router.AddConsumerHandler("bench", queue, sub, func(msg *message.Message) error {
					deliveries.Add(1)
					if count, _ := DeliveryCount(msg); count == 0 {
						return errFirst
					}
					if done.Add(1) == int64(n) {
						close(finished)
					}
					return nil
				})
				start := time.Now()
				b.ResetTimer()
				go func() { _ = router.Run(ctx) }()
				select {
				case <-finished:
				case <-ctx.Done():
					b.Fatalf("timed out after %d done", done.Load())
				}
				elapsed := time.Since(start)
				b.StopTimer()
				report(b, n, int(deliveries.Load()), elapsed)
				_ = router.Close()
				cancel()
			}
		})
	}
}

func report(b *testing.B, n, deliveries int, elapsed time.Duration) {
	b.ReportMetric(float64(n)/elapsed.Seconds(), "msgs/s")
	b.ReportMetric(float64(deliveries)/elapsed.Seconds(), "deliveries/s")
	b.Logf("%d messages, %d deliveries in %v", n, deliveries, elapsed)
}

// prefill publishes n small messages to queue, confirmed.
func prefill(b *testing.B, uri, queue string, n int) {
	b.Helper()
	pub, err := NewPublisher(PublisherConfig{URI: uri}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	const batch = 100
	for i := 0; i < n; i += batch {
		msgs := make([]*message.Message, 0, batch)
		for j := i; j < i+batch && j < n; j++ {
			msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte("x")))
		}
		if err := pub.Publish(queue, msgs...); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkConsume: a Subscriber acking n messages straight away, by link credit.
func BenchmarkConsume(b *testing.B) {
	for _, credit := range []int{1, 10, 50} {
		b.Run(fmt.Sprintf("credit=%d", credit), func(b *testing.B) {
			uri := requireBroker(b)
			n := benchMessages()
			for i := 0; i < b.N; i++ {
				queue := queueName(b, fmt.Sprintf("bench-consume-%d-%d", credit, i))
				declareQueue(b, queue, "quorum", nil)
				prefill(b, uri, queue, n)
				ctx := testContext(b, 5*time.Minute)
				sub, err := NewSubscriber(SubscriberConfig{URI: uri, Credit: credit}, nil)
				if err != nil {
					b.Fatal(err)
				}
				messages, err := sub.Subscribe(ctx, queue)
				if err != nil {
					b.Fatal(err)
				}
				b.ResetTimer()
				start := time.Now()
				for j := 0; j < n; j++ {
					select {
					case msg := <-messages:
						msg.Ack()
					case <-ctx.Done():
						b.Fatalf("after %d: %v", j, ctx.Err())
					}
				}
				elapsed := time.Since(start)
				b.StopTimer()
				report(b, n, n, elapsed)
				_ = sub.Close()
			}
		})
	}
}
