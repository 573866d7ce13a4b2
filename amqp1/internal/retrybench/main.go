// Command retrybench measures amqp1.Retry, the delivery-time backend, on a RabbitMQ
// 4.3+ broker, in one run (issue 21 §4), and writes the figures as JSON and text:
//
//   - lateness: how long after its due time each retry arrives in the handler, through
//     Subscriber + router + Retry, and through a raw go-amqp loop (the broker alone);
//     messages trickle in at 10/s and each fails once with its own delay of 200 ms to
//     1 s (a RetryAfter); the first deliveries' publish-to-handler latency, measured at
//     the same time, is the baseline of what any delivery costs then;
//   - retry_path: every message fails once (delay 1 ms) then succeeds, msgs/s done;
//     failure_storm: every delivery fails (delay 10 min, nothing comes back), failures
//     settled per second. Each for Subscriber + router + Retry (ours), a raw go-amqp
//     loop settling modified with x-opt-delivery-time (raw), and the copy ceiling: a
//     raw amqp091-go loop that hands each failure off as a confirmed copy (to the work
//     queue for retry_path, to a quorum queue of copies for failure_storm), then acks;
//     at link credit (prefetch) 1 and 50, variants alternating, rounds on fresh queues;
//   - vs_inprocess_retry: steady-state handled msg/s with 10% of messages failing twice
//     (delays 100 ms, 200 ms), ours ÷ the same router with Watermill's middleware.Retry
//     (which sleeps in the handler), at credit 50 and 1.
//
// Usage, from amqp1/ (the broker URI from AMQP1_URI, default the 4.3 node of
// scripts/rabbitmq4.sh; never printed with its password):
//
//	go run ./internal/retrybench -out benchresults/retrybench
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/amqp1"
	"github.com/amqpretry/amqpretry/middleware"
)

var (
	uri    string
	runID  = watermill.NewShortUUID()[:8]
	logger = watermill.NopLogger{}
)

func main() {
	out := flag.String("out", "benchresults/retrybench", "output path without extension (.json and .txt are written)")
	n := flag.Int("n", 3000, "messages per retry_path / failure_storm run")
	rounds := flag.Int("rounds", 3, "rounds of retry_path / failure_storm / vs_inprocess_retry")
	only := flag.String("only", "lateness,retrypath,storm,inprocess", "scenarios to run")
	credits := flag.String("credits", "1,50", "link credits (prefetch) of retry_path and failure_storm")
	variants := flag.String("variants", "ours,raw,copy", "variants of retry_path and failure_storm")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	flag.Parse()
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "retrybench:", err)
			os.Exit(1)
		}
		defer pprof.StopCPUProfile()
	}
	creditList, variantList = parseInts(*credits), strings.Split(*variants, ",")
	uri = os.Getenv("AMQP1_URI")
	if uri == "" {
		uri = "amqp://guest:guest@127.0.0.1:5675/"
	}
	if err := run(*out, *n, *rounds, *only); err != nil {
		fmt.Fprintln(os.Stderr, "retrybench:", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
}

var (
	creditList  []int
	variantList []string
)

func parseInts(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		var n int
		if _, err := fmt.Sscan(f, &n); err == nil && n > 0 {
			out = append(out, n)
		}
	}
	return out
}

func has(list []string, v string) bool {
	for _, x := range list {
		if x == v {
			return true
		}
	}
	return false
}

// Result is the run's output.
type Result struct {
	RabbitMQ  string    `json:"rabbitmq"`
	CPUs      int       `json:"cpus"`
	LoadStart string    `json:"load_average_start"`
	LoadEnd   string    `json:"load_average_end"`
	Started   time.Time `json:"started"`
	Seconds   float64   `json:"seconds"`
	Messages  int       `json:"messages_per_run"`
	Rounds    int       `json:"rounds"`
	Figures   []Figure  `json:"figures"`
}

