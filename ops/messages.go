package ops

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

// defaultWindow bounds how many messages a run keeps unacknowledged at once.
const defaultWindow = 10_000

// defaultListLimit is how many messages List returns unless told otherwise.
const defaultListLimit = 100

// Filter selects messages of the poison or parking queue. Zero fields match all.
type Filter struct {
	// Queue: the queue the message failed on (Envelope.Queue) or, for a retry in the
	// parking queue scheduled by other code than the middleware, the queue it was due
	// back to.
	Queue string `json:"queue,omitempty"`
	// Reason: the poison reason.
	Reason amqpretry.Reason `json:"reason,omitempty"`
	// Error: a substring of the error text (Envelope.Error).
	Error string `json:"error,omitempty"`
	// OlderThan and NewerThan compare Message.Time with now. A message without a time
	// matches neither.
	OlderThan time.Duration `json:"older_than_ns,omitempty"`
	NewerThan time.Duration `json:"newer_than_ns,omitempty"`
	// IDs: Watermill UUIDs or AMQP message ids.
	IDs []string `json:"ids,omitempty"`
}

func (f Filter) empty() bool {
	return f.Queue == "" && f.Reason == "" && f.Error == "" && f.OlderThan == 0 && f.NewerThan == 0 && len(f.IDs) == 0
}

func (f Filter) validate() error {
	var errs []error
	if f.OlderThan < 0 {
		errs = append(errs, fmt.Errorf("OlderThan: %s is negative", f.OlderThan))
	}
	if f.NewerThan < 0 {
		errs = append(errs, fmt.Errorf("NewerThan: %s is negative", f.NewerThan))
	}
	return errors.Join(errs...)
}

// match tells whether m passes f at now.
func (f Filter) match(m Message, now time.Time) bool {
	switch {
	case f.Queue != "" && m.Queue != f.Queue,
		f.Reason != "" && m.Reason != f.Reason,
		f.Error != "" && !strings.Contains(m.Error, f.Error):
		return false
	case f.OlderThan > 0 && (m.Time.IsZero() || now.Sub(m.Time) < f.OlderThan),
		f.NewerThan > 0 && (m.Time.IsZero() || now.Sub(m.Time) > f.NewerThan):
		return false
	}
	return len(f.IDs) == 0 || slices.ContainsFunc(f.IDs, func(id string) bool { return id == m.UUID || id == m.MessageID })
}

// Message is one message of the poison or parking queue: its failure envelope, and
// what the queue delivered. The Envelope's Queue is where a redrive sends it: the
// envelope's, or, for a retry in the parking queue scheduled by other code than the
// middleware (it has no envelope), the queue its routing key names (after one word per level for binary-levels); "" when
// unknown.
//
// The Envelope's fields keep their own JSON tags (snake_case, see middleware.Envelope)
// and appear at the top level of a Message's JSON object, next to uuid, routing_key...
type Message struct {
	middleware.Envelope
	// UUID is the Watermill message UUID; MessageID the AMQP message id.
	UUID      string `json:"uuid"`
	MessageID string `json:"message_id,omitempty"`
	// RoutingKey of this delivery.
	RoutingKey string `json:"routing_key"`
	// Time is what the age filters compare: LastFailure, else Due, else the AMQP
	// timestamp; zero when none is known.
	Time time.Time `json:"time,omitzero"`
	// Size of the payload in bytes.
	Size int `json:"size"`
	// Metadata is every header as the library's marshaler reads it (non-string headers
	// encoded), and Payload the body: set only with ListOptions.Full.
	Metadata message.Metadata `json:"metadata,omitempty"`
	Payload  []byte           `json:"payload,omitempty"`
	// For a waiting retry (Source Waiting), as the broker keeps it, read without
	// changing it: the DelayQueue it waits in (the work queue itself for RabbitMQ 4.3's
	// delayed retry), its Position there (1: next out; for delayed retry, its log
	// index), its counters x-delivery-count and x-acquired-count (RabbitMQ 4.x), and
	// Release, when the broker lets it out of there: the delay queue's expiry of it
	// (binary-levels: to the next level), or delayed retry's due time.
	DelayQueue    string    `json:"delay_queue,omitempty"`
	Position      int       `json:"position,omitempty"`
	DeliveryCount int64     `json:"x_delivery_count,omitempty"`
	AcquiredCount int64     `json:"x_acquired_count,omitempty"`
	Release       time.Time `json:"release,omitzero"`
}

