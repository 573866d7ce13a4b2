package main

import (
	"time"

	"github.com/amqpretry/amqpretry/ops"
)

// messageJSON is an ops.Message with snake_case keys throughout (the envelope's fields
// carry no JSON tags of their own).
type messageJSON struct {
	UUID               string            `json:"uuid"`
	MessageID          string            `json:"message_id,omitempty"`
	Queue              string            `json:"queue"`
	RoutingKey         string            `json:"routing_key"`
	Reason             string            `json:"reason,omitempty"`
	Error              string            `json:"error,omitempty"`
	ErrorTypes         []string          `json:"error_types,omitempty"`
	Attempt            int               `json:"attempt,omitempty"`
	MaxAttempts        int               `json:"max_attempts,omitempty"`
	FirstFailure       time.Time         `json:"first_failure,omitzero"`
	LastFailure        time.Time         `json:"last_failure,omitzero"`
	Handler            string            `json:"handler,omitempty"`
	Topic              string            `json:"topic,omitempty"`
	OriginalExchange   string            `json:"original_exchange,omitempty"`
	OriginalRoutingKey string            `json:"original_routing_key,omitempty"`
	RequestedDelay     time.Duration     `json:"requested_delay_ns,omitempty"`
	EffectiveDelay     time.Duration     `json:"effective_delay_ns,omitempty"`
	Due                time.Time         `json:"due,omitzero"`
	DroppedHeaders     string            `json:"dropped_headers,omitempty"`
	RedrivenAt         time.Time         `json:"redriven_at,omitzero"`
	Redriven           int               `json:"redriven,omitempty"`
	RedrivenFrom       string            `json:"redriven_from,omitempty"`
	Time               time.Time         `json:"time,omitzero"`
	Size               int               `json:"size"`
	Metadata           map[string]string `json:"metadata,omitempty"`
	Payload            []byte            `json:"payload,omitempty"`
}

func messageJSONOf(m ops.Message) messageJSON {
	return messageJSON{
		UUID: m.UUID, MessageID: m.MessageID, Queue: m.Queue, RoutingKey: m.RoutingKey, Reason: string(m.Reason),
		Error: m.Error, ErrorTypes: m.ErrorTypes, Attempt: m.Attempt, MaxAttempts: m.MaxAttempts,
		FirstFailure: m.FirstFailure, LastFailure: m.LastFailure, Handler: m.Handler, Topic: m.Topic,
		OriginalExchange: m.OriginalExchange, OriginalRoutingKey: m.OriginalRoutingKey,
		RequestedDelay: m.RequestedDelay, EffectiveDelay: m.EffectiveDelay, Due: m.Due, DroppedHeaders: m.DroppedHeaders,
		RedrivenAt: m.RedrivenAt, Redriven: m.Redriven, RedrivenFrom: m.RedrivenFrom,
		Time: m.Time, Size: m.Size, Metadata: m.Metadata, Payload: m.Payload,
	}
}

func messagesJSON(ms []ops.Message) []messageJSON {
	out := make([]messageJSON, len(ms))
	for i, m := range ms {
		out[i] = messageJSONOf(m)
	}
	return out
}

type listJSON struct {
	Queue    string        `json:"queue"`
	Depth    int           `json:"depth"`
	Scanned  int           `json:"scanned"`
	Complete bool          `json:"complete"`
	Messages []messageJSON `json:"messages"`
}

func listJSONOf(r ops.ListResult) listJSON {
	return listJSON{Queue: r.Queue, Depth: r.Depth, Scanned: r.Scanned, Complete: r.Complete, Messages: messagesJSON(r.Messages)}
}

type moveJSON struct {
	Queue      string        `json:"queue"`
	Depth      int           `json:"depth"`
	Scanned    int           `json:"scanned"`
	Matched    int           `json:"matched"`
	Done       int           `json:"done"`
	Skipped    int           `json:"skipped"`
	Unroutable int           `json:"unroutable"`
	DryRun     bool          `json:"dry_run"`
	Stopped    string        `json:"stopped,omitempty"`
	Messages   []messageJSON `json:"messages"`
	Unrouted   []messageJSON `json:"unrouted"`
}

func moveJSONOf(r ops.MoveResult) moveJSON {
	return moveJSON{
		Queue: r.Queue, Depth: r.Depth, Scanned: r.Scanned, Matched: r.Matched, Done: r.Done, Skipped: r.Skipped,
		Unroutable: r.Unroutable, DryRun: r.DryRun, Stopped: r.Stopped,
		Messages: messagesJSON(r.Messages), Unrouted: messagesJSON(r.Unrouted),
	}
}
