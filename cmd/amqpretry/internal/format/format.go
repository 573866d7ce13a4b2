// Package format has how the amqpretry command and its console write the figures
// they both show, so that a duration reads the same in a terminal and on the page.
package format

import (
	"fmt"
	"strings"
	"time"

	"github.com/amqpretry/amqpretry/ops"
)

// Duration formats a measured duration (an age, a time until due) briefly:
// milliseconds under a second, tenths under a minute, seconds under a day, then days
// and minutes. A configured one (a TTL, a tier, a delay) is written by Configured.
func Duration(d time.Duration) string {
	switch {
	case d < 0:
		return "-" + Duration(-d)
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	case d < 24*time.Hour:
		return d.Round(time.Second).String()
	}
	return fmt.Sprintf("%dd%s", d/(24*time.Hour), (d % (24 * time.Hour)).Round(time.Minute))
}

// Configured writes a configured duration (a TTL, a tier, a retry's delay) exactly, as
// it was given and as the library spells a ttl-tiers tier in its queue names: 1.25s,
// 250ms, 2m, 1h30m (no rounding, no trailing zero units).
func Configured(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// Delay writes the delay storage in one line: its queues, what waits in them, when the
// next retry is due.
func Delay(d ops.DelaySummary) string {
	line := fmt.Sprintf("delay storage: %d queues", d.Queues)
	if d.Old > 0 {
		line += fmt.Sprintf(" (%d of another backend, old)", d.Old)
	}
	switch {
	case d.Messages == 0 && d.Counted:
		line += ", empty"
	case d.Counted:
		line += fmt.Sprintf(", %d messages waiting", d.Messages)
	default:
		line += fmt.Sprintf(", %d ready (without the broker's counts, not those waiting to be dead-lettered)", d.Messages)
	}
	switch {
	case !d.NextDue.IsZero():
		line += ", next due " + d.NextDue.UTC().Format(time.RFC3339)
		if in := time.Until(d.NextDue); in < 0 {
			line += " (" + Duration(-in) + " overdue)"
		} else {
			line += " (in " + Duration(in) + ")"
		}
	case d.Messages > 0 && !d.WaitingRead:
		line += ", next due unknown (read with rabbitmqctl: --rabbitmqctl)"
	}
	if d.Flagged > 0 {
		line += fmt.Sprintf("; %d flagged, above", d.Flagged)
	}
	return line
}

// PossibleOutage writes, for a work queue in a possible outage (QueueStatus.
// PossibleOutage), what the broker shows and what it does not.
func PossibleOutage(q ops.QueueStatus) string {
	consumers := fmt.Sprintf("%d consumers keep", q.Consumers)
	if q.Consumers == 1 {
		consumers = "its consumer keeps"
	}
	return fmt.Sprintf("POSSIBLE OUTAGE work queue %s: %s %d unacked messages while %d wait ready, and nothing was acked in %s: "+
		"none of the broker's counts (messages, ready, unacked), read twice %s apart, moved (unless exactly as many were published). "+
		"Its application's handlers may fail as if something they depend on is down (an amqpretry outage: its metric amqpretry_in_outage and its log say for sure), "+
		"or take longer than %s a message",
		q.Name, consumers, q.Unacked, q.Ready, Configured(q.Stalled), Configured(q.Stalled), Configured(q.Stalled))
}

// Blocked writes the blocked order keys in one line: how many, the messages waiting
// behind them, and how many have their head in the poison queue.
func Blocked(keys []ops.BlockedKey) string {
	behind, heads := 0, 0
	for _, k := range keys {
		behind += k.Behind
		if k.Head != nil {
			heads++
		}
	}
	return fmt.Sprintf("%d blocked %s, %d %s behind %s, %d poisoned %s", len(keys), plural(len(keys), "key", "keys"),
		behind, plural(behind, "message", "messages"), plural(len(keys), "it", "them"), heads, plural(heads, "head", "heads"))
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// Release writes what a release of a blocked key did (would do, in a dry run), key as
// the caller shows it, poison naming the poison queue.
func Release(r ops.ReleaseResult, key, poison string) string {
	k := r.Key
	did := func(would, done string) string {
		if r.DryRun {
			return would
		}
		return done
	}
	switch {
	case r.Redriven != nil:
		return fmt.Sprintf("the poisoned head %s of key %s %s to queue %s, its attempts reset: once it succeeds, %s",
			messageID(*r.Redriven), key, did("would be redriven", "redriven"), k.Queue, behindRuns(k.Behind))
	case k.Head == nil:
		return fmt.Sprintf("key %s of queue %s %s, forced: %s, before its head (not in the poison queue: its retry waits, or it is gone)",
			key, k.Queue, did("would be released", "released"), behindRuns(k.Behind))
	}
	return fmt.Sprintf("key %s of queue %s %s: %s; its poisoned head %s stays in %s (redriven later, it runs after them)",
		key, k.Queue, did("would be released", "released"), behindRuns(k.Behind), messageID(*k.Head), poison)
}

// behindRuns says what runs behind a key that is released.
func behindRuns(n int) string {
	switch n {
	case 0:
		return "no message waits behind it"
	case 1:
		return "the message behind it runs"
	}
	return fmt.Sprintf("the %d messages behind it run, in order", n)
}

// messageID names m: its Watermill UUID, else its AMQP message id, else "-".
func messageID(m ops.Message) string {
	switch {
	case m.UUID != "":
		return m.UUID
	case m.MessageID != "":
		return m.MessageID
	}
	return "-"
}
