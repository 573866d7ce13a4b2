package ops_test

import (
	"testing"

	"github.com/amqpretry/amqpretry/ops"
)

// TestDeprecatedAliases: code written against a renamed name still compiles, and the
// old name is the new one (docs/migration.md lists them).
func TestDeprecatedAliases(t *testing.T) {
	var kind ops.FlagKind = ops.FlagParked
	if kind != ops.FlagParkingQueue {
		t.Errorf("FlagParked = %q, want FlagParkingQueue (%q)", kind, ops.FlagParkingQueue)
	}
}
