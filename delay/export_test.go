package delay

import (
	"context"

	amqp "github.com/rabbitmq/amqp091-go"
)

// PublishRaw lets the tests publish a raw publishing through the hand-off, to check
// the properties it enforces.
func PublishRaw(ctx context.Context, h *Handoff, exchange, key string, p amqp.Publishing) error {
	return h.publish(ctx, exchange, key, p, true)
}
