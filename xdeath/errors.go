package xdeath

import "github.com/amqpretry/amqpretry/internal/wire"

// ErrMalformed is wrapped by every error caused by a header or metadata value that does
// not have the expected shape: an x-death field of the wrong type, or an encoded
// metadata value that cannot be decoded.
var ErrMalformed = wire.ErrMalformed