// Figure is one measured figure.
type Figure struct {
	Name     string             `json:"name"`
	Value    float64            `json:"value"`
	Unit     string             `json:"unit"`
	Goal     string             `json:"goal,omitempty"`
	Met      *bool              `json:"met,omitempty"`
	Measured string             `json:"measured"`
	Detail   map[string]float64 `json:"detail,omitempty"`
}

func run(out string, n, rounds int, only string) error {
	res := Result{CPUs: runtime.NumCPU(), LoadStart: loadavg(), Started: time.Now().UTC(), Messages: n, Rounds: rounds}
	conn, err := amqp091.Dial(uri)
	if err != nil {
		return fmt.Errorf("connect: %w", errors.New("broker unreachable (AMQP1_URI)"))
	}
	res.RabbitMQ, _ = conn.Properties["version"].(string)
	_ = conn.Close()
	fmt.Fprintf(os.Stderr, "RabbitMQ %s, %d CPUs, load %s\n", res.RabbitMQ, res.CPUs, res.LoadStart)
	add := func(f Figure) {
		res.Figures = append(res.Figures, f)
		fmt.Fprintln(os.Stderr, line(f))
	}
	if strings.Contains(only, "lateness") {
		for _, credit := range []int{1, 50} {
			for _, v := range []string{"ours", "raw"} {
				var f Figure
				err := retried(func() (err error) { f, err = lateness(v, credit); return err })
				if err != nil {
					return err
				}
				add(f)
			}
		}
	}
	for _, sc := range []string{"retrypath", "storm"} {
		if !strings.Contains(only, sc) {
			continue
		}
		for _, credit := range creditList {
			rates, cpus := map[string][]float64{}, map[string][]float64{}
			for round := range rounds {
				order := []string{"ours", "raw", "copy"}
				if round%2 == 1 {
					order = []string{"copy", "raw", "ours"}
				}
				for _, v := range order {
					if !has(variantList, v) {
						continue
					}
					var rate float64
					err := retried(func() (err error) { rate, err = throughput(sc, v, credit, n); return err })
					if err != nil {
						return fmt.Errorf("%s %s credit %d: %w", sc, v, credit, err)
					}
					rates[v] = append(rates[v], rate)
					cpu := float64(cpuPerMsg.Load()) / 1000
					cpus[v] = append(cpus[v], cpu)
					fmt.Fprintf(os.Stderr, "  %s %s credit=%d round %d: %.0f/s, %.0f µs CPU/msg, load %s\n", sc, v, credit, round+1, rate, cpu, loadavg())
				}
			}
			ours, raw, cp := median(rates["ours"]), median(rates["raw"]), median(rates["copy"])
			name := map[string]string{"retrypath": "retry_path", "storm": "failure_storm"}[sc]
			unit := map[string]string{"retrypath": "msgs done/s", "storm": "failures settled/s"}[sc]
			oc, rc, cc := median(cpus["ours"]), median(cpus["raw"]), median(cpus["copy"])
			if ours == 0 || raw == 0 || cp == 0 {
				fmt.Fprintf(os.Stderr, "%s credit=%d: ours %.0f (%.0f µs CPU/msg), raw %.0f (%.0f µs), copy %.0f (%.0f µs) %s\n", name, credit, ours, oc, raw, rc, cp, cc, unit)
				continue
			}
			add(goalFigure(fmt.Sprintf("%s_vs_raw credit=%d", name, credit), ours/raw, "ratio", ">= 0.8", ours/raw >= 0.8,
				fmt.Sprintf("ours %.0f vs raw go-amqp %.0f %s (medians of %d rounds: ours %s, raw %s; %d msgs); client CPU per message: ours %.0f µs, raw %.0f µs",
					ours, raw, unit, rounds, join(rates["ours"]), join(rates["raw"]), n, oc, rc),
				map[string]float64{"ours": ours, "raw": raw, "ours_cpu_us_per_msg": oc, "raw_cpu_us_per_msg": rc}))
			add(Figure{Name: fmt.Sprintf("%s_vs_copy_ceiling credit=%d", name, credit), Value: ours / cp, Unit: "ratio",
				Measured: fmt.Sprintf("ours %.0f vs copy ceiling (amqp091-go, confirmed copy then ack) %.0f %s (medians: copy %s); client CPU per message: copy %.0f µs", ours, cp, unit, join(rates["copy"]), cc),
				Detail:   map[string]float64{"ours": ours, "copy": cp, "raw": raw, "copy_cpu_us_per_msg": cc}})
		}
	}
	if strings.Contains(only, "inprocess") {
		for _, credit := range []int{50, 1} {
			var ratios, oursR, inprocR, healthyR []float64
			for round := range rounds {
				order := []string{"ours", "inprocess", "healthy"}
				if round%2 == 1 {
					order = []string{"healthy", "inprocess", "ours"}
				}
				var o, ip float64
				for _, v := range order {
					msgs := 5000
					if v == "inprocess" {
						msgs = 500
					}
					var rate float64
					err := retried(func() (err error) { rate, err = steady(v, credit, msgs); return err })
					if err != nil {
						return fmt.Errorf("vs_inprocess_retry %s credit %d: %w", v, credit, err)
					}
					fmt.Fprintf(os.Stderr, "  vs_inprocess_retry %s credit=%d round %d: %.1f/s\n", v, credit, round+1, rate)
					switch v {
					case "ours":
						o = rate
					case "inprocess":
						ip = rate
					default:
						healthyR = append(healthyR, rate)
					}
				}
				oursR, inprocR, ratios = append(oursR, o), append(inprocR, ip), append(ratios, o/ip)
			}
			r := median(ratios)
			add(goalFigure(fmt.Sprintf("vs_inprocess_retry credit=%d", credit), r, "ratio", goalIf(credit == 50, ">= 100"), r >= 100,
				fmt.Sprintf("steady state (messages 10%%-90%% done), median of %d rounds %s: ours %s msg/s (5000 msgs) vs Watermill middleware.Retry %s msg/s (500 msgs), 10%% failing twice, delays 100ms, 200ms; the same router + Retry with no failure: %s msg/s (its bound: %.1f x in-process)",
					rounds, join(ratios), join(oursR), join(inprocR), join(healthyR), median(healthyR)/median(inprocR)),
				map[string]float64{"ours": median(oursR), "inprocess": median(inprocR), "healthy": median(healthyR)}))
		}
	}
	res.Seconds = time.Since(res.Started).Seconds()
	res.LoadEnd = loadavg()
	return write(out, res)
}

