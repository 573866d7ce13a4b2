package xdeath

import (
	"encoding/json"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

const (
	// TypedHeadersKey is the metadata key under which Marshaler.Unmarshal
	// lists, as a sorted JSON array of strings, the metadata keys whose values
	// are encoded non-string AMQP header values (see EncodeValue). Metadata
	// keys not in the list are plain strings, even if they look like JSON.
	TypedHeadersKey = "amqpretry-typed-headers"

	// MaxDepth is the deepest nesting of arrays and tables that EncodeValue
	// and DecodeValue accept. It bounds recursion on hostile input.
	MaxDepth = 64
)

// HeadersFromMetadata returns the AMQP headers that metadata produced by
// Marshaler.Unmarshal stands for: typed values are decoded, other values are
// strings, and the metadata keys this package reserves for itself
// (TypedHeadersKey, DeliveryExchangeKey, DeliveryRoutingKeyKey) are left out.
// Broker-owned headers are kept; see IsBrokerOwned.
func HeadersFromMetadata(md message.Metadata) (amqp.Table, error) {
	return decodeHeaders(md, isReserved)
}

// Header returns the AMQP header key from metadata produced by
// Marshaler.Unmarshal, decoded to its original type; for example an int64
// for HeaderDeliveryCount. ok is false if the header is absent.
func Header(md message.Metadata, key string) (value interface{}, ok bool, err error) {
	typed, err := typedKeys(md)
	if err != nil {
		return nil, false, err
	}
	return lookup(md, typed, key)
}

// isReserved reports whether key is a metadata key of this package rather
// than an AMQP header.
func isReserved(key string) bool {
	switch key {
	case TypedHeadersKey, DeliveryExchangeKey, DeliveryRoutingKeyKey, SubscriberKey, RawHeadersKey:
		return true
	}
	return false
}

// typedKeys parses the TypedHeadersKey list of md.
func typedKeys(md message.Metadata) (map[string]bool, error) {
	s, ok := md[TypedHeadersKey]
	if !ok {
		return nil, nil
	}
	var keys []string
	if err := json.Unmarshal([]byte(s), &keys); err != nil {
		return nil, pathError(ErrMalformed, TypedHeadersKey, "want JSON array of strings: %v", err)
	}
	typed := make(map[string]bool, len(keys))
	for _, k := range keys {
		typed[k] = !isReserved(k)
	}
	return typed, nil
}

func lookup(md message.Metadata, typed map[string]bool, key string) (interface{}, bool, error) {
	s, ok := md[key]
	if !ok {
		return nil, false, nil
	}
	if !typed[key] {
		return s, true, nil
	}
	v, err := decode([]byte(s), key, 0)
	if err != nil {
		return nil, false, err
	}
	return v, true, nil
}

// decodeHeaders is HeadersFromMetadata leaving out every key skip reports.
func decodeHeaders(md message.Metadata, skip func(string) bool) (amqp.Table, error) {
	typed, err := typedKeys(md)
	if err != nil {
		return nil, err
	}
	headers := make(amqp.Table, len(md))
	for k := range md {
		if skip(k) {
			continue
		}
		if headers[k], _, err = lookup(md, typed, k); err != nil {
			return nil, err
		}
	}
	return headers, nil
}
