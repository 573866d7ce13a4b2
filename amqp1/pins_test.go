package amqp1

import (
	"testing"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/amqpretry/amqpretry/internal/version"
)

// TestPinnedFacts: the facts this module keeps a copy of, so that it builds on the
// library's public API alone, equal their homes. The UUID's application property is
// watermill-amqp's header, so that messages cross between the two transports with
// their UUID; the default delivery limit is the library's (which the broker's own
// behaviour pins in TestRedeliverDeliveryLimit).
func TestPinnedFacts(t *testing.T) {
	if uuidKey != wamqp.DefaultMessageUUIDHeaderKey {
		t.Errorf("uuidKey = %q, watermill-amqp uses %q", uuidKey, wamqp.DefaultMessageUUIDHeaderKey)
	}
	if defaultDeliveryLimit != version.DeliveryLimit {
		t.Errorf("defaultDeliveryLimit = %d, the library's version.DeliveryLimit = %d", defaultDeliveryLimit, version.DeliveryLimit)
	}
}
