//lint:file-ignore SA1019 the deprecated names are what this test compiles against

package ops_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/ops"
)

// TestDeprecatedAliases: code written against a renamed name still compiles, and the
// old name is the new one (docs/migration.md lists them).
func TestDeprecatedAliases(t *testing.T) {
	var kind ops.FlagKind = ops.FlagParked
	if kind != ops.FlagParkingQueue {
		t.Errorf("FlagParked = %q, want FlagParkingQueue (%q)", kind, ops.FlagParkingQueue)
	}
	// The fields renamed for one word per concept ("backlog" is ready messages
	// waiting; a delay queue's expired messages are Expired).
	opts := ops.StatusOptions{BacklogInterval: time.Second}
	_ = opts
	qs := ops.QueueStatus{Expired: 3, Backlog: 3}
	b, err := json.Marshal(qs)
	if err != nil || !strings.Contains(string(b), `"expired":3`) || !strings.Contains(string(b), `"backlog":3`) {
		t.Errorf("QueueStatus JSON %s (%v): want both expired and, for one release, backlog", b, err)
	}
}