// retried runs one measurement, up to 3 more times if it failed: the broker is
// shared, and another user's broker-side connection close must not end the whole run.
func retried(run func() error) error {
	err := run()
	for try := 1; err != nil && try < 4; try++ {
		fmt.Fprintf(os.Stderr, "  run failed (%v), running it again in 5 s\n", err)
		time.Sleep(5 * time.Second)
		err = run()
	}
	return err
}

func goalIf(ok bool, goal string) string {
	if ok {
		return goal
	}
	return ""
}

func goalFigure(name string, v float64, unit, goal string, met bool, measured string, detail map[string]float64) Figure {
	f := Figure{Name: name, Value: v, Unit: unit, Goal: goal, Measured: measured, Detail: detail}
	if goal != "" {
		f.Met = &met
	}
	return f
}

func line(f Figure) string {
	met := "-"
	if f.Met != nil {
		met = map[bool]string{true: "yes", false: "NO"}[*f.Met]
	}
	return fmt.Sprintf("%-40s %10.3f  %-10s %-5s %s", f.Name, f.Value, f.Goal, met, f.Measured)
}

func write(out string, res Result) error {
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(out+".json", append(b, '\n'), 0o644); err != nil {
		return err
	}
	var txt strings.Builder
	fmt.Fprintf(&txt, "RabbitMQ %s, %d CPUs, load average %s at start, %s at end, %s, %.0f s\n", res.RabbitMQ, res.CPUs, res.LoadStart, res.LoadEnd, res.Started.Format(time.RFC3339), res.Seconds)
	fmt.Fprintf(&txt, "%-40s %10s  %-10s %-5s %s\n", "figure", "value", "goal", "met", "measured")
	for _, f := range res.Figures {
		txt.WriteString(line(f) + "\n")
	}
	return os.WriteFile(out+".txt", []byte(txt.String()), 0o644)
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func join(xs []float64) string {
	var parts []string
	for _, x := range xs {
		if x >= 100 {
			parts = append(parts, fmt.Sprintf("%.0f", x))
		} else {
			parts = append(parts, fmt.Sprintf("%.1f", x))
		}
	}
	return strings.Join(parts, "/")
}

// --- broker plumbing (AMQP 0-9-1 for declaring, deleting and prefilling) ---

var seq atomic.Int64

func queueName(what string) string {
	return fmt.Sprintf("amqp1-bench-%s-%s-%d", runID, what, seq.Add(1))
}

func declareQuorum(queues ...string) error {
	conn, err := amqp091.Dial(uri)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	for _, q := range queues {
		if _, err := ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"}); err != nil {
			return err
		}
	}
	return nil
}

