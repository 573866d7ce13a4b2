package xdeath

import (
	"errors"
	"fmt"
)

var (
	// ErrMalformed is wrapped by every error caused by a header or metadata
	// value that does not have the expected shape: an x-death field of the
	// wrong type, or an encoded metadata value that cannot be decoded.
	ErrMalformed = errors.New("malformed value")

	// ErrUnsupported is wrapped by every error caused by a value that cannot
	// be encoded into metadata: a Go type the AMQP table codec does not know,
	// a table key that is not valid UTF-8, or nesting deeper than MaxDepth.
	ErrUnsupported = errors.New("unsupported value")
)

// pathError wraps sentinel with the location of the offending value, for
// example "malformed value: x-death[1].count: want integer, got string".
func pathError(sentinel error, path, format string, args ...interface{}) error {
	msg := fmt.Sprintf(format, args...)
	if path == "" {
		return fmt.Errorf("%w: %s", sentinel, msg)
	}
	return fmt.Errorf("%w: %s: %s", sentinel, path, msg)
}
