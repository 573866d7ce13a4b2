// Package topology describes, as data, what the library needs on the broker: the
// exchanges, queues and bindings of a delay backend and of each work queue's way back,
// the topology modes, and what a check of them finds. Import it to set
// amqpretry.Config.Topology (least privilege), to read amqpretry.Config.Plan, or to
// match ErrMissing and ErrMismatch.
//
// Plan a topology without a broker with amqpretry.Config.Plan; the amqpretry command
// (`amqpretry topology plan|apply|verify`) and package ops apply and check it.
package topology
