package ops

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

// Metadata keys a redrive writes on each message it sends back.
const (
	// RedrivenAtKey holds the time of the latest redrive (RFC 3339, UTC).
	RedrivenAtKey = "amqpretry-redriven-at"
	// RedriveCountKey holds how many times the message was redriven.
	RedriveCountKey = "amqpretry-redrive-count"
	// RedrivenFromKey holds the queue it was redriven from (poison or parking).
	RedrivenFromKey = "amqpretry-redriven-from"
)

// DefaultWindow bounds how many messages a scan holds unacknowledged at once (those
// that do not match the filter, those a dry run would move, those whose queue is
// gone). They stay in place and in order; a scan stops when the window is full.
const DefaultWindow = 10_000

// Filter selects messages of the poison or parking queue. Zero fields match all.
type Filter struct {
	// Queue: the queue the message failed on (amqpretry-queue) or, for a parked retry,
	// the queue it was due back to.
	Queue string `json:"queue,omitempty"`
	// Reason: the poison reason (permanent, max-attempts, delay-too-long).
	Reason string `json:"reason,omitempty"`
	// Error: a substring of the error text (amqpretry-error).
	Error string `json:"error,omitempty"`
	// OlderThan and NewerThan compare the message's time (amqpretry-last-failure, else
	// its due time, else its AMQP timestamp) with now. A message without a time
	// matches neither.
	OlderThan time.Duration `json:"older_than_ns,omitempty"`
	NewerThan time.Duration `json:"newer_than_ns,omitempty"`
	// IDs: Watermill UUIDs or AMQP message ids.
	IDs []string `json:"ids,omitempty"`
}

func (f Filter) empty() bool {
	return f.Queue == "" && f.Reason == "" && f.Error == "" && f.OlderThan == 0 && f.NewerThan == 0 && len(f.IDs) == 0
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
	if len(f.IDs) > 0 {
		for _, id := range f.IDs {
			if id == m.UUID || id == m.MessageID {
				return true
			}
		}
		return false
	}
	return true
}

// Message is one poisoned or parked message and its failure envelope.
type Message struct {
	// UUID is the Watermill message UUID; MessageID the AMQP message id.
	UUID      string `json:"uuid"`
	MessageID string `json:"message_id,omitempty"`
	// Queue is the queue it failed on, where a redrive sends it.
	Queue string `json:"queue"`
	// Reason it was poisoned (empty for a parked retry).
	Reason string `json:"reason,omitempty"`
	// Error and ErrorTypes of the latest failure.
	Error      string   `json:"error,omitempty"`
	ErrorTypes []string `json:"error_types,omitempty"`
	// Attempt is the attempt that failed last; MaxAttempts the policy's limit.
	Attempt     int `json:"attempt"`
	MaxAttempts int `json:"max_attempts,omitempty"`
	// FirstFailure and LastFailure, when recorded.
	FirstFailure time.Time `json:"first_failure,omitzero"`
	LastFailure  time.Time `json:"last_failure,omitzero"`
	// Handler and Topic that failed.
	Handler string `json:"handler,omitempty"`
	Topic   string `json:"topic,omitempty"`
	// Due is when a retry was due back (parked retries).
	Due time.Time `json:"due,omitzero"`
	// Time is what the age filters compare: LastFailure, else Due, else the AMQP
	// timestamp.
	Time time.Time `json:"time,omitzero"`
	// RoutingKey of this delivery.
	RoutingKey string `json:"routing_key"`
	// Redriven counts earlier redrives.
	Redriven int `json:"redriven,omitempty"`
	// Size of the payload in bytes.
	Size int `json:"size"`
	// Metadata is every metadata key, typed headers encoded (see xdeath), and Payload
	// the body: set by Show only.
	Metadata map[string]string `json:"metadata,omitempty"`
	Payload  []byte            `json:"payload,omitempty"`
}

// levelsKey parses a binary-levels routing key: one 0/1 word per level, then the queue.
var levelsKey = regexp.MustCompile(`^(?:[01]\.)+(.+)$`)

