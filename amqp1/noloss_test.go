package amqp1

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/amqp1/internal/noloss1"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss/fates"
)

// TestNoLoss is the no-loss test of the delivery-time backend (issue 21): N messages
// (AMQPRETRY_NOLOSS_N, default 2000) with unique UUIDs go through the consumer program
// ./internal/nolosscons (amqp1.NewRetry + AddHandler; 20% fail twice then succeed, 1%
// Permanent, the rest succeed; every success recorded in a results queue before the
// handler returns) while faults are injected, each while retries wait in the work
// queue and while the next batch is being handled: the consumer's connections closed
// from the broker's side (twice, by their container id), the consumer killed with
// SIGKILL and restarted (once), and, with
// AMQPRETRY_BROKER_RESTART=1 and AMQPRETRY_RABBITMQCTL, the broker's application stopped
// and started (once). Then every UUID is accounted for (handled, or poisoned with reason
// permanent), lost must be 0, and every duplicate must be explained: a delivery whose
// settlement was lost, handled before a fault and handled again after it. It prints
// one NOLOSS line. Opt-in, as it disturbs the broker:
//
//	AMQPRETRY_NOLOSS=1 AMQPRETRY_BROKER_RESTART=1 AMQPRETRY_RABBITMQCTL="$PWD/../scripts/rabbitmq4.sh 4.3 ctl" \
//	  go test -count=1 -timeout 30m -run '^TestNoLoss$' -v .
//
// AMQPRETRY_NOLOSS_SABOTAGE=K makes the consumer ack K transient messages on their
// first attempt without recording them: the test must then fail with lost=K.
func TestNoLoss(t *testing.T) {
	if os.Getenv("AMQPRETRY_NOLOSS") != "1" {
		t.Skip("the no-loss test disturbs the broker: set AMQPRETRY_NOLOSS=1 to run it")
	}
	uri := requireBroker43(t)
	ctl := findRabbitmqctl()
	if c := os.Getenv("AMQPRETRY_RABBITMQCTL"); c != "" {
		ctl = strings.Fields(c)
	}
	if ctl == nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("no rabbitmqctl for the test broker: set AMQPRETRY_RABBITMQCTL")
		}
		t.Skip("no rabbitmqctl for the test broker: set AMQPRETRY_RABBITMQCTL (for example \"$PWD/../scripts/rabbitmq4.sh 4.3 ctl\")")
	}
	r := &nolossRun{t: t, uri: uri, ctl: ctl, n: 2000, prefix: "amqp1-noloss-" + runID, version: brokerVersion,
		records: map[string][]nolossRecord{}, poisoned: map[string][]string{}}
	if n := getenvInt("AMQPRETRY_NOLOSS_N"); n > 0 {
		r.n = n
	}
	r.sabotage = getenvInt("AMQPRETRY_NOLOSS_SABOTAGE")
	plan := []nolossFault{{"close_consumer_connections", (*nolossRun).closeConsumerConnections}, {"consumer_sigkill_restart", (*nolossRun).killConsumer},
		{"close_consumer_connections", (*nolossRun).closeConsumerConnections}}
	if os.Getenv("AMQPRETRY_BROKER_RESTART") == "1" {
		if os.Getenv("AMQPRETRY_RABBITMQCTL") == "" {
			t.Fatal("AMQPRETRY_BROKER_RESTART=1 needs AMQPRETRY_RABBITMQCTL, the rabbitmqctl of the broker it may stop")
		}
		plan = append(plan, nolossFault{"stop_app_start_app", (*nolossRun).stopApp})
	} else {
		t.Log("no broker restart (set AMQPRETRY_BROKER_RESTART=1 and AMQPRETRY_RABBITMQCTL for it)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	r.ctx = ctx

	r.work, r.results, r.poison = noloss1.WorkQueue(r.prefix), noloss1.ResultsQueue(r.prefix), noloss1.PoisonQueue(r.prefix)
	t.Cleanup(func() { deleteQueues(t, r.work, r.results, r.poison) })
	declareQueue(t, r.work, "quorum", nil) // as the consumer's Subscribers declare it
	declareQueue(t, r.results, "quorum", nil)
	r.uuids = make([]string, r.n)
	r.fates = make(map[string]fates.Fate, r.n)
	for i := range r.uuids {
		r.uuids[i] = watermill.NewUUID()
		r.fates[r.uuids[i]] = fates.For(i)
	}
	r.bin = buildNolossConsumer(t)
	r.logPath = filepath.Join(t.TempDir(), "consumer.log")
	pub, err := NewPublisher(PublisherConfig{URI: uri, ContainerID: r.prefix + "-test-publisher"}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	r.pub = pub
	defer r.closeConn()

	r.start = time.Now()
	r.consumer = r.startConsumer()
	defer func() { r.consumer.kill() }()
	// Batch b+1 is published once retries of batch b are held, just before fault b:
	// the fault finds retries waiting in the work queue and deliveries in flight
	// (handled, recorded, not yet settled) alike.
	batches := len(plan) + 1
	bounds := func(b int) (int, int) { return b * r.n / batches, (b + 1) * r.n / batches }
	r.publish(bounds(0))
	for b, f := range plan {
		waiting := r.awaitWaitingRetries(bounds(b))
		r.publish(bounds(b + 1))
		r.inject(f, waiting)
	}
	r.finish()
}

// nolossRun is one run of TestNoLoss.
type nolossRun struct {
	t        *testing.T
	ctx      context.Context
	uri      string
	ctl      []string
	n        int
	sabotage int
	prefix   string
	version  string
	bin      string
	logPath  string
	start    time.Time

	work, results, poison string
	uuids                 []string
	fates                 map[string]fates.Fate
	pub                   *Publisher
	consumer              *nolossConsumer
	faults                []nolossFaultRecord
	resultsAtFault        int

	conn *amqp091.Connection // the test's own, for counting and reading
	ch   *amqp091.Channel

	records  map[string][]nolossRecord // by UUID
	poisoned map[string][]string       // UUID → poison reasons
}

type nolossFault struct {
	name   string
	inject func(r *nolossRun) string
}

type nolossFaultRecord struct {
	name       string
	start, end time.Time
	waiting    int
	note       string
}

// nolossRecord is one record the consumer wrote: one successful handling.
type nolossRecord struct {
	attempt  int
	arrived  time.Time
	late     time.Duration
	timed    bool // late is known (a retry)
	consumer string
}

func buildNolossConsumer(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "nolosscons")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "./internal/nolosscons").CombinedOutput()
	if err != nil {
		t.Fatalf("build the consumer: %v\n%s", err, out)
	}
	return bin
}

