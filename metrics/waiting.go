package metrics

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/amqpretry/amqpretry/ops"
)

// RefreshWaiting sets, for each of workQueues, the retries that wait to come back to it
// (amqpretry_work_queue_waiting_retries) and the due time of the first of them
// (amqpretry_next_retry_due_timestamp_seconds, Unix seconds; removed when none waits),
// as o lists them (ops.Waiting): in the delay queues under the prefix, of any backend,
// and in RabbitMQ 4.3's delayed retry. o needs ops.Config.Rabbitmqctl: the listing
// reads the queues with rabbitmqctl eval, which changes nothing, and takes seconds per
// call: refresh every minute or so, not every scrape. A queue that cannot be read is
// left as it was, and the error names it.
func (m *Metrics) RefreshWaiting(ctx context.Context, o *ops.Ops, workQueues ...string) error {
	var errs []error
	for _, q := range workQueues {
		res, err := o.List(ctx, ops.Waiting, ops.ListOptions{Filter: ops.Filter{Queue: q}, Limit: -1})
		if err != nil {
			errs = append(errs, fmt.Errorf("metrics: waiting retries of queue %q: %w", q, err))
			continue
		}
		m.workWaiting.WithLabelValues(q).Set(float64(len(res.Messages)))
		var next time.Time
		for _, msg := range res.Messages {
			due := msg.Due
			if due.IsZero() {
				due = msg.Release
			}
			if !due.IsZero() && (next.IsZero() || due.Before(next)) {
				next = due
			}
		}
		if next.IsZero() {
			m.nextDue.DeleteLabelValues(q)
			continue
		}
		m.nextDue.WithLabelValues(q).Set(float64(next.UnixMilli()) / 1000)
	}
	return errors.Join(errs...)
}
