package amqp1

import (
	"testing"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
)

// TestUUIDKey: the application property of the UUID is watermill-amqp's header, so
// that messages cross between the two transports with their UUID.
func TestUUIDKey(t *testing.T) {
	if uuidKey != wamqp.DefaultMessageUUIDHeaderKey {
		t.Errorf("uuidKey = %q, watermill-amqp uses %q", uuidKey, wamqp.DefaultMessageUUIDHeaderKey)
	}
}
