package delay

import (
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/topology"
)

// Metadata keys a backend writes on every message it parks. Their values are Go
// duration strings (time.Duration.String) and an RFC 3339 time with nanoseconds, UTC.
const (
	// RequestedDelayKey holds the delay that was asked for.
	RequestedDelayKey = "amqpretry-requested-delay"
	// EffectiveDelayKey holds the delay the backend applies (after snapping to a tier,
	// rounding to a level, and so on).
	EffectiveDelayKey = "amqpretry-effective-delay"
	// DueKey holds the time the message is due back: the hand-off time plus the
	// effective delay.
	DueKey = "amqpretry-due"
)

// Backend names, the values of Config.Backend.
const (
	BackendTTLTiers        = "ttl-tiers"
	BackendBinaryLevels    = "binary-levels"
	BackendDelayedExchange = "delayed-exchange"
	BackendMemory          = "memory"
)

// ErrDelayTooLong is returned (wrapped, with the delay and the backend's maximum) by
// Effective and Publish for a delay longer than the backend can hold.
var ErrDelayTooLong = errors.New("delay too long")

// Backend parks messages and brings each back to a queue after its delay.
//
// Publish(queue, msgs...) implements message.Publisher: the topic is the name of the
// queue the message must come back to (and only that queue), and the delay is read from
// Watermill's delay metadata (components/delay: delay.Message(msg, delay.For(d))), so any
// code that holds a message.Publisher can schedule a delayed message. A message without
// delay metadata is delayed by zero, which a backend may round up. Publish writes
// RequestedDelayKey, EffectiveDelayKey and DueKey into each message's metadata and
// returns only once the broker has confirmed that it holds every message.
type Backend interface {
	message.Publisher
	topology.WorkQueueBinder

	// Name is the backend's name, as given in Config.Backend.
	Name() string
	// Topology is what the backend declares on the publishing side (New declares it).
	Topology() topology.Topology
	// Effective returns the delay the backend applies for a requested one, or an error
	// (wrapping ErrDelayTooLong for a delay past its maximum) if it cannot honour it.
	Effective(requested time.Duration) (time.Duration, error)
}

// Requested returns the delay msg asks for through Watermill's delay metadata:
// delay.DelayedForKey if set, else the time left until delay.DelayedUntilKey. A message
// without either asks for no delay; a time in the past gives zero.
func Requested(msg *message.Message) (time.Duration, error) {
	if v := msg.Metadata.Get(delay.DelayedForKey); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			return 0, fmt.Errorf("message %s: metadata %s: %w", msg.UUID, delay.DelayedForKey, err)
		}
		return max(d, 0), nil
	}
	if v := msg.Metadata.Get(delay.DelayedUntilKey); v != "" {
		t, err := time.Parse(time.RFC3339, v)
		if err != nil {
			return 0, fmt.Errorf("message %s: metadata %s: %w", msg.UUID, delay.DelayedUntilKey, err)
		}
		return max(time.Until(t), 0), nil
	}
	return 0, nil
}

// stamp records the requested and effective delay and the due time on msg, and removes
// Watermill's delay keys: from here on our keys describe the delay.
func stamp(msg *message.Message, requested, effective time.Duration, now time.Time) {
	msg.Metadata.Set(RequestedDelayKey, requested.String())
	msg.Metadata.Set(EffectiveDelayKey, effective.String())
	msg.Metadata.Set(DueKey, now.Add(effective).UTC().Format(time.RFC3339Nano))
	delete(msg.Metadata, delay.DelayedForKey)
	delete(msg.Metadata, delay.DelayedUntilKey)
}

// schedule is the part of Publish every backend shares: for each message it reads the
// requested delay, asks b for the effective one, stamps the message and parks it.
func schedule(b Backend, queue string, msgs []*message.Message, park func(msg *message.Message, requested, effective time.Duration) error) error {
	if queue == "" {
		return fmt.Errorf("%s: empty destination queue", b.Name())
	}
	for _, msg := range msgs {
		requested, err := Requested(msg)
		if err != nil {
			return err
		}
		effective, err := b.Effective(requested)
		if err != nil {
			return fmt.Errorf("message %s for queue %q: %w", msg.UUID, queue, err)
		}
		stamp(msg, requested, effective, time.Now())
		if err := park(msg, requested, effective); err != nil {
			return fmt.Errorf("park message %s for queue %q (%s backend): %w", msg.UUID, queue, b.Name(), err)
		}
	}
	return nil
}

// Due returns the due time a backend wrote on msg (DueKey).
func Due(msg *message.Message) (time.Time, error) {
	v := msg.Metadata.Get(DueKey)
	if v == "" {
		return time.Time{}, fmt.Errorf("message %s: no %s metadata", msg.UUID, DueKey)
	}
	return time.Parse(time.RFC3339Nano, v)
}
