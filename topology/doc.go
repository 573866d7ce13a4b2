// Package topology is what the library needs on the broker, as data, and how it gets
// there: the exchanges, queues and bindings of a delay backend and of each work
// queue's way back (Topology), the topology modes (Mode), and Topology.Apply, which
// declares a topology, verifies it without declaring (least privilege) or leaves it
// alone, as the mode says (apply.go). Import it to set amqpretry.Config.Topology, to
// read or apply amqpretry.Config.Plan, or to match ErrMissing and ErrMismatch.
//
// Plan a topology without a broker with amqpretry.Config.Plan, and apply it with
// Apply, or with the amqpretry command (`amqpretry topology plan|apply|verify`).
// ops.Ops.Verify reports on each declaration of a plan without creating any
// (ops.Finding).
//
//	plan, err := cfg.Plan("orders")
//	if err != nil { ... }
//	err = plan.Apply(ch, topology.ModeDeclare) // an administrator's channel
package topology