func deleteQueues(queues ...string) {
	conn, err := amqp091.Dial(uri)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cleanup: cannot connect; left:", queues)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	for _, q := range queues {
		_, _ = ch.QueueDelete(q, false, false, false)
	}
}

// confirmChannel opens a connection to uri and a channel on it in confirm mode; closing
// the connection closes both.
func confirmChannel() (*amqp091.Connection, *amqp091.Channel, error) {
	conn, err := amqp091.Dial(uri)
	if err != nil {
		return nil, nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	return conn, ch, nil
}

// prefill publishes n messages to queue, confirmed; payload(i) is message i's body.
func prefill(queue string, n int, payload func(i int) []byte) error {
	conn, ch, err := confirmChannel()
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var pending []*amqp091.DeferredConfirmation
	for i := range n {
		id := watermill.NewUUID()
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, amqp091.Publishing{
			DeliveryMode: amqp091.Persistent, MessageId: id,
			Headers: amqp091.Table{"_watermill_message_uuid": id}, Body: payload(i),
		})
		if err != nil {
			return err
		}
		pending = append(pending, dc)
		if len(pending) == 500 || i == n-1 {
			for _, dc := range pending {
				if ok, err := dc.WaitContext(ctx); err != nil || !ok {
					return fmt.Errorf("prefill not confirmed: %v", err)
				}
			}
			pending = pending[:0]
		}
	}
	return nil
}

// --- ours: Subscriber + router + Retry ---

// oursRig runs a handler behind a router with amqp1.Retry on queue.
type oursRig struct {
	retry  *amqp1.Retry
	router *message.Router
	cancel context.CancelFunc
	done   chan struct{}
	poison string
}

func startOurs(queue string, credit int, policy amqpretry.Policy, handler message.NoPublishHandlerFunc) (*oursRig, error) {
	prefix := queue
	retry, err := amqp1.NewRetry(amqp1.SubscriberConfig{URI: uri, Credit: credit, ContainerID: "amqp1-bench-" + runID}, amqpretry.Config{Prefix: prefix, Policy: policy, Logger: logger})
	if err != nil {
		return nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		return nil, err
	}
	if _, err := retry.AddHandler(router, "bench", queue, handler); err != nil {
		return nil, err
	}
	return runRouter(router, retry, prefix+".poison")
}