// message reads d.
func (o *Ops) message(d amqp.Delivery, full bool) (Message, error) {
	msg, err := marshal.Marshaler{}.Unmarshal(d)
	if err != nil {
		return Message{}, fmt.Errorf("read message %s: %w", d.MessageId, err)
	}
	m := Message{
		Envelope: middleware.ReadEnvelope(msg.Metadata),
		UUID:     msg.UUID, MessageID: d.MessageId, RoutingKey: d.RoutingKey, Size: len(d.Body),
	}
	switch {
	case !m.LastFailure.IsZero():
		m.Time = m.LastFailure
	case !m.Due.IsZero():
		m.Time = m.Due
	case !d.Timestamp.IsZero():
		m.Time = d.Timestamp
	}
	if m.Reason == "" {
		// Dead-lettered by the broker from its work queue past the delivery limit: the
		// handler may never have seen it (docs/troubleshooting.md).
		// The latest death: x-last-death-* from RabbitMQ 3.13, x-death's first entry
		// before.
		if info, err := xdeath.Parse(d.Headers); err == nil && len(info.Deaths) > 0 && info.Deaths[0].Reason == "delivery_limit" {
			m.Reason = amqpretry.ReasonDeliveryLimit
			if m.Queue == "" {
				m.Queue = info.Deaths[0].Queue
			}
		}
	}
	if m.Queue == "" && d.Exchange != "" {
		// Dead-lettered to a delivery exchange, then to the parking queue: the routing
		// key it was published with names the queue, as the backend reads it.
		m.Queue = d.RoutingKey
		if s, ok := o.backend.(backend.Storage); ok {
			m.Queue = s.QueueOf(d.RoutingKey)
		}
	}
	if full {
		m.Metadata, m.Payload = msg.Metadata, msg.Payload
	}
	return m, nil
}

// ListOptions configures List.
type ListOptions struct {
	Filter
	// Limit: at most this many messages. Default (0): 100; negative: no limit.
	Limit int
	// Full fills Message.Metadata and Message.Payload.
	Full bool
	// Window bounds the messages kept unacked during the scan. Default (0): 10,000.
	Window int
}

// ListResult is the outcome of List.
type ListResult struct {
	// Queue listed, its Depth when the listing started, the messages Scanned, and the
	// matching Messages in queue order.
	Queue    string    `json:"queue"`
	Depth    int       `json:"depth"`
	Scanned  int       `json:"scanned"`
	Messages []Message `json:"messages"`
	// Complete is false when the scan stopped at Limit or at the window before it saw
	// every message present when it started.
	Complete bool `json:"complete"`
}

// List lists the messages of source that match opts, in queue order, changing nothing:
// each is taken (basic.get) and kept unacked until the end, then every one is given back
// (basic.nack with requeue), back in its place.
func (o *Ops) List(ctx context.Context, source Source, opts ListOptions) (ListResult, error) {
	if source == Waiting {
		return o.listWaiting(ctx, opts)
	}
	queue, err := o.queue(source)
	if err != nil {
		return ListResult{}, err
	}
	res := ListResult{Queue: queue, Messages: []Message{}}
	if err := errors.Join(opts.validate(), nonNegative("Window", opts.Window)); err != nil {
		return res, fmt.Errorf("list queue %q: invalid options: %w", queue, err)
	}
	if opts.Limit == 0 {
		opts.Limit = defaultListLimit
	}
	sc, err := o.newScan(queue, opts.Window)
	if err != nil {
		return res, err
	}
	defer sc.close()
	res.Depth = sc.depth
	now := time.Now()
	for {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		if opts.Limit > 0 && len(res.Messages) >= opts.Limit || sc.full() {
			res.Complete = sc.done()
			return res, nil
		}
		d, ok, err := sc.next()
		if err != nil {
			return res, err
		}
		if !ok {
			res.Complete = true
			return res, nil
		}
		sc.keep(d)
		res.Scanned++
		m, err := o.message(d, opts.Full)
		if err != nil {
			return res, err
		}
		if opts.match(m, now) {
			res.Messages = append(res.Messages, m)
		}
	}
}

