package xdeath

import (
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/marshal"
)

// Header returns the AMQP header key from metadata produced by Marshaler.Unmarshal,
// decoded to its original type: an int64 for x-delivery-count, an []interface{} of
// amqp.Table for x-death. ok is false if the header is absent. An error wraps
// ErrMalformed.
func Header(md message.Metadata, key string) (value interface{}, ok bool, err error) {
	typed, err := marshal.TypedKeys(md)
	if err != nil {
		return nil, false, err
	}
	return marshal.Header(md, typed, key)
}
