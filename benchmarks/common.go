package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"net/url"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// env is what every scenario shares: the broker, the run's name prefix and the record
// of what was declared.
type env struct {
	uri    string
	prefix string
	reg    *registry
	sz     sizes
	mode   string
	// noSweep: the broker is not the one the machine's rabbitmqctl reaches (-also).
	noSweep bool
	// dlxPrefetch: the broker's dead_letter_worker_consumer_prefetch during -scale.
	dlxPrefetch string
}

// name returns a queue or exchange name under the run's prefix.
func (e *env) name(parts ...string) string {
	return e.prefix + "." + strings.Join(parts, ".")
}

func (e *env) dial() (*amqp.Connection, error) {
	conn, err := amqp.Dial(e.uri)
	if err != nil {
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err // a URI parse error would carry the password
		}
		return nil, fmt.Errorf("connect to broker: %w", err)
	}
	return conn, nil
}

// declare declares t on a channel of its own and records it for deletion.
func (e *env) declare(conn *amqp.Connection, t topology.Topology) error {
	e.reg.topology(t)
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close() //nolint:errcheck // a failed declare closed it already
	return t.Apply(ch, topology.ModeDeclare)
}

// registry records every queue and exchange the run declares.
type registry struct {
	mu        sync.Mutex
	unsure    bool // something may have been declared that was not recorded
	queues    []string
	exchanges []string
}

func (r *registry) queue(names ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, n := range names {
		if !slices.Contains(r.queues, n) {
			r.queues = append(r.queues, n)
		}
	}
}

func (r *registry) exchange(names ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, n := range names {
		if !slices.Contains(r.exchanges, n) {
			r.exchanges = append(r.exchanges, n)
		}
	}
}

func (r *registry) topology(t topology.Topology) {
	for _, q := range t.Queues {
		r.queue(q.Name)
	}
	for _, x := range t.Exchanges {
		r.exchange(x.Name)
	}
}

func (r *registry) take() (queues, exchanges []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	queues, exchanges = r.queues, r.exchanges
	r.queues, r.exchanges = nil, nil
	return queues, exchanges
}

// markUnsure records that a declaration may have happened unrecorded: the next
// cleanup sweeps.
func (r *registry) markUnsure() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.unsure = true
}

func (r *registry) takeUnsure() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	u := r.unsure
	r.unsure = false
	return u
}

// cleanup deletes every recorded queue and exchange and, with sweep (on a local broker
// with rabbitmqctl), any other name under the run's prefix: a backend that failed
// half-way through its declarations, or an interrupted scenario, leaves names nobody
// recorded.
func (e *env) cleanup(sweep bool) error {
	queues, exchanges := e.reg.take()
	var q2, x2 []string
	if sweep {
		q2, x2 = e.sweep()
	}
	for _, q := range q2 {
		if !slices.Contains(queues, q) {
			queues = append(queues, q)
		}
	}
	for _, x := range x2 {
		if !slices.Contains(exchanges, x) {
			exchanges = append(exchanges, x)
		}
	}
	if len(queues)+len(exchanges) == 0 {
		return nil
	}
	conn, err := e.dial()
	if err != nil {
		e.reg.queue(queues...) // for the next attempt
		e.reg.exchange(exchanges...)
		return fmt.Errorf("delete %d queues and %d exchanges: %w", len(queues), len(exchanges), err)
	}
	defer conn.Close() //nolint:errcheck
	var errs []error
	del := func(kind, name string, f func(*amqp.Channel) error) {
		ch, err := conn.Channel()
		if err == nil {
			err = f(ch)
			_ = ch.Close()
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("delete %s %s: %w", kind, name, err))
		}
	}
	for _, q := range queues {
		del("queue", q, func(ch *amqp.Channel) error { _, err := ch.QueueDelete(q, false, false, false); return err })
	}
	for _, x := range exchanges {
		del("exchange", x, func(ch *amqp.Channel) error { return ch.ExchangeDelete(x, false, false) })
	}
	return errors.Join(errs...)
}

// sweep lists the broker's queues and exchanges under the run's prefix with
// rabbitmqctl, when the broker is on this machine and the tool works; else nothing.
func (e *env) sweep() (queues, exchanges []string) {
	if e.noSweep {
		return nil, nil
	}
	u, err := url.Parse(e.uri)
	if err != nil || (u.Hostname() != "127.0.0.1" && u.Hostname() != "localhost") {
		return nil, nil
	}
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		return nil, nil
	}
	vhost := "/"
	if p := strings.TrimPrefix(u.Path, "/"); p != "" {
		vhost, _ = url.PathUnescape(p)
	}
	list := func(what string) []string {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, "rabbitmqctl", "-q", "-p", vhost, what, "--no-table-headers", "name").Output()
		if err != nil {
			return nil
		}
		var names []string
		sc := bufio.NewScanner(strings.NewReader(string(out)))
		for sc.Scan() {
			if n := strings.TrimSpace(sc.Text()); strings.HasPrefix(n, e.prefix+".") {
				names = append(names, n)
			}
		}
		return names
	}
	return list("list_queues"), list("list_exchanges")
}