// MoveOptions configures Redrive and Purge.
type MoveOptions struct {
	Filter
	// Limit: act on at most this many matching messages. Zero: no limit.
	Limit int
	// DryRun reports what would be done and changes nothing: every message is given
	// back in its place. A redrive's (and a retry now's) dry run checks each message's
	// queue passively (queue.declare passive, nothing published), as the publish would
	// find it: a message whose queue does not exist is in Unrouted, as in the run.
	DryRun bool
	// Rate: at most this many messages per second. Zero: as fast as confirms come.
	Rate float64
	// ResetAttempts (Redrive only) removes the attempt count (Envelope.Attempt), so the
	// message gets the policy's full attempts again. Without it, a message poisoned at
	// its last attempt is poisoned again at its next failure.
	ResetAttempts bool
	// All (Purge only) must be set to purge with an empty Filter.
	All bool
	// Window bounds the messages kept unacked during the run. Default (0): 10,000.
	Window int
	// Progress, if set, is called after each message with the result so far.
	Progress func(MoveResult)
	// head keeps a redriven message's mark as its order key's head (Release with
	// RedriveHead): a message redriven otherwise goes behind its key like any other.
	head bool
}

// MoveResult is the outcome of Redrive and Purge.
type MoveResult struct {
	// Queue the messages were taken from, and its Depth when the run started; a run
	// never looks at more than that.
	Queue string `json:"queue"`
	Depth int    `json:"depth"`
	// Scanned messages; Matched the filter; Done (redriven or purged; in a dry run,
	// always 0); Skipped (did not match, left in place); Unroutable (their queue does
	// not exist or is unknown, left in place).
	Scanned    int `json:"scanned"`
	Matched    int `json:"matched"`
	Done       int `json:"done"`
	Skipped    int `json:"skipped"`
	Unroutable int `json:"unroutable"`
	// DryRun: nothing was changed.
	DryRun bool `json:"dry_run"`
	// DelayQueues, for Source Waiting, are the queues the retries were taken from: the
	// delay queues, and the work queue itself for RabbitMQ 4.3's delayed retry.
	DelayQueues []string `json:"delay_queues,omitempty"`
	// Messages acted on (in a dry run, those that would be), without metadata, and
	// Unrouted, the unroutable ones, left in place (Message.Queue is where each should
	// have gone, "" when unknown).
	Messages []Message `json:"messages"`
	Unrouted []Message `json:"unrouted"`
	// Stopped says why the run ended before it saw every message present when it
	// started: "limit" (MoveOptions.Limit matching messages were acted on), "window"
	// (the window of kept messages is full: run again to go on), "interrupted" (the
	// context ended; the run stopped between two messages); "" when it did not.
	Stopped string `json:"stopped,omitempty"`
}

