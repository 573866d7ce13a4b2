package ops

import (
	"slices"
	"time"
)

// Overview is a Status in the order a person reads it, decided here once for every
// view of it (the amqpretry command's status and its console): first what may need a
// person, then one line on the delay storage, its queues last, shown on demand.
type Overview struct {
	// First: the poison queue and the parking queue (their counts, whatever they are),
	// then the work queues whose consumers keep deliveries without acking
	// (QueueStatus.PossibleOutage), the work queues with a backlog and no consumer
	// (QueueStatus.Unconsumed), then every other queue Status flags; each in the order
	// of Status.Queues.
	First []QueueStatus
	// Work: the other work queues.
	Work []QueueStatus
	// Delay sums up every delay queue, those in First too.
	Delay DelaySummary
	// DelayQueues: the delay queues not in First (not flagged).
	DelayQueues []QueueStatus
}

// DelaySummary is the delay storage in one line: its queues and what waits in them.
type DelaySummary struct {
	// Queues counts the delay queues; Old, of them, those of another backend
	// (QueueStatus.Old); Flagged, those Status flags (they are in Overview.First).
	Queues, Old, Flagged int
	// Messages in them: the ready ones, or the most that the broker's counts
	// (QueueStatus.Messages, which lag a few seconds) or the waiting retries read
	// show. With the broker's counts (Counted: every delay queue was counted), the
	// expired ones waiting to be dead-lettered are included.
	Messages int
	Counted  bool
	// NextDue is the earliest due time of the retries read in them (WaitingRead: with
	// Config.Rabbitmqctl, as QueueStatus.Waiting), zero when none waits or none was read.
	WaitingRead bool
	NextDue     time.Time
}

// Unconsumed tells a work queue with a backlog and no consumer: ready messages that
// nothing takes.
func (q QueueStatus) Unconsumed() bool {
	return q.Role == "work" && q.Exists && q.Ready > 0 && q.Consumers == 0
}

// Overview arranges s in the order to read it.
func (s Status) Overview() Overview {
	flagged := func(q QueueStatus) bool {
		return slices.ContainsFunc(s.Flags, func(f Flag) bool { return f.Name == q.Name && f.Role == q.Role })
	}
	var ov Overview
	taken := make([]bool, len(s.Queues))
	for _, first := range []func(QueueStatus) bool{
		func(q QueueStatus) bool { return q.Role == "poison" },
		func(q QueueStatus) bool { return q.Role == "parking" },
		QueueStatus.PossibleOutage,
		QueueStatus.Unconsumed,
		flagged,
	} {
		for i, q := range s.Queues {
			if !taken[i] && first(q) {
				taken[i] = true
				ov.First = append(ov.First, q)
			}
		}
	}
	d := DelaySummary{Counted: true, WaitingRead: true}
	for i, q := range s.Queues {
		if q.Role == "delay" {
			d.Queues++
			if q.Old {
				d.Old++
			}
			if flagged(q) {
				d.Flagged++
			}
			d.Counted = d.Counted && q.Counted
			d.WaitingRead = d.WaitingRead && q.WaitingRead
			// The broker's counts lag (a few seconds): the most any reading shows.
			d.Messages += max(q.Ready, q.Messages, q.Waiting)
			if q.Waiting > 0 && (d.NextDue.IsZero() || q.NextDue.Before(d.NextDue)) {
				d.NextDue = q.NextDue
			}
		}
		switch {
		case taken[i]:
		case q.Role == "delay":
			ov.DelayQueues = append(ov.DelayQueues, q)
		default:
			ov.Work = append(ov.Work, q)
		}
	}
	if d.Queues == 0 {
		d.Counted, d.WaitingRead = false, false
	}
	ov.Delay = d
	return ov
}
