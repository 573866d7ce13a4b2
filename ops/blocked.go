package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// Blocked keys (amqpretry.Config.OrderKey): an order key whose message waits for its
// retry, or was poisoned with Config.BlockOnPoison, holds its later messages in a
// queue of its own (its behind queue) until its head succeeds or an operator releases
// it.

// BlockedKey is an order key blocked in a work queue.
type BlockedKey struct {
	// Queue is the work queue, Key the order key.
	Queue string `json:"queue"`
	Key   string `json:"key"`
	// BehindQueue holds the messages that wait behind the key, Behind of them (ready).
	BehindQueue string `json:"behind_queue"`
	Behind      int    `json:"behind"`
	// Head is the key's poisoned head when it is in the poison queue (a key blocked
	// with Config.BlockOnPoison; its Metadata and Payload left out); nil when the head
	// waits for its retry, or is gone.
	Head *Message `json:"head,omitempty"`
}

// Blocked lists the blocked keys under the prefix, with the messages behind each and,
// from the poison queue, each one's poisoned head. Listing the behind queues needs
// rabbitmqctl (Config.Rabbitmqctl): AMQP has no way to list queues.
func (o *Ops) Blocked(ctx context.Context) ([]BlockedKey, error) {
	queues, err := o.behindQueues(ctx)
	if err != nil {
		return nil, err
	}
	var keysFound []BlockedKey
	for _, b := range queues {
		info, exists, err := o.inspect(b.BehindQueue)
		if err != nil {
			return nil, err
		}
		if !exists {
			continue // released meanwhile
		}
		b.Behind = info.Messages
		keysFound = append(keysFound, b)
	}
	if len(keysFound) == 0 {
		return []BlockedKey{}, nil
	}
	heads, err := o.poisonedHeads(ctx)
	if err != nil {
		return nil, err
	}
	for i := range keysFound {
		if h, ok := heads[[2]string{keysFound[i].Queue, keysFound[i].Key}]; ok {
			keysFound[i].Head = &h
		}
	}
	slices.SortFunc(keysFound, func(a, b BlockedKey) int {
		return strings.Compare(a.Queue+"\x00"+a.Key, b.Queue+"\x00"+b.Key)
	})
	return keysFound, nil
}

// behindQueues lists the behind queues under the prefix with rabbitmqctl list_queues
// (AMQP has no way to list queues): each one's work queue and key, from its arguments
// (Behind not set).
func (o *Ops) behindQueues(ctx context.Context) ([]BlockedKey, error) {
	if o.ctl == nil {
		return nil, errors.New("blocked keys: listing their queues needs rabbitmqctl (Config.Rabbitmqctl; the CLI's --rabbitmqctl)")
	}
	out, err := o.ctl(ctx, "-q", "list_queues", "-p", o.vhost, "name", "arguments", "--formatter", "json")
	if err != nil {
		return nil, fmt.Errorf("rabbitmqctl list_queues: %w", o.redact(err))
	}
	var queues []struct {
		Name      string  `json:"name"`
		Arguments [][]any `json:"arguments"`
	}
	if err := json.Unmarshal(out, &queues); err != nil {
		return nil, fmt.Errorf("rabbitmqctl list_queues: unreadable output: %w", err)
	}
	prefix := strings.TrimSuffix(o.names.BehindQueues(), "*")
	var found []BlockedKey
	for _, q := range queues {
		if !strings.HasPrefix(q.Name, prefix) {
			continue
		}
		b := BlockedKey{BehindQueue: q.Name}
		for _, a := range q.Arguments {
			if len(a) != 3 {
				continue
			}
			name, _ := a[0].(string)
			value, _ := a[2].(string)
			switch name {
			case declare.BehindQueueArg:
				b.Queue = value
			case declare.BehindKeyArg:
				b.Key = value
			}
		}
		if b.Queue == "" || o.names.Behind(b.Queue, b.Key) != q.Name {
			continue // not one of ours
		}
		found = append(found, b)
	}
	return found, nil
}

// poisonedHeads reads the poison queue for the heads of order keys, by work queue and
// key: the last one of each.
func (o *Ops) poisonedHeads(ctx context.Context) (map[[2]string]Message, error) {
	heads := map[[2]string]Message{}
	if _, exists, err := o.inspect(o.retry.PoisonQueue); err != nil || !exists {
		return heads, err
	}
	res, err := o.List(ctx, Poison, ListOptions{Limit: -1, Full: true})
	if err != nil {
		return nil, err
	}
	for _, m := range res.Messages {
		key, ok := m.Metadata[keys.OrderHead]
		if !ok {
			continue
		}
		m.Metadata, m.Payload = nil, nil
		heads[[2]string{m.Queue, key}] = m
	}
	return heads, nil
}