// Redrive sends each message of source that matches opts back to its queue
// (Message.Queue), in queue order, at most opts.Rate per second. Each goes through the
// library's confirmed hand-off (persistent, mandatory, confirm awaited) to the default
// exchange, and is acked in source only after the confirm: at-least-once, nothing
// lost. If the process dies between the confirm and the ack, the message is both back
// on its queue and still in source (a duplicate, never a loss). A message whose queue
// does not exist is returned by the broker and stays in source (MoveResult.Unrouted);
// so do messages that do not match, in their order. A cancelled ctx stops the run
// between two messages (Stopped "interrupted"), with a nil error. The redriven copy
// keeps its failure envelope without the poison reason, and records the redrive
// (Envelope.RedrivenAt, Redriven, RedrivenFrom). A poisoned head of an order key
// (amqpretry.Config.OrderKey) is redriven as any message of its key: behind it, if the
// key is blocked; Release with RedriveHead sends it back as the key's head.
func (o *Ops) Redrive(ctx context.Context, source Source, opts MoveOptions) (MoveResult, error) {
	return o.move(ctx, source, opts, true)
}

// Purge deletes (acks) each message of source that matches opts; the others stay in
// place, in order. An empty filter needs opts.All.
func (o *Ops) Purge(ctx context.Context, source Source, opts MoveOptions) (MoveResult, error) {
	return o.move(ctx, source, opts, false)
}

func nonNegative(field string, n int) error {
	if n < 0 {
		return fmt.Errorf("%s: %d is negative", field, n)
	}
	return nil
}

// move is Redrive (redrive true) or Purge.
func (o *Ops) move(ctx context.Context, source Source, opts MoveOptions, redrive bool) (MoveResult, error) {
	if source == Waiting {
		return o.moveWaiting(ctx, opts, redrive)
	}
	queue, err := o.queue(source)
	if err != nil {
		return MoveResult{}, err
	}
	return o.moveQueue(ctx, queue, opts, redrive, false)
}

// moveQueue is Redrive (redrive true) or Purge of queue; waiting tells that it has
// waiting retries, sent back as they are (retry now).
func (o *Ops) moveQueue(ctx context.Context, queue string, opts MoveOptions, redrive, waiting bool) (MoveResult, error) {
	verb := "redrive"
	switch {
	case !redrive:
		verb = "purge"
	case waiting:
		verb = "retry now"
	}
	res := MoveResult{Queue: queue, DryRun: opts.DryRun, Messages: []Message{}, Unrouted: []Message{}}
	errs := []error{opts.validate(), nonNegative("Limit", opts.Limit), nonNegative("Window", opts.Window)}
	if opts.Rate < 0 {
		errs = append(errs, fmt.Errorf("Rate: %g is negative", opts.Rate))
	}
	if err := errors.Join(errs...); err != nil {
		return res, fmt.Errorf("%s queue %q: invalid options: %w", verb, queue, err)
	}
	if !redrive && opts.empty() && !opts.All {
		return res, fmt.Errorf("purge queue %q: no filter given; set MoveOptions.All to purge every message", queue)
	}
	sc, err := o.newScan(queue, opts.Window)
	if err != nil {
		return res, err
	}
	defer sc.close()
	res.Depth = sc.depth
	pace := newPacer(opts.Rate)
	report := func() {
		if opts.Progress != nil {
			opts.Progress(res)
		}
	}
	now := time.Now()
	routable := map[string]bool{} // a dry run's answers, by queue
	for {
		switch {
		case ctx.Err() != nil:
			res.Stopped = "interrupted"
			return res, nil
		case opts.Limit > 0 && res.Matched >= opts.Limit:
			res.Stopped = "limit"
			return res, nil
		case sc.full():
			if !sc.done() {
				res.Stopped = "window"
			}
			return res, nil
		}
		d, ok, err := sc.next()
		if err != nil || !ok {
			return res, err
		}
		res.Scanned++
		m, err := o.message(d, false)
		if err != nil {
			sc.keep(d)
			return res, err
		}
		if waiting {
			m.DelayQueue = queue
		}
		if !opts.match(m, now) {
			sc.keep(d)
			res.Skipped++
			report()
			continue
		}
		res.Matched++
		if opts.DryRun {
			sc.keep(d)
			if redrive {
				ok, err := o.routable(m.Queue, routable)
				if err != nil {
					return res, fmt.Errorf("%s message %s (dry run): %w", verb, m.UUID, err)
				}
				if !ok {
					res.Unroutable++
					res.Unrouted = append(res.Unrouted, m)
					report()
					continue
				}
			}
			res.Messages = append(res.Messages, m)
			report()
			continue
		}
		if err := pace.wait(ctx); err != nil {
			sc.keep(d) // interrupted before this message: it stays
			res.Matched--
			res.Stopped = "interrupted"
			return res, nil
		}
		if redrive {
			err := o.send(ctx, queue, d, m, opts.ResetAttempts, waiting, opts.head)
			switch {
			case errors.Is(err, backend.ErrReturned) || errors.Is(err, errNoQueue):
				sc.keep(d)
				res.Unroutable++
				res.Unrouted = append(res.Unrouted, m)
				report()
				continue
			case err != nil:
				sc.keep(d)
				return res, fmt.Errorf("redrive message %s to queue %q: %w", m.UUID, m.Queue, o.redact(err))
			}
		}
		if err := sc.ack(d); err != nil {
			return res, err
		}
		res.Done++
		res.Messages = append(res.Messages, m)
		report()
	}
}