func runRouter(router *message.Router, retry *amqp1.Retry, poison string) (*oursRig, error) {
	ctx, cancel := context.WithCancel(context.Background())
	r := &oursRig{retry: retry, router: router, cancel: cancel, done: make(chan struct{}), poison: poison}
	go func() {
		defer close(r.done)
		_ = router.Run(ctx)
	}()
	select {
	case <-router.Running():
	case <-time.After(time.Minute):
		return nil, errors.New("router not running within a minute")
	}
	return r, nil
}

func (r *oursRig) stop() {
	r.cancel()
	_ = r.router.Close()
	<-r.done
	if r.retry != nil {
		_ = r.retry.Close()
	}
	if r.poison != "" {
		deleteQueues(r.poison)
	}
}

// --- raw go-amqp receiver ---

type rawLink struct {
	conn *amqp.Conn
	rcv  *amqp.Receiver
}

func rawAttach(ctx context.Context, queue string, credit int) (*rawLink, error) {
	u, err := url.Parse(uri)
	if err != nil {
		return nil, errors.New("AMQP1_URI: not a URI")
	}
	pass, _ := u.User.Password()
	vhost := strings.TrimPrefix(u.Path, "/")
	if vhost == "" {
		vhost = "/"
	}
	conn, err := amqp.Dial(ctx, "amqp://"+u.Host, &amqp.ConnOptions{SASLType: amqp.SASLTypePlain(u.User.Username(), pass), HostName: "vhost:" + vhost, ContainerID: "amqp1-bench-" + runID + "-raw"})
	if err != nil {
		return nil, err
	}
	session, err := conn.NewSession(ctx, nil)
	if err != nil {
		return nil, err
	}
	rcv, err := session.NewReceiver(ctx, amqp1.QueueAddress(queue), &amqp.ReceiverOptions{
		Credit:                    int32(credit),
		RequestedSenderSettleMode: amqp.SenderSettleModeUnsettled.Ptr(),
		SettlementMode:            amqp.ReceiverSettleModeFirst.Ptr(),
	})
	if err != nil {
		return nil, err
	}
	return &rawLink{conn: conn, rcv: rcv}, nil
}

func modifyAt(ctx context.Context, l *rawLink, m *amqp.Message, at time.Time) error {
	return l.rcv.ModifyMessage(ctx, m, &amqp.ModifyMessageOptions{DeliveryFailed: true, Annotations: amqp.Annotations{"x-opt-delivery-time": at.UnixMilli()}})
}

// --- lateness ---

// lateDelay is message i's delay: 200 ms to 1 s, spread.
func lateDelay(i int) time.Duration {
	return 200*time.Millisecond + time.Duration((i*7919)%800)*time.Millisecond
}

const lateMessages = 300

