// Package topology is what the library needs on the broker, as data, and how it gets
// there: the exchanges, queues and bindings of a delay backend and of each work
// queue's way back (Topology), the topology modes (Mode), Topology.Apply, which
// declares a topology, verifies it without declaring (least privilege) or leaves it
// alone, as the mode says (apply.go), and Topology.Check, which reports on each
// declaration without creating any (Finding, check.go). Import it to set
// amqpretry.Config.Topology, to read, apply or check amqpretry.Config.Plan, or to match
// ErrMissing and ErrMismatch.
//
// Plan a topology without a broker with amqpretry.Config.Plan, and apply it with
// Apply, or with the amqpretry command (`amqpretry topology plan|apply|verify`);
// ops.Ops.Verify checks a configuration's plan with Check.
//
//	plan, err := cfg.Plan("orders")
//	if err != nil { ... }
//	err = plan.Apply(ch, topology.ModeDeclare) // an administrator's channel
//	findings, err := plan.Check(conn, false)   // what exists, what differs
package topology