// routable tells whether a redrive's publish to queue (the default exchange, with the
// queue as routing key, mandatory) would be routed, as send's would: the queue exists.
// It asks passively (queue.declare passive), publishing nothing, once per queue
// (answers keeps the answers). A queue that is unknown ("") is not routable.
func (o *Ops) routable(queue string, answers map[string]bool) (bool, error) {
	if queue == "" {
		return false, nil
	}
	if ok, known := answers[queue]; known {
		return ok, nil
	}
	_, ok, err := o.inspect(queue)
	if err != nil && amqperr.IsCode(err, amqp.ResourceLocked) {
		// Exclusive to another connection: declaring is refused, routing is not.
		ok, err = true, nil
	}
	if err != nil {
		return false, err
	}
	answers[queue] = ok
	return ok, nil
}

var errNoQueue = errors.New("the queue to send it to is unknown: no envelope, and no queue in its routing key")

// send publishes the message of d to its queue through the hand-off.
// A waiting retry (retry now) goes back as it is, without the redrive's marks.
func (o *Ops) send(ctx context.Context, source string, d amqp.Delivery, m Message, reset, waiting, head bool) error {
	if m.Queue == "" {
		return errNoQueue
	}
	msg, err := marshal.Marshaler{}.Unmarshal(d)
	if err != nil {
		return err
	}
	if !waiting {
		env := middleware.ReadEnvelope(msg.Metadata)
		if reset {
			env.Attempt = 0
		}
		env.Reason = ""
		env.RedrivenAt, env.Redriven, env.RedrivenFrom = time.Now().UTC(), env.Redriven+1, source
		env.Write(msg.Metadata)
	}
	delete(msg.Metadata, keys.Tier) // ttl-tiers' routing header, of no use on the way back
	if !head && !waiting {
		// A poisoned head of an order key, redriven, waits behind its key like any
		// message: it would otherwise release the key, overtaking its current head.
		delete(msg.Metadata, keys.OrderHead)
	}
	// The publish is not cancelled by ctx: once started, a message is finished (its
	// confirm awaited) so that an interrupt stops between messages. No owned topology:
	// a queue that is gone is never declared again by a redrive.
	return o.handoff.Publish(context.WithoutCancel(ctx), "", m.Queue, msg, nil, true, nil)
}

// scan reads a queue with basic.get on a channel of its own, keeping messages
// unacknowledged until close gives them all back (basic.nack multiple, requeue): they
// return to their places, in order. If the process dies, the broker gives them back
// itself when the connection drops.
type scan struct {
	o      *Ops
	ch     *amqp.Channel
	queue  string
	depth  int
	seen   int
	kept   int
	window int
	empty  bool   // the queue had no more messages
	last   uint64 // the highest delivery tag taken
	acked  int
}

