package amqp1

import (
	"math"
	"strings"
	"testing"

	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/wire"
)

// TestCopiesOfTheLibrary pins what this module copies from the library's internal
// packages, which it cannot import: the queue argument names, the envelope's key
// prefix, and the integer reader.
func TestCopiesOfTheLibrary(t *testing.T) {
	if deliveryLimitArg != declare.DeliveryLimitArg || queueTypeArg != declare.QueueTypeArg {
		t.Errorf("queue arguments %q %q, the library's %q %q", deliveryLimitArg, queueTypeArg, declare.DeliveryLimitArg, declare.QueueTypeArg)
	}
	for _, k := range []string{keys.Attempt, keys.Error, keys.FirstFailure, keys.Due, keys.RedrivenFrom} {
		if !strings.HasPrefix("x-opt-"+k, envelopeAnnotation) {
			t.Errorf("envelope key %q does not start with the prefix this module reads, %q", k, strings.TrimPrefix(envelopeAnnotation, "x-opt-"))
		}
	}
	for _, v := range []any{int8(-3), int16(300), int32(-70000), int64(math.MinInt64), int(42), uint8(255), uint16(65535), uint32(math.MaxUint32),
		uint64(math.MaxInt64), uint64(math.MaxInt64 + 1), uint(7), "12", 1.5, nil, true} {
		n, ok := integer(v)
		wn, wok := wire.Integer(v)
		if n != wn || ok != wok {
			t.Errorf("integer(%T %v) = %d, %t; wire.Integer gives %d, %t", v, v, n, ok, wn, wok)
		}
	}
}
