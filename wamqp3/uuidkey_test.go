package wamqp3_test

import (
	"testing"

	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/amqpretry/amqpretry/internal/marshal"
)

// TestUUIDKey: the library's default UUID header is watermill-amqp v3's own, the home
// of that fact (internal/marshal cannot import a major: a v2 program would compile it).
func TestUUIDKey(t *testing.T) {
	if marshal.DefaultUUIDKey != amqp.DefaultMessageUUIDHeaderKey {
		t.Errorf("marshal.DefaultUUIDKey = %q, watermill-amqp v3 uses %q", marshal.DefaultUUIDKey, amqp.DefaultMessageUUIDHeaderKey)
	}
}