// prefill publishes msgs to queue through the default exchange, persistent and
// confirmed, as watermill-amqp's publisher would marshal them.
func prefill(ctx context.Context, conn *amqp.Connection, queue string, msgs []*message.Message) error {
	return publishConfirmed(ctx, conn, queue, len(msgs), func(i int) (amqp.Publishing, error) {
		return wamqp.DefaultMarshaler{}.Marshal(msgs[i])
	})
}

// publishConfirmed publishes next(0) .. next(n-1) to queue through the default
// exchange on a confirm channel of its own, waiting for the confirms 1,000 at a time.
func publishConfirmed(ctx context.Context, conn *amqp.Connection, queue string, n int, next func(i int) (amqp.Publishing, error)) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close() //nolint:errcheck
	if err := ch.Confirm(false); err != nil {
		return err
	}
	var pending []*amqp.DeferredConfirmation
	wait := func() error {
		for _, dc := range pending {
			ok, err := dc.WaitContext(ctx)
			if err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("publish to %s nacked", queue)
			}
		}
		pending = pending[:0]
		return nil
	}
	for i := range n {
		p, err := next(i)
		if err != nil {
			return err
		}
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, p)
		if err != nil {
			return err
		}
		if pending = append(pending, dc); len(pending) == 1000 {
			if err := wait(); err != nil {
				return err
			}
		}
	}
	return wait()
}

// queueDepth returns the number of ready messages in queue.
func queueDepth(conn *amqp.Connection, queue string) (int, error) {
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	defer ch.Close() //nolint:errcheck
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0, err
	}
	return q.Messages, nil
}

// parallel runs f(i) for i in [0, n) on workers goroutines and returns the first error.
func parallel(ctx context.Context, n, workers int, f func(i int) error) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
		next  = make(chan int)
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := f(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
		}()
	}
	for i := 0; i < n; i++ {
		mu.Lock()
		failed := first != nil
		mu.Unlock()
		if failed || ctx.Err() != nil {
			break
		}
		next <- i
	}
	close(next)
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	return first
}

// quantiles of a sample, in ms.
type quantiles struct {
	P50 float64 `json:"p50"`
	P95 float64 `json:"p95"`
	P99 float64 `json:"p99"`
	Max float64 `json:"max"`
}

func quantilesOf(d []time.Duration) quantiles {
	if len(d) == 0 {
		return quantiles{}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	at := func(q float64) float64 { // nearest rank
		i := int(math.Ceil(q*float64(len(s)))) - 1
		return ms(s[min(max(i, 0), len(s)-1)])
	}
	return quantiles{P50: at(0.50), P95: at(0.95), P99: at(0.99), Max: ms(s[len(s)-1])}
}

// ms is d in milliseconds, to 0.1 ms.
func ms(d time.Duration) float64 { return round(float64(d)/float64(time.Millisecond), 1) }

func round(x float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.Round(x*p) / p
}

func ptr(x float64) *float64 { return &x }

// rssBytes returns VmRSS from /proc/self/status after a full GC that returns freed
// memory to the OS.
func rssBytes() (int64, error) {
	runtime.GC()
	debug.FreeOSMemory()
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close() //nolint:errcheck
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			fields := strings.Fields(rest) // "123456 kB"
			if len(fields) != 2 || fields[1] != "kB" {
				return 0, fmt.Errorf("unexpected VmRSS line %q", sc.Text())
			}
			kb, err := strconv.ParseInt(fields[0], 10, 64)
			return kb * 1024, err
		}
	}
	return 0, errors.New("no VmRSS in /proc/self/status")
}

func numCPU() int { return runtime.NumCPU() }

// brokerVersion returns the version the broker announces, or "unknown".
func (e *env) brokerVersion() string {
	conn, err := e.dial()
	if err != nil {
		return "unknown"
	}
	defer conn.Close() //nolint:errcheck
	if v, ok := conn.Properties["version"].(string); ok {
		return v
	}
	return "unknown"
}

// dueOf returns the due time recorded on msg (keys.Due).
func dueOf(msg *message.Message) (time.Time, error) {
	return time.Parse(time.RFC3339Nano, msg.Metadata.Get(keys.Due))
}

// tierName spells a tier as the library names its queue and routing header.
func tierName(d time.Duration) string { return names.Tier(d) }

// deadLetterRoutingKeyArg is the queue argument RabbitMQ dead-letters with.
const deadLetterRoutingKeyArg = "x-dead-letter-routing-key"