func (o *Ops) newScan(queue string, window int) (*scan, error) {
	if window == 0 {
		window = defaultWindow
	}
	q, exists, err := o.inspect(queue)
	if err != nil {
		return nil, err
	}
	if !exists {
		return nil, fmt.Errorf("queue %q does not exist", queue)
	}
	ch, err := o.channel()
	if err != nil {
		return nil, err
	}
	return &scan{o: o, ch: ch, queue: queue, depth: q.Messages, window: window}, nil
}

// next takes the next message, or ok=false once depth messages were seen or the queue
// is empty.
func (s *scan) next() (amqp.Delivery, bool, error) {
	if s.seen >= s.depth {
		return amqp.Delivery{}, false, nil
	}
	d, ok, err := s.ch.Get(s.queue, false)
	if err != nil {
		return d, false, fmt.Errorf("get from queue %q: %w", s.queue, s.o.redact(err))
	}
	if !ok {
		s.empty = true
		return d, false, nil
	}
	s.seen++
	s.last = d.DeliveryTag
	return d, true, nil
}

func (s *scan) keep(amqp.Delivery) { s.kept++ }

func (s *scan) ack(d amqp.Delivery) error {
	if err := s.ch.Ack(d.DeliveryTag, false); err != nil {
		return fmt.Errorf("ack message in queue %q: %w", s.queue, s.o.redact(err))
	}
	s.acked++
	return nil
}

// full tells whether the window of kept messages is full.
func (s *scan) full() bool { return s.kept >= s.window }

// done tells whether every message present at the start was seen.
func (s *scan) done() bool { return s.empty || s.seen >= s.depth }

// close gives back every kept message and closes the channel, then waits, briefly,
// until the broker shows them ready again: it requeues them asynchronously, and a run
// that starts before it has would see the queue shorter, or take what follows them
// first.
//
// A run that stopped early (a limit, an interrupt) first takes the rest of the messages
// present at its start, as far as the window allows, so that it gives back all of them
// at once: a quorum queue puts a message it gets back BEHIND the messages still in it,
// not in its place (RabbitMQ 3.10.8 at every return, 4.3.6 from the second return of a
// message: measured), so a partial give-back would reorder the queue. Only a run
// stopped by a full window can leave messages it never took before what it gives back.
func (s *scan) close() {
	if s.kept == 0 || s.ch.IsClosed() {
		_ = s.ch.Close()
		return
	}
	for !s.done() && !s.full() {
		d, ok, err := s.next()
		if err != nil || !ok {
			break
		}
		s.keep(d)
	}
	_ = s.ch.Nack(s.last, true, true) // every message still kept, up to the last taken
	_ = s.ch.Close()
	s.o.settle(s.queue, s.depth-s.acked) // what it gave back, and what it never took
}

// settleTimeout bounds the wait for messages given back to show as ready again.
const settleTimeout = 2 * time.Second

// settle waits, at most settleTimeout, until queue has at least n ready messages: the
// broker requeues what a channel gives back asynchronously, after it has confirmed
// the channel's close.
func (o *Ops) settle(queue string, n int) {
	deadline := time.Now().Add(settleTimeout)
	for time.Now().Before(deadline) {
		q, exists, err := o.inspect(queue)
		if err != nil || !exists || q.Messages >= n {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// pacer spaces actions at most rate per second.
type pacer struct {
	interval time.Duration
	next     time.Time
}

func newPacer(rate float64) *pacer {
	if rate <= 0 {
		return &pacer{}
	}
	return &pacer{interval: time.Duration(float64(time.Second) / rate)}
}

func (p *pacer) wait(ctx context.Context) error {
	if p.interval == 0 {
		return ctx.Err()
	}
	now := time.Now()
	if p.next.After(now) {
		t := time.NewTimer(p.next.Sub(now))
		defer t.Stop()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		now = p.next
	}
	p.next = now.Add(p.interval)
	return nil
}