// nolossConsumer is one consumer process.
type nolossConsumer struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

func (r *nolossRun) startConsumer() *nolossConsumer {
	r.t.Helper()
	logFile, err := os.OpenFile(r.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		r.t.Fatal(err)
	}
	args := []string{"-prefix", r.prefix}
	if r.sabotage > 0 && len(r.faults) == 0 {
		args = append(args, "-sabotage", strconv.Itoa(r.sabotage))
	}
	cmd := exec.Command(r.bin, args...)
	cmd.Env = append(os.Environ(), "AMQP_URI="+r.uri)
	cmd.Stderr = logFile
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		r.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	c := &nolossConsumer{cmd: cmd, done: make(chan struct{})}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if sc.Text() == noloss1.Ready {
				close(ready)
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
		c.err = cmd.Wait()
		_ = logFile.Close()
		close(c.done)
	}()
	select {
	case <-ready:
	case <-c.done:
		r.fatal("the consumer exited before it was ready: %v", c.err)
	case <-time.After(90 * time.Second):
		c.kill()
		r.fatal("the consumer was not ready within 90 s")
	}
	return c
}

func (c *nolossConsumer) kill() {
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.done
}

// stop asks the consumer to stop (SIGTERM) and waits up to a minute.
func (c *nolossConsumer) stop() error {
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
		return c.err
	case <-time.After(time.Minute):
		c.kill()
		return fmt.Errorf("did not stop within a minute of SIGTERM")
	}
}