// ReleaseOptions configures Release.
type ReleaseOptions struct {
	// Queue is the work queue, Key the blocked order key.
	Queue, Key string
	// RedriveHead sends the key's poisoned head back to its work queue first (the
	// attempts reset): it runs before the messages behind the key, which run once it
	// succeeds (or is poisoned again: then, with Config.BlockOnPoison, the key stays
	// blocked). Without it the messages behind the key run at once, without their
	// head. A key with no poisoned head in the poison queue is refused with it.
	RedriveHead bool
	// Force releases a key whose head is not in the poison queue (its retry waits, or
	// it is gone): the messages behind it may then run before it.
	Force bool
	// DryRun reports what would be done and changes nothing.
	DryRun bool
}

// ReleaseResult is what Release did, or, in a dry run, would do.
type ReleaseResult struct {
	Key BlockedKey `json:"key"`
	// Redriven is the head sent back to the work queue, when RedriveHead; Released,
	// that a release was sent to the work queue instead.
	Redriven *Message `json:"redriven,omitempty"`
	Released bool     `json:"released"`
	DryRun   bool     `json:"dry_run"`
}

// Release releases a blocked key: it sends its work queue a release (a message the
// retry middleware takes for it and acks, keys.OrderRelease), confirmed, and the
// middleware consuming the queue runs the messages behind the key, in order, then
// unblocks it; or, with RedriveHead, it sends back the poisoned head, which releases
// the key when it succeeds. It refuses a key that is not blocked, and, unless Force,
// one whose head is not in the poison queue (it still waits for its retry, and would
// be overtaken).
func (o *Ops) Release(ctx context.Context, opts ReleaseOptions) (ReleaseResult, error) {
	res := ReleaseResult{DryRun: opts.DryRun}
	if opts.Queue == "" || opts.Key == "" {
		return res, errors.New("release: Queue and Key are both required")
	}
	all, err := o.Blocked(ctx)
	if err != nil {
		return res, err
	}
	i := slices.IndexFunc(all, func(b BlockedKey) bool { return b.Queue == opts.Queue && b.Key == opts.Key })
	if i < 0 {
		return res, fmt.Errorf("release key %q of queue %q: not blocked (no queue %q)", opts.Key, opts.Queue, o.names.Behind(opts.Queue, opts.Key))
	}
	res.Key = all[i]
	head := res.Key.Head
	switch {
	case opts.RedriveHead && head == nil:
		return res, fmt.Errorf("release key %q of queue %q: its head is not in the poison queue %q (it waits for its retry, which releases the key when it succeeds): nothing to redrive; release without it, with Force, to run the messages behind the key now", opts.Key, opts.Queue, o.retry.PoisonQueue)
	case head == nil && !opts.Force:
		return res, fmt.Errorf("release key %q of queue %q: its head is not in the poison queue %q: it waits for its retry, which releases the key when it succeeds, and %s behind it would overtake it; set Force to release it anyway", opts.Key, opts.Queue, o.retry.PoisonQueue, theMessages(res.Key.Behind))
	}
	if opts.DryRun {
		res.Redriven, res.Released = nil, !opts.RedriveHead
		if opts.RedriveHead {
			res.Redriven = head
		}
		return res, nil
	}
	if opts.RedriveHead {
		mr, err := o.Redrive(ctx, Poison, MoveOptions{Filter: Filter{IDs: []string{head.MessageID}, Queue: opts.Queue}, Limit: 1, ResetAttempts: true, head: true})
		if err != nil {
			return res, err
		}
		if mr.Done != 1 {
			return res, fmt.Errorf("release key %q of queue %q: its head %s was not redriven (%d unroutable): is the work queue there?", opts.Key, opts.Queue, head.UUID, mr.Unroutable)
		}
		res.Redriven = &mr.Messages[0]
		return res, nil
	}
	rel := message.NewMessage(watermill.NewUUID(), nil)
	rel.Metadata[keys.OrderRelease] = opts.Key
	if head != nil {
		// Released behind its poisoned head: a message behind the key that fails
		// replaces the head's mark, which would otherwise stay, and a later redrive
		// of the head would release the key behind the new head's back.
		rel.Metadata[keys.OrderReleaseHead] = head.UUID
	}
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), backend.DefaultConfirmTimeout+5*time.Second)
	defer cancel()
	if err := o.handoff.Publish(pctx, "", opts.Queue, rel, nil, true, nil); err != nil {
		return res, fmt.Errorf("release key %q: send a release to queue %q: %w", opts.Key, opts.Queue, o.redact(err))
	}
	res.Released = true
	return res, nil
}

// theMessages is "the message" or "the N messages".
func theMessages(n int) string {
	if n == 1 {
		return "the message"
	}
	return fmt.Sprintf("the %d messages", n)
}