// message reads the envelope of d.
func (o *Ops) message(d amqp.Delivery, full bool) (Message, error) {
	msg, err := xdeath.Marshaler{}.Unmarshal(d)
	if err != nil {
		return Message{}, fmt.Errorf("read message %s: %w", d.MessageId, err)
	}
	md := msg.Metadata
	m := Message{
		UUID: msg.UUID, MessageID: d.MessageId, Queue: md.Get(middleware.QueueKey),
		Reason: md.Get(middleware.PoisonReasonKey), Error: md.Get(middleware.ErrorKey),
		Handler: md.Get(middleware.HandlerKey), Topic: md.Get(middleware.TopicKey),
		RoutingKey: d.RoutingKey, Size: len(d.Body),
	}
	if s := md.Get(middleware.ErrorTypesKey); s != "" {
		m.ErrorTypes = strings.Split(s, " > ")
	}
	m.Attempt, _ = strconv.Atoi(md.Get(middleware.AttemptKey))
	m.MaxAttempts, _ = strconv.Atoi(md.Get(middleware.MaxAttemptsKey))
	m.Redriven, _ = strconv.Atoi(md.Get(RedriveCountKey))
	m.FirstFailure, _ = time.Parse(time.RFC3339Nano, md.Get(middleware.FirstFailureKey))
	m.LastFailure, _ = time.Parse(time.RFC3339Nano, md.Get(middleware.LastFailureKey))
	m.Due, _ = time.Parse(time.RFC3339Nano, md.Get(middleware.DueKey))
	switch {
	case !m.LastFailure.IsZero():
		m.Time = m.LastFailure
	case !m.Due.IsZero():
		m.Time = m.Due
	case !d.Timestamp.IsZero():
		m.Time = d.Timestamp
	}
	if m.Queue == "" && d.Exchange != "" {
		// A parked retry scheduled by other code than the middleware: its routing key
		// names the queue (ttl-tiers), after one word per level (binary-levels).
		m.Queue = d.RoutingKey
		if o.cfg.Delay.Backend == delay.BackendBinaryLevels {
			if sm := levelsKey.FindStringSubmatch(d.RoutingKey); sm != nil && strings.Count(d.RoutingKey[:len(d.RoutingKey)-len(sm[1])], ".") == o.cfg.Delay.Levels {
				m.Queue = sm[1]
			}
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
	// Limit: at most this many messages. Default: 100; negative: no limit.
	Limit int
	// Full fills Message.Metadata and Message.Payload.
	Full bool
	// Window bounds the messages held during the scan. Default: DefaultWindow.
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
	// Complete is false when the scan stopped at Limit or at the window.
	Complete bool `json:"complete"`
}

// ListPoison lists the poison queue's messages that match opts, in queue order,
// changing nothing: each is taken (basic.get) and held until the end, then every one
// is given back (basic.nack with requeue), back in its place.
func (o *Ops) ListPoison(ctx context.Context, opts ListOptions) (ListResult, error) {
	return o.List(ctx, o.PoisonQueue(), opts)
}

// ListParking lists the parking queue's messages as ListPoison does.
func (o *Ops) ListParking(ctx context.Context, opts ListOptions) (ListResult, error) {
	return o.List(ctx, o.ParkingQueue(), opts)
}

// List lists the messages of queue (a poison or parking queue) that match opts.
func (o *Ops) List(ctx context.Context, queue string, opts ListOptions) (ListResult, error) {
	if opts.Limit == 0 {
		opts.Limit = 100
	}
	res := ListResult{Queue: queue, Messages: []Message{}}
	sc, err := o.newScan(queue, opts.Window)
	if err != nil {
		return res, err
	}
	defer sc.close()
	res.Depth = sc.depth
	now := time.Now()
	res.Complete = true
	for {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		if opts.Limit > 0 && len(res.Messages) >= opts.Limit || sc.full() {
			res.Complete = sc.done()
			return res, nil
		}
		d, ok, err := sc.next()
		if err != nil || !ok {
			return res, err
		}
		sc.hold(d)
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

// Progress counts what a redrive or purge has done so far.
type Progress struct {
	// Depth is the number of messages in the queue when the run started; a run never
	// looks at more than that.
	Depth int `json:"depth"`
	// Scanned messages, Matched the filter, Done (redriven or purged), Skipped (did
	// not match; left in place), Unroutable (queue gone; left in place).
	Scanned    int `json:"scanned"`
	Matched    int `json:"matched"`
	Done       int `json:"done"`
	Skipped    int `json:"skipped"`
	Unroutable int `json:"unroutable"`
}

// MoveOptions configures Redrive and Purge.
type MoveOptions struct {
	Filter
	// Limit: act on at most this many matching messages. Zero: no limit.
	Limit int
	// DryRun reports what would be done and changes nothing: every message is given
	// back in its place.
	DryRun bool
	// Rate: at most this many messages per second. Zero: as fast as confirms come.
	Rate float64
	// ResetAttempts (Redrive only) removes amqpretry-attempt, so the message gets the
	// policy's full attempts again. Without it, a message poisoned at its last attempt
	// is poisoned again at its next failure (the middleware counts on from it).
	ResetAttempts bool
	// All (Purge only) must be set to purge with an empty Filter.
	All bool
	// Window bounds the messages held during the run. Default: DefaultWindow.
	Window int
	// Progress, if set, is called after each message.
	Progress func(Progress)
}

// Unroutable is a message whose queue does not exist: it stays where it was.
type Unroutable struct {
	// UUID of the message, the Queue it should go to, and why it could not.
	UUID   string `json:"uuid"`
	Queue  string `json:"queue"`
	Reason string `json:"reason"`
}

// MoveResult is the outcome of Redrive and Purge.
type MoveResult struct {
	// Queue the messages were taken from.
	Queue string `json:"queue"`
	// Progress: the final counts.
	Progress
	// DryRun: nothing was changed.
	DryRun bool `json:"dry_run"`
	// Messages acted on (or, in a dry run, that would be), without metadata.
	Messages []Message `json:"messages"`
	// Unrouted lists the unroutable messages, left in place.
	Unrouted []Unroutable `json:"unroutable_messages"`
	// Stopped says why the run ended early: "", "limit", "window", "interrupted".
	Stopped string `json:"stopped,omitempty"`
}

// Stop reasons of MoveResult.
const (
	StoppedLimit       = "limit"
	StoppedWindow      = "window"
	StoppedInterrupted = "interrupted"
)

// RedrivePoison sends matching poisoned messages back to the queue each failed on.
// See Redrive.
func (o *Ops) RedrivePoison(ctx context.Context, opts MoveOptions) (MoveResult, error) {
	return o.Redrive(ctx, o.PoisonQueue(), opts)
}

// RedriveParking sends matching parked retries to the queue each was due back to, once
// it exists again. See Redrive.
func (o *Ops) RedriveParking(ctx context.Context, opts MoveOptions) (MoveResult, error) {
	return o.Redrive(ctx, o.ParkingQueue(), opts)
}

// Redrive sends each message of source (a poison or parking queue) that matches opts
// back to its queue (Message.Queue), in queue order, at most opts.Rate per second.
// Each goes through the library's confirmed hand-off (persistent, mandatory, confirm
// awaited) to the default exchange, and is acked in source only after the confirm:
// at-least-once, nothing lost. If the process dies between the confirm and the ack,
// the message is both back on its queue and still in source (a duplicate, never a
// loss). A message whose queue does not exist is returned by the broker and stays in
// source, reported in Unroutable; so do messages that do not match, in their order.
// A cancelled ctx stops the run between two messages. The redriven copy carries
// RedrivenAtKey, RedriveCountKey and RedrivenFromKey; the poison reason is removed.
func (o *Ops) Redrive(ctx context.Context, source string, opts MoveOptions) (MoveResult, error) {
	return o.move(ctx, source, opts, true)
}

// PurgePoison deletes matching messages of the poison queue. See Purge.
func (o *Ops) PurgePoison(ctx context.Context, opts MoveOptions) (MoveResult, error) {
	return o.Purge(ctx, o.PoisonQueue(), opts)
}

// Purge deletes (acks) each message of queue that matches opts; the others stay in
// place, in order. An empty filter needs opts.All.
func (o *Ops) Purge(ctx context.Context, queue string, opts MoveOptions) (MoveResult, error) {
	if opts.Filter.empty() && !opts.All {
		return MoveResult{Queue: queue}, fmt.Errorf("purge queue %q: no filter given; set All to purge every message", queue)
	}
	return o.move(ctx, queue, opts, false)
}

// move is Redrive (redrive true) or Purge.
func (o *Ops) move(ctx context.Context, source string, opts MoveOptions, redrive bool) (MoveResult, error) {
	res := MoveResult{Queue: source, DryRun: opts.DryRun, Messages: []Message{}, Unrouted: []Unroutable{}}
	sc, err := o.newScan(source, opts.Window)
	if err != nil {
		return res, err
	}
	defer sc.close()
	res.Depth = sc.depth
	pace := newPacer(opts.Rate)
	report := func() {
		if opts.Progress != nil {
			opts.Progress(res.Progress)
		}
	}
	now := time.Now()
	for {
		if ctx.Err() != nil {
			res.Stopped = StoppedInterrupted
			return res, nil
		}
		if opts.Limit > 0 && res.Matched >= opts.Limit {
			res.Stopped = StoppedLimit
			return res, nil
		}
		if sc.full() {
			if !sc.done() {
				res.Stopped = StoppedWindow
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
			sc.hold(d)
			return res, err
		}
		if !opts.match(m, now) {
			sc.hold(d)
			res.Skipped++
			report()
			continue
		}
		res.Matched++
		if opts.DryRun {
			sc.hold(d)
			res.Messages = append(res.Messages, m)
			report()
			continue
		}
		if err := pace.wait(ctx); err != nil {
			sc.hold(d) // interrupted before this message: it stays
			res.Matched--
			res.Stopped = StoppedInterrupted
			return res, nil
		}
		if redrive {
			err := o.send(ctx, source, d, m, opts.ResetAttempts)
			switch {
			case errors.Is(err, delay.ErrReturned) || errors.Is(err, errNoQueue):
				sc.hold(d)
				res.Unroutable++
				res.Unrouted = append(res.Unrouted, Unroutable{UUID: m.UUID, Queue: m.Queue, Reason: err.Error()})
				report()
				continue
			case err != nil:
				sc.hold(d)
				return res, fmt.Errorf("redrive message %s to queue %q: %w", m.UUID, m.Queue, err)
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

var errNoQueue = errors.New("no amqpretry-queue metadata nor routing key: the queue to send it to is unknown")

// send publishes the message of d to its queue through the hand-off.
func (o *Ops) send(ctx context.Context, source string, d amqp.Delivery, m Message, reset bool) error {
	if m.Queue == "" {
		return errNoQueue
	}
	msg, err := xdeath.Marshaler{}.Unmarshal(d)
	if err != nil {
		return err
	}
	if reset {
		delete(msg.Metadata, middleware.AttemptKey)
	}
	delete(msg.Metadata, middleware.PoisonReasonKey)
	delete(msg.Metadata, xdeath.DeliveryExchangeKey)
	delete(msg.Metadata, xdeath.DeliveryRoutingKeyKey)
	msg.Metadata.Set(RedrivenAtKey, time.Now().UTC().Format(time.RFC3339Nano))
	msg.Metadata.Set(RedriveCountKey, strconv.Itoa(m.Redriven+1))
	msg.Metadata.Set(RedrivenFromKey, source)
	// The publish is not cancelled by ctx: once started, a message is finished (its
	// confirm awaited) so that an interrupt stops between messages.
	return o.handoff.PublishMessage(context.WithoutCancel(ctx), "", m.Queue, msg, nil)
}

// scan reads a queue with basic.get on a channel of its own, holding messages
// unacknowledged until close gives them all back (basic.nack multiple, requeue): they
// return to their places, in order. If the process dies, the broker gives them back
// itself when the connection drops.
type scan struct {
	ch     *amqp.Channel
	queue  string
	depth  int
	seen   int
	held   int
	window int
	last   uint64 // highest delivery tag held, for the final nack
	// empty: the queue had no more messages.
	empty bool
}

func (o *Ops) newScan(queue string, window int) (*scan, error) {
	if window <= 0 {
		window = DefaultWindow
	}
	q, exists, err := o.queueDepth(queue)
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
	return &scan{ch: ch, queue: queue, depth: q.Messages, window: window}, nil
}

// next takes the next message, or ok=false once depth messages were seen or the queue
// is empty.
func (s *scan) next() (amqp.Delivery, bool, error) {
	if s.seen >= s.depth {
		return amqp.Delivery{}, false, nil
	}
	d, ok, err := s.ch.Get(s.queue, false)
	if err != nil {
		return d, false, fmt.Errorf("get from queue %q: %w", s.queue, err)
	}
	if !ok {
		s.empty = true
		return d, false, nil
	}
	s.seen++
	return d, true, nil
}

func (s *scan) hold(d amqp.Delivery) {
	s.held++
	s.last = max(s.last, d.DeliveryTag)
}

func (s *scan) ack(d amqp.Delivery) error {
	if err := s.ch.Ack(d.DeliveryTag, false); err != nil {
		return fmt.Errorf("ack message in queue %q: %w", s.queue, err)
	}
	return nil
}

// full tells whether the window of held messages is full.
func (s *scan) full() bool { return s.held >= s.window }

// done tells whether every message present at the start was seen.
func (s *scan) done() bool { return s.empty || s.seen >= s.depth }

// close gives back every held message and closes the channel.
func (s *scan) close() {
	if s.held > 0 && !s.ch.IsClosed() {
		_ = s.ch.Nack(0, true, true) // tag 0 with multiple: every unacknowledged message
	}
	_ = s.ch.Close()
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