func (r *nolossRun) checkAlive() {
	select {
	case <-r.consumer.done:
		r.fatal("the consumer exited: %v", r.consumer.err)
	default:
	}
}

func (r *nolossRun) fatal(format string, args ...any) {
	r.t.Helper()
	r.t.Logf("consumer log (last 16 KiB): %s", tail(r.logPath, 16<<10))
	r.dumpConsumer()
	r.t.Fatalf(format, args...)
}

// dumpConsumer makes a consumer that still runs print its goroutines (SIGQUIT) and
// logs those that run the library's code or wait in a client library: where a stuck
// consumer is stuck.
func (r *nolossRun) dumpConsumer() {
	if r.consumer == nil {
		return
	}
	select {
	case <-r.consumer.done:
		return
	default:
	}
	before, _ := os.ReadFile(r.logPath)
	_ = r.consumer.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-r.consumer.done:
	case <-time.After(10 * time.Second):
		r.consumer.kill()
	}
	after, _ := os.ReadFile(r.logPath)
	if len(after) < len(before) {
		return
	}
	var b strings.Builder
	for _, g := range strings.Split(string(after[len(before):]), "\n\n") {
		if strings.Contains(g, "amqpretry/") || strings.Contains(g, "go-amqp") || strings.Contains(g, "amqp091-go") {
			b.WriteString(g + "\n\n")
		}
	}
	r.t.Logf("the consumer's goroutines in the library or a client library (SIGQUIT):\n%s", b.String())
}

// consumersOf keeps the lines of rabbitmqctl list_consumers that are queue's.
func consumersOf(out []byte, queue string) string {
	var b strings.Builder
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) > 0 && f[0] == queue {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

func tail(path string, n int64) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if int64(len(b)) > n {
		b = b[int64(len(b))-n:]
	}
	return "\n" + string(b)
}

func (r *nolossRun) elapsed() float64 { return time.Since(r.start).Seconds() }

// publish sends messages lo..hi-1 to the work queue over AMQP 1.0, each accepted by the
// broker, 100 to a Publish call. No fault is injected while it runs.
func (r *nolossRun) publish(lo, hi int) {
	r.t.Helper()
	for i := lo; i < hi; i += 100 {
		var msgs []*message.Message
		for j := i; j < min(i+100, hi); j++ {
			msgs = append(msgs, message.NewMessage(r.uuids[j], fates.Payload(j)))
		}
		if err := r.pub.Publish(r.work, msgs...); err != nil {
			r.fatal("publish messages %d..%d: %v", i, min(i+100, hi)-1, err)
		}
	}
}

