package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/console"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/xdeath"
)

// counting is a console.Broker that counts what each listing read (ops'
// ListResult.Scanned: messages taken with basic.get and kept unacked).
type counting struct {
	console.Broker
	mu      sync.Mutex
	lists   int
	most    int
	depth   int
	matched int
}

func (c *counting) List(ctx context.Context, s ops.Source, opts ops.ListOptions) (ops.ListResult, error) {
	r, err := c.Broker.List(ctx, s, opts)
	c.mu.Lock()
	c.lists++
	c.most, c.depth, c.matched = max(c.most, r.Scanned), r.Depth, len(r.Messages)
	c.mu.Unlock()
	return r, err
}

// BenchmarkConsolePoisonFirstPage fills a poison queue with 100,000 messages, then
// times opening the console's poison page (its first page, grouped by error) with the
// console's default window (--window 1000) and with 10,000, and checks through the
// broker calls' counts that no listing read more than the window. The queue is deleted
// at the end. Run it alone:
//
//	AMQP_URI=... cmd/amqpretry/go.sh test -run '^$' -bench ConsolePoisonFirstPage -benchtime 1x .
func BenchmarkConsolePoisonFirstPage(b *testing.B) {
	const fill = 100_000
	brokertest.Dial(b)
	prefix := brokertest.Prefix(b)
	cfg := amqpretry.Config{Prefix: prefix, Backend: delay.TTLTiers(testTiers...)}
	plan, err := cfg.Plan()
	if err != nil {
		b.Fatal(err)
	}
	brokertest.CleanupTopology(b, plan)
	b.Setenv(uriEnv, brokertest.URI())
	if code, out, errOut := runArgs("topology", "apply", "--prefix", prefix, "--tiers", "1s,2s"); code != exitOK {
		b.Fatalf("apply: %d %s%s", code, out, errOut)
	}
	poison := prefix + ".poison"
	start := time.Now()
	publishPoison(b, poison, fill)
	b.Logf("filled %s with %d messages in %s", poison, fill, time.Since(start).Round(time.Millisecond))

	o, err := ops.New(ops.Config{URI: brokertest.URI(), Retry: cfg})
	if err != nil {
		b.Fatal(err)
	}
	defer o.Close()
	for _, window := range []int{consoleWindow, 10_000} {
		b.Run(fmt.Sprintf("window=%d", window), func(b *testing.B) { firstPage(b, o, window, fill) })
	}
}

// firstPage times GET /poison on a console with this window over the filled queue.
func firstPage(b *testing.B, o *ops.Ops, window, fill int) {
	broker := &counting{Broker: o}
	token := console.NewToken()
	srv := httptest.NewUnstartedServer(nil)
	c, err := console.New(console.Config{
		Open:  func() (console.Broker, error) { return broker, nil },
		Token: token, Hosts: []string{srv.Listener.Addr().String()}, Window: window,
	})
	if err != nil {
		b.Fatal(err)
	}
	srv.Config.Handler = c
	srv.Start()
	defer srv.Close()
	jar, _ := cookiejar.New(nil)
	cl := &http.Client{Jar: jar, Timeout: 10 * time.Minute}
	if resp, err := cl.Get(srv.URL + "/?" + url.Values{"token": {token}}.Encode()); err != nil {
		b.Fatal(err)
	} else {
		_ = resp.Body.Close()
	}
	b.ResetTimer()
	for b.Loop() {
		resp, err := cl.Get(srv.URL + "/poison")
		if err != nil {
			b.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "p000001") {
			b.Fatalf("poison page: %d\n%.500s", resp.StatusCode, body)
		}
	}
	b.StopTimer()
	if broker.most > window || broker.lists == 0 || broker.depth < fill {
		b.Fatalf("a listing read %d messages of %d (window %d, %d listings)", broker.most, broker.depth, window, broker.lists)
	}
	b.ReportMetric(float64(broker.most), "msgs-read/op")
	b.Logf("each page read %d of the %d messages (window %d), %d matching", broker.most, broker.depth, window, broker.matched)
}

// publishPoison publishes n poisoned messages to queue, with confirms, a thousand in
// flight at a time.
func publishPoison(b *testing.B, queue string, n int) {
	b.Helper()
	ch, err := brokertest.Dial(b).Channel()
	if err != nil {
		b.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		b.Fatal(err)
	}
	errs := []string{"warehouse offline", "card declined", "timeout after 30s"}
	var pending []*amqp.DeferredConfirmation
	for i := range n {
		msg := message.NewMessage(fmt.Sprintf("p%06d", i), []byte(fmt.Sprintf("order %d", i)))
		middleware.Envelope{Queue: "orders", Handler: "h", Reason: amqpretry.ReasonMaxAttempts, Error: errs[i%len(errs)],
			Attempt: 5, MaxAttempts: 5, LastFailure: time.Now()}.Write(msg.Metadata)
		pub, err := (xdeath.Marshaler{}).Marshal(msg)
		if err != nil {
			b.Fatal(err)
		}
		pub.DeliveryMode = amqp.Persistent
		dc, err := ch.PublishWithDeferredConfirm("", queue, true, false, pub)
		if err != nil {
			b.Fatal(err)
		}
		pending = append(pending, dc)
		if len(pending) == 1000 || i == n-1 {
			for _, dc := range pending {
				if ok, err := dc.WaitContext(context.Background()); !ok || err != nil {
					b.Fatalf("publish to %s not confirmed: %v", queue, err)
				}
			}
			pending = pending[:0]
		}
	}
}
