// Package hooks reaches what a *middleware.Retry does not export, for the root
// module's own packages: the 0-9-1 transport (internal/wamqp) and the test harness.
// middleware.New sets each function the first time it runs; r is always a
// *middleware.Retry. A transport of another module builds on the public API:
// middleware.Transport, Retry.Delivered and Retry.Bind.
package hooks

import "github.com/ThreeDotsLabs/watermill/message"

var (
	// CheckWorkQueue refuses queue as a work queue of r when it exists and cannot hold
	// r's retries (with delayed retries, a queue of another type than quorum): the
	// error names the queue and the fix. A queue that does not exist yet passes.
	CheckWorkQueue func(r any, queue string) error
	// DeliveredFor returns r's Delivered for the subscribers whose queues queue names
	// (a queue per handler): r sends the retries of the messages it marks to
	// queue(topic). r remembers each call as long as it lives.
	DeliveredFor func(r any, queue func(topic string) string) func(msg *message.Message, attempt int)
	// Scheduler returns a publisher that parks a message in r's backend until the
	// delay its metadata asks (Watermill's components/delay); nil for a backend that
	// holds only failed deliveries.
	Scheduler func(r any) message.Publisher
)