// channel returns the test's channel, reconnecting when needed (after a broker stop).
func (r *nolossRun) channel() *amqp091.Channel {
	r.t.Helper()
	if r.ch != nil && !r.ch.IsClosed() {
		return r.ch
	}
	r.closeConn()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		conn, err := amqp091.DialConfig(r.uri, amqp091.Config{Dial: amqp091.DefaultDial(10 * time.Second),
			Properties: amqp091.Table{"connection_name": r.prefix + "-test"}})
		if err == nil {
			ch, cerr := conn.Channel()
			if cerr == nil {
				r.conn, r.ch = conn, ch
				return ch
			}
			_ = conn.Close()
			err = cerr
		}
		if time.Now().After(deadline) || r.ctx.Err() != nil {
			r.fatal("connect to the broker: %v", err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func (r *nolossRun) closeConn() {
	if r.conn != nil {
		_ = r.conn.Close()
	}
	r.conn, r.ch = nil, nil
}

// count is the number of ready messages of queue (a passive declare).
func (r *nolossRun) count(queue string) int {
	r.t.Helper()
	for try := 0; ; try++ {
		q, err := r.channel().QueueDeclarePassive(queue, true, false, false, false, nil)
		if err == nil {
			return q.Messages
		}
		if try == 5 {
			r.fatal("count %s: %v", queue, err)
		}
		time.Sleep(time.Second)
	}
}

// ctlRun runs rabbitmqctl with args.
func (r *nolossRun) ctlRun(args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(r.ctx, 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, r.ctl[0], append(r.ctl[1:], args...)...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return out.Bytes(), fmt.Errorf("rabbitmqctl %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return out.Bytes(), nil
}

// workQueueStats returns the work queue's messages, ready and unacknowledged counts
// (rabbitmqctl: a passive declare does not count the messages held for later).
func (r *nolossRun) workQueueStats() (messages, ready, unacked int) {
	r.t.Helper()
	out, err := r.ctlRun("list_queues", "-q", "--no-table-headers", "name", "messages", "messages_ready", "messages_unacknowledged")
	if err != nil {
		r.fatal("%v", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 4 && f[0] == r.work {
			messages, _ = strconv.Atoi(f[1])
			ready, _ = strconv.Atoi(f[2])
			unacked, _ = strconv.Atoi(f[3])
			return
		}
	}
	r.fatal("rabbitmqctl list_queues does not list %s", r.work)
	return
}

// awaitWaitingRetries waits until the consumer has recorded messages since the last
// fault (it recovered and works) and retries of this batch are held in the work queue
// (at least 20, or every transient message of the batch if fewer), and returns how
// many are held. The two need not be seen at once: the first records after a fault may
// be the batch's last retries, due together. A batch that was handled to its end while
// the fault lasted (a fault slower than its retries: rabbitmqctl on a loaded machine)
// leaves nothing to hold: once every message published so far is recorded or poisoned
// and the work queue is empty, it returns 0, and the next fault finds no retry held
// (its record says held=0).
func (r *nolossRun) awaitWaitingRetries(lo, hi int) int {
	r.t.Helper()
	want := 0
	for i := lo; i < hi; i++ {
		if r.fates[r.uuids[i]] == fates.Transient {
			want++
		}
	}
	want = min(want, 20)
	if len(r.faults) == 0 {
		want -= r.sabotage // the sabotaged ones are never retried
	}
	want = max(want, 1)
	permanent := 0
	for _, id := range r.uuids[:hi] {
		if r.fates[id] == fates.Permanent {
			permanent++
		}
	}
	deadline := time.Now().Add(2 * time.Minute)
	recovered := false
	for {
		m, ready, unacked := r.workQueueStats()
		held := max(m-ready-unacked, 0) // neither ready nor delivered: held for their delivery time
		records := r.count(r.results)
		recovered = recovered || records > r.resultsAtFault
		if recovered && held >= want {
			return held
		}
		// rabbitmqctl's counts lag (they read 0 just after a publish): an empty queue
		// counts only once what was published is accounted for as well.
		if m == 0 && records >= hi-permanent-r.sabotage && r.count(r.poison) >= permanent {
			r.t.Logf("messages %d..%d were handled to their end during the last fault: no retry left to hold for the next", lo, hi-1)
			return 0
		}
		if time.Now().After(deadline) || r.ctx.Err() != nil {
			consumers, _ := r.ctlRun("list_consumers", "-q", "--no-table-headers", "queue_name", "channel_pid", "consumer_tag", "ack_required", "prefetch_count", "active")
			r.fatal("two minutes after publishing messages %d..%d: %d records (%d at the last fault), %d retries held (want %d); the work queue has %d messages, %d ready, %d unacknowledged; its consumers:\n%s",
				lo, hi-1, records, r.resultsAtFault, held, want, m, ready, unacked, consumersOf(consumers, r.work))
		}
		r.checkAlive()
		time.Sleep(100 * time.Millisecond)
	}
}

func (r *nolossRun) inject(f nolossFault, waiting int) {
	r.t.Helper()
	rec := nolossFaultRecord{name: f.name, start: time.Now(), waiting: waiting}
	r.t.Logf("fault %d %s at %.1f s with %d retries held in the work queue", len(r.faults)+1, f.name, r.elapsed(), waiting)
	rec.note = f.inject(r)
	rec.end = time.Now()
	r.faults = append(r.faults, rec)
	r.resultsAtFault = r.count(r.results)
	r.t.Logf("fault %d %s done after %.1f s %s", len(r.faults), f.name, rec.end.Sub(rec.start).Seconds(), rec.note)
}

// closeConsumerConnections closes, from the broker's side, every connection of the
// consumer: its Subscribers' and its recorder's (by container id) and its poison
// hand-off's (by connection_name); no other connection of the broker.
func (r *nolossRun) closeConsumerConnections() string {
	mark := noloss1.ContainerID(r.prefix)
	out, err := r.ctlRun("list_connections", "-q", "--no-table-headers", "pid", "container_id", "client_properties")
	if err != nil {
		r.fatal("%v", err)
	}
	// Closed all at once: one rabbitmqctl after another takes seconds each on a loaded
	// machine, and a fault that outlasts the retries' delay finds none held.
	var pids []string
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && strings.Contains(line, mark) {
			pids = append(pids, f[0])
		}
	}
	if len(pids) == 0 {
		r.fatal("no connection of the consumer (%s) to close", mark)
	}
	errs := make([]error, len(pids))
	var wg sync.WaitGroup
	for i, pid := range pids {
		wg.Go(func() {
			_, errs[i] = r.ctlRun("close_connection", pid, "amqp1 no-loss test: fault")
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		r.fatal("%v", err)
	}
	return fmt.Sprintf("(%d connections closed)", len(pids))
}

func (r *nolossRun) killConsumer() string {
	r.consumer.kill()
	r.consumer = r.startConsumer()
	return ""
}

func (r *nolossRun) stopApp() string {
	for _, step := range []string{"stop_app", "start_app", "await_startup"} {
		if out, err := r.ctlRun(step); err != nil {
			r.fatal("%v\n%s", err, out)
		}
	}
	r.closeConn()
	r.channel() // waits for the broker
	return ""
}

// drain reads every record and poisoned message there is now (acking them).
func (r *nolossRun) drain() {
	r.t.Helper()
	for _, q := range []string{r.results, r.poison} {
		for {
			d, ok, err := r.channel().Get(q, true)
			if err != nil {
				r.closeConn()
				if r.ctx.Err() != nil {
					r.fatal("read %s: %v", q, err)
				}
				time.Sleep(time.Second)
				continue
			}
			if !ok {
				break
			}
			id, _ := d.Headers[uuidKey].(string)
			if id == "" {
				id = d.MessageId
			}
			if q == r.poison {
				reason, _ := d.Headers["amqpretry-poison-reason"].(string)
				r.poisoned[id] = append(r.poisoned[id], reason)
				continue
			}
			rec := nolossRecord{consumer: header(d, noloss1.ConsumerKey)}
			rec.attempt, _ = strconv.Atoi(header(d, noloss1.AttemptKey))
			ms, _ := strconv.ParseInt(header(d, noloss1.ArrivedKey), 10, 64)
			rec.arrived = time.UnixMilli(ms)
			if s := header(d, noloss1.LateKey); s != "" {
				us, _ := strconv.ParseInt(s, 10, 64)
				rec.late, rec.timed = time.Duration(us)*time.Microsecond, true
			}
			r.records[id] = append(r.records[id], rec)
		}
	}
}

func header(d amqp091.Delivery, key string) string {
	s, _ := d.Headers[key].(string)
	return s
}

// missing lists the UUIDs neither handled nor poisoned.
func (r *nolossRun) missing() []string {
	var out []string
	for _, id := range r.uuids {
		if len(r.records[id]) == 0 && len(r.poisoned[id]) == 0 {
			out = append(out, id)
		}
	}
	return out
}

// finish accounts for every message, prints the NOLOSS lines, and fails the test on a
// loss, a wrong outcome or an unexplained duplicate.
func (r *nolossRun) finish() {
	t := r.t
	// Every message accounted for, or the time every retry needs is well over.
	// Stop early only when nothing can come any more: the work queue empty twice in a
	// row with no message accounted for in between.
	deadline := time.Now().Add(3*time.Minute + noloss1.MaxAttempts*noloss1.RetryDelay)
	lastMissing, quietChecks := -1, 0
	for next := time.Now(); ; {
		r.drain()
		missing := len(r.missing())
		if missing == 0 || time.Now().After(deadline) {
			break
		}
		if time.Now().After(next) {
			next = time.Now().Add(10 * time.Second)
			if r.quiet() && missing == lastMissing {
				if quietChecks++; quietChecks == 2 {
					break
				}
			} else {
				quietChecks = 0
			}
			lastMissing = missing
		}
		r.checkAlive()
		time.Sleep(time.Second)
	}
	// Let duplicates in flight finish: the work queue empty (nothing ready, delivered
	// or held), then stop the consumer cleanly and read what it wrote last.
	for quietBy := time.Now().Add(2 * time.Minute); !r.quiet() && time.Now().Before(quietBy); {
		time.Sleep(2 * time.Second)
	}
	if err := r.consumer.stop(); err != nil {
		t.Errorf("consumer stop: %v", err)
	}
	r.drain()
	seconds := r.elapsed()
	missing := r.missing()

	dups, extra := 0, 0
	var explained, unexplained []string
	for _, id := range r.uuids {
		n := len(r.records[id]) + len(r.poisoned[id])
		if n <= 1 {
			continue
		}
		dups++
		extra += n - 1
		why, ok := r.explain(id)
		if ok {
			explained = append(explained, why)
		} else {
			unexplained = append(unexplained, why)
		}
	}
	var fl []string
	for _, f := range r.faults {
		fl = append(fl, fmt.Sprintf("%s@%.1fs(%.1fs,held=%d)%s", f.name, f.start.Sub(r.start).Seconds(), f.end.Sub(f.start).Seconds(), f.waiting, f.note))
	}
	var late []time.Duration
	handled, poisoned := 0, 0
	for _, id := range r.uuids {
		if len(r.records[id]) > 0 {
			handled++
		}
		if len(r.poisoned[id]) > 0 {
			poisoned++
		}
		for _, rec := range r.records[id] {
			if rec.timed {
				late = append(late, rec.late)
			}
		}
	}
	sort.Slice(late, func(i, j int) bool { return late[i] < late[j] })
	fmt.Printf("NOLOSS backend=delivery-time rabbitmq=%s n=%d faults=%d lost=%d duplicates=%d seconds=%.1f\n",
		r.version, r.n, len(r.faults), len(missing), dups, seconds)
	fmt.Printf("NOLOSS-DETAIL backend=delivery-time handled=%d poisoned=%d extra_runs=%d sabotage=%d retries_timed=%d late_p50_ms=%.1f late_p99_ms=%.1f late_max_ms=%.1f faults=%q\n",
		handled, poisoned, extra, r.sabotage, len(late), pctMS(late, 50), pctMS(late, 99), pctMS(late, 100), strings.Join(fl, " "))
	for _, why := range explained {
		fmt.Printf("NOLOSS-DUPLICATE %s\n", why)
	}

	if len(missing) > 0 {
		var lines []string
		for _, id := range missing[:min(20, len(missing))] {
			lines = append(lines, fmt.Sprintf("  %s (fate %s)", id, r.fates[id]))
		}
		t.Errorf("%d of %d messages lost (neither handled nor poisoned); first %d:\n%s", len(missing), r.n, min(20, len(missing)), strings.Join(lines, "\n"))
	}
	for _, why := range unexplained {
		t.Errorf("duplicate not explained by a lost settlement: %s", why)
	}
	for _, id := range r.uuids {
		switch fate := r.fates[id]; {
		case fate == fates.Permanent && len(r.records[id]) > 0:
			t.Errorf("%s (permanent) was handled", id)
		case fate != fates.Permanent && len(r.poisoned[id]) > 0:
			t.Errorf("%s (%s) was poisoned: %v", id, fate, r.poisoned[id])
		case fate == fates.Permanent && len(r.poisoned[id]) > 0 && r.poisoned[id][0] != string(amqpretry.ReasonPermanent):
			t.Errorf("%s (permanent) poisoned with reason %q", id, r.poisoned[id][0])
		}
		for _, rec := range r.records[id] {
			if r.fates[id] == fates.Transient && rec.attempt <= noloss1.Failures {
				t.Errorf("%s (transient) handled on attempt %d", id, rec.attempt)
			}
		}
	}
	if m, _, _ := r.workQueueStats(); m != 0 {
		t.Errorf("the work queue has %d messages at the end, want 0", m)
	}
	if t.Failed() {
		t.Logf("consumer log (last 8 KiB): %s", tail(r.logPath, 8192))
	}
}

// quiet tells whether the work queue has nothing: no message ready, delivered or
// held for later.
func (r *nolossRun) quiet() bool {
	m, _, _ := r.workQueueStats()
	return m == 0
}

// explain tells why message id was handled (or poisoned) more than once: a delivery
// whose settlement was lost is handled, then a fault (a closed connection, a killed
// consumer, a broker stop) ends its link before the broker gets the settlement, and
// the broker delivers it again. So every handling but the last must have arrived
// before a fault and ended no later than it, and the next one arrived after that
// fault began. A retry copied twice would show two handlings apart from any fault.
func (r *nolossRun) explain(id string) (string, bool) {
	recs := append([]nolossRecord(nil), r.records[id]...)
	sort.Slice(recs, func(i, j int) bool { return recs[i].arrived.Before(recs[j].arrived) })
	var parts []string
	ok := true
	for i, rec := range recs {
		parts = append(parts, fmt.Sprintf("handled attempt %d at %.3fs by pid %s", rec.attempt, rec.arrived.Sub(r.start).Seconds(), rec.consumer))
		if i == len(recs)-1 {
			break
		}
		next := recs[i+1]
		f, found := r.faultBetween(rec.arrived, next.arrived)
		switch {
		case !found:
			ok = false
			parts = append(parts, "no fault between these two handlings")
		case next.arrived.Equal(rec.arrived) && next.consumer == rec.consumer && next.attempt == rec.attempt:
			// One delivery, two records: the broker took the record but its outcome
			// was lost in the fault, and the recorder published it again.
			parts = append(parts, fmt.Sprintf("recorded twice: fault %s at %.1f-%.1fs lost the outcome of the record's publish", f.name, f.start.Sub(r.start).Seconds(), f.end.Sub(r.start).Seconds()))
		default:
			parts = append(parts, fmt.Sprintf("then fault %s at %.1f-%.1fs ended its link before its settlement reached the broker, which delivered it again", f.name, f.start.Sub(r.start).Seconds(), f.end.Sub(r.start).Seconds()))
		}
	}
	if n := len(r.poisoned[id]); n > 0 {
		// Poisoned more than once: the poison publish was confirmed, then the accept
		// of the delivery lost. Records do not time it; it must be within the faults'
		// reach (the test saw no poisoning but at a fault, see below).
		parts = append(parts, fmt.Sprintf("poisoned %d times %v", n, r.poisoned[id]))
		if n > 1 && len(r.faults) == 0 {
			ok = false
		}
	}
	return fmt.Sprintf("%s (%s): %s", id, r.fates[id], strings.Join(parts, "; ")), ok
}

// recordSlack is how long after a fault's end a delivery that arrived then may still
// have lost its settlement or its record's outcome to it: the consumer's reconnection
// backoff (up to 10 s) and its recorder's publish timeout (10 s).
const recordSlack = 20 * time.Second

// faultBetween returns a fault that could have ended the link of a delivery that
// arrived at first and came back at next: one that began before next arrived, and
// ended after first arrived (the settlement follows the arrival by the handler's time).
// Of several, the last to begin before next is the one; a fault that began up to a
// second after next (the consumer's clock against the test's) only if no other did.
func (r *nolossRun) faultBetween(first, next time.Time) (nolossFaultRecord, bool) {
	var found nolossFaultRecord
	ok := false
	for _, f := range r.faults {
		if !f.start.Add(-time.Second).Before(next) || !f.end.Add(recordSlack).After(first) {
			continue
		}
		if !ok || f.start.Before(next) {
			found, ok = f, true
		}
	}
	return found, ok
}

func pctMS(sorted []time.Duration, p int) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := min((len(sorted)*p+99)/100, len(sorted)) - 1
	return float64(sorted[max(i, 0)].Microseconds()) / 1000
}