// lateness publishes lateMessages at 10/s while the consumer runs; each fails once
// with its own delay and comes back once.
func lateness(variant string, credit int) (Figure, error) {
	queue := queueName("late")
	if err := declareQuorum(queue); err != nil {
		return Figure{}, err
	}
	defer deleteQueues(queue)
	var mu sync.Mutex
	var lates []time.Duration
	done := make(chan struct{})
	record := func(d time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		lates = append(lates, d)
		if len(lates) == lateMessages {
			close(done)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	index := func(payload []byte) int {
		var i int
		_, _ = fmt.Sscan(string(payload), &i)
		return i
	}
	// The baseline: how long a first delivery takes from its publish to the handler,
	// on the same queue at the same time (what any delivery costs on this broker now).
	var firsts []time.Duration
	first := func(payload []byte) {
		var i int
		var ns int64
		_, _ = fmt.Sscan(string(payload), &i, &ns)
		mu.Lock()
		firsts = append(firsts, time.Since(time.Unix(0, ns)))
		mu.Unlock()
	}
	switch variant {
	case "ours":
		rig, err := startOurs(queue, credit, amqpretry.Policy{MaxAttempts: 3}, func(msg *message.Message) error {
			if amqpretry.Attempt(msg) == 1 {
				first(msg.Payload)
				return amqpretry.RetryAfter(errors.New("fails once"), lateDelay(index(msg.Payload)))
			}
			record(time.Since(middleware.ReadEnvelope(msg.Metadata).Due))
			return nil
		})
		if err != nil {
			return Figure{}, err
		}
		defer rig.stop()
	case "raw":
		l, err := rawAttach(ctx, queue, credit)
		if err != nil {
			return Figure{}, err
		}
		defer l.conn.Close()
		go func() {
			due := map[string]time.Time{}
			for {
				m, err := l.rcv.Receive(ctx, nil)
				if err != nil {
					return
				}
				id := fmt.Sprint(m.Properties.MessageID)
				if m.Header == nil || m.Header.DeliveryCount == 0 {
					first(m.GetData())
					at := time.Now().Add(lateDelay(index(m.GetData())))
					due[id] = at
					err = modifyAt(ctx, l, m, at)
				} else {
					record(time.Since(due[id]))
					err = l.rcv.AcceptMessage(ctx, m)
				}
				if err != nil {
					return
				}
			}
		}()
	}
	// Trickle: 1 message every 100 ms, on one confirm channel: with its retry, 20
	// deliveries a second, well below what one consumer takes even at credit 1.
	if err := trickle(ctx, queue, lateMessages, 1, 100*time.Millisecond); err != nil {
		return Figure{}, err
	}
	select {
	case <-done:
	case <-ctx.Done():
		return Figure{}, fmt.Errorf("lateness %s: %d of %d retries back", variant, len(lates), lateMessages)
	}
	mu.Lock()
	defer mu.Unlock()
	p, b := percentiles(lates), percentiles(firsts)
	name := fmt.Sprintf("lateness_ms %s credit=%d", variant, credit)
	measured := fmt.Sprintf("p50 %.1f, p90 %.1f, p99 %.1f, min %.1f, max %.1f ms over %d retries of 200 ms-1 s (1 msg every 100 ms), arrival in the handler - due time; first deliveries at the same time, publish to handler: p50 %.1f, p99 %.1f ms",
		p(50), p(90), p(99), p(0), p(100), len(lates), b(50), b(99))
	detail := map[string]float64{"p50": p(50), "p90": p(90), "p99": p(99), "max": p(100), "first_delivery_p50": b(50), "first_delivery_p99": b(99)}
	if variant == "raw" {
		return Figure{Name: name, Value: p(99), Unit: "ms p99", Measured: measured + " (raw go-amqp loop: the broker alone)", Detail: detail}, nil
	}
	return goalFigure(name, p(99), "ms p99", "<= 20", p(99) <= 20, measured, detail), nil
}

// percentiles sorts ds and returns its percentile function, in milliseconds.
func percentiles(ds []time.Duration) func(q int) float64 {
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	return func(q int) float64 {
		if len(ds) == 0 {
			return 0
		}
		i := min((len(ds)*q+99)/100, len(ds)) - 1
		return float64(ds[max(i, 0)].Microseconds()) / 1000
	}
}

// trickle publishes n messages to queue, per at a time every pause, each confirmed;
// message i's body is its index.
func trickle(ctx context.Context, queue string, n, per int, pause time.Duration) error {
	conn, ch, err := confirmChannel()
	if err != nil {
		return err
	}
	defer conn.Close()
	next := time.Now()
	for i := 0; i < n; {
		for j := 0; j < per && i < n; j, i = j+1, i+1 {
			id := watermill.NewUUID()
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, amqp091.Publishing{
				DeliveryMode: amqp091.Persistent, MessageId: id,
				Headers: amqp091.Table{"_watermill_message_uuid": id}, Body: []byte(fmt.Sprint(i, " ", time.Now().UnixNano())),
			})
			if err != nil {
				return err
			}
			if ok, err := dc.WaitContext(ctx); err != nil || !ok {
				return fmt.Errorf("trickle not confirmed: %v", err)
			}
		}
		next = next.Add(pause)
		time.Sleep(time.Until(next))
	}
	return nil
}

// --- retry path and failure storm ---

// throughput runs scenario sc ("retrypath" or "storm") for variant ("ours", "raw",
// "copy") at credit on n prefilled messages, and returns the rate: messages done per
// second (retrypath) or failures settled per second (storm), from the first delivery to
// the n-th completion.
func throughput(sc, variant string, credit, n int) (float64, error) {
	queue := queueName(sc + "-" + variant)
	copies := queue + ".copies"
	if err := declareQuorum(queue, copies); err != nil {
		return 0, err
	}
	defer deleteQueues(queue, copies)
	if err := prefill(queue, n, func(int) []byte { return []byte("x") }); err != nil {
		return 0, err
	}
	cpu0 := cpuTime()
	storm := sc == "storm"
	delay := time.Millisecond
	if storm {
		delay = 10 * time.Minute
	}
	var count atomic.Int64
	var first atomic.Int64
	finished := make(chan time.Time, 1)
	tick := func() {
		first.CompareAndSwap(0, time.Now().UnixNano())
	}
	complete := func() {
		if count.Add(1) == int64(n) {
			finished <- time.Now()
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	failed := make(chan error, 1)
	fail := func(err error) {
		select {
		case failed <- err:
		default:
		}
	}
	errFail := errors.New("fails")
	switch variant {
	case "ours":
		policy := amqpretry.Policy{MaxAttempts: 20, Delays: []time.Duration{delay}, Jitter: -1}
		rig, err := startOurs(queue, credit, policy, func(msg *message.Message) error {
			tick()
			if storm {
				complete() // this failure is settled right after
				return errFail
			}
			if amqpretry.Attempt(msg) == 1 {
				return errFail
			}
			complete()
			return nil
		})
		if err != nil {
			return 0, err
		}
		defer rig.stop()
	case "raw":
		l, err := rawAttach(ctx, queue, credit)
		if err != nil {
			return 0, err
		}
		defer l.conn.Close()
		go func() {
			for {
				m, err := l.rcv.Receive(ctx, nil)
				if err != nil {
					return
				}
				tick()
				if storm || m.Header == nil || m.Header.DeliveryCount == 0 {
					err = modifyAt(ctx, l, m, time.Now().Add(delay))
					if storm {
						complete()
					}
				} else {
					err = l.rcv.AcceptMessage(ctx, m)
					complete()
				}
				if err != nil {
					fail(err)
					return
				}
			}
		}()
	case "copy":
		conn, err := amqp091.Dial(uri)
		if err != nil {
			return 0, err
		}
		defer conn.Close()
		cons, err := conn.Channel()
		if err != nil {
			return 0, err
		}
		if err := cons.Qos(credit, 0, false); err != nil {
			return 0, err
		}
		pubConn, pub, err := confirmChannel()
		if err != nil {
			return 0, err
		}
		defer pubConn.Close()
		deliveries, err := cons.Consume(queue, "", false, false, false, false, nil)
		if err != nil {
			return 0, err
		}
		go func() {
			for d := range deliveries {
				tick()
				if storm || d.Headers["x-copy"] == nil {
					target := queue
					if storm {
						target = copies
					}
					headers := amqp091.Table{"x-copy": int32(1)}
					for k, v := range d.Headers {
						headers[k] = v
					}
					dc, err := pub.PublishWithDeferredConfirmWithContext(ctx, "", target, true, false, amqp091.Publishing{
						DeliveryMode: amqp091.Persistent, MessageId: d.MessageId, Headers: headers, Body: d.Body,
					})
					if err != nil {
						fail(fmt.Errorf("publish copy: %w", err))
						return
					}
					if ok, err := dc.WaitContext(ctx); err != nil || !ok {
						fail(fmt.Errorf("copy not confirmed: %v", err))
						return
					}
					if storm {
						complete()
					}
				} else {
					complete()
				}
				if err := d.Ack(false); err != nil {
					fail(err)
					return
				}
			}
		}()
	}
	select {
	case end := <-finished:
		cpuPerMsg.Store(int64((cpuTime() - cpu0) / time.Duration(n)))
		return float64(n) / end.Sub(time.Unix(0, first.Load())).Seconds(), nil
	case err := <-failed:
		return 0, err
	case <-ctx.Done():
		return 0, fmt.Errorf("%d of %d within 5 minutes", count.Load(), n)
	}
}

// cpuPerMsg is the process's CPU time (user + system) per message of the last
// throughput run, in nanoseconds: what the client code costs, whatever the load.
var cpuPerMsg atomic.Int64

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// --- vs in-process retry ---

// steady runs msgs prefilled messages, 10% failing on attempts 1 and 2, through the
// router with ours or Watermill's middleware.Retry (delays 100 ms, 200 ms), and
// returns the steady-state handled msg/s: messages completed between the 10% and 90%
// completions over the time between them.
func steady(variant string, credit, msgs int) (float64, error) {
	queue := queueName("steady-" + variant)
	if err := declareQuorum(queue); err != nil {
		return 0, err
	}
	defer deleteQueues(queue)
	if err := prefill(queue, msgs, func(i int) []byte { return []byte(map[bool]string{true: "fail", false: "ok"}[i%10 == 0]) }); err != nil {
		return 0, err
	}
	var mu sync.Mutex
	var times []time.Time
	finished := make(chan struct{})
	done := func() {
		mu.Lock()
		defer mu.Unlock()
		times = append(times, time.Now())
		if len(times) == msgs {
			close(finished)
		}
	}
	errFail := errors.New("fails twice")
	var rig *oursRig
	var err error
	switch variant {
	case "ours", "healthy":
		rig, err = startOurs(queue, credit, amqpretry.Policy{MaxAttempts: 3, Delays: []time.Duration{100 * time.Millisecond, 200 * time.Millisecond}, Jitter: -1},
			func(msg *message.Message) error {
				if variant == "ours" && string(msg.Payload) == "fail" && amqpretry.Attempt(msg) <= 2 {
					return errFail
				}
				done()
				return nil
			})
	case "inprocess":
		var sub *amqp1.Subscriber
		sub, err = amqp1.NewSubscriber(amqp1.SubscriberConfig{URI: uri, Credit: credit, ContainerID: "amqp1-bench-" + runID + "-inproc"}, logger)
		if err != nil {
			return 0, err
		}
		var router *message.Router
		router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
		if err != nil {
			return 0, err
		}
		attempts := map[string]int{}
		var amu sync.Mutex
		h := router.AddConsumerHandler("bench", queue, sub, func(msg *message.Message) error {
			if string(msg.Payload) == "fail" {
				amu.Lock()
				attempts[msg.UUID]++
				n := attempts[msg.UUID]
				amu.Unlock()
				if n <= 2 {
					return errFail
				}
			}
			done()
			return nil
		})
		h.AddMiddleware(wmiddleware.Retry{MaxRetries: 2, InitialInterval: 100 * time.Millisecond, Multiplier: 2, MaxInterval: time.Second}.Middleware)
		rig, err = runRouter(router, nil, "")
	}
	if err != nil {
		return 0, err
	}
	defer rig.stop()
	select {
	case <-finished:
	case <-time.After(5 * time.Minute):
		return 0, fmt.Errorf("%d of %d done within 5 minutes", len(times), msgs)
	}
	mu.Lock()
	defer mu.Unlock()
	lo, hi := msgs/10, msgs*9/10
	return float64(hi-lo) / times[hi-1].Sub(times[lo-1]).Seconds(), nil
}
