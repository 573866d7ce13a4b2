package marshal

import (
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Read once, write once: Unmarshal keeps the typed header values it read (a receipt)
// beside the encoded strings it writes into the metadata, and Marshal publishes a kept
// value, instead of decoding the string again, for as long as the metadata still has
// exactly the string written. The encoding stays the metadata's contract (handlers
// read it); the receipt only spares the decoding.
//
// A receipt is found from the message Unmarshal returned through a table keyed by a
// weak pointer to it, its entry dropped when the message is collected; and from a copy
// of the message (the middleware's, CopyContext) through the copy's context. Whatever
// finds it, a kept value is used only where the metadata string equals the one written
// for it, and the value is what decoding that string gives (fresh): a receipt can
// spare work, never change what is published.

// receipt is what Unmarshal read of a delivery's typed headers. It never changes.
type receipt struct {
	list    string // the keys.TypedHeaders value written
	entries []kept // by key, as in list
}

// kept is one typed header: its key, the encoded string written and the value
// DecodeValue gives for that string.
type kept struct {
	key, enc string
	val      interface{}
}

// find returns the entry of key.
func (r *receipt) find(key string) (kept, bool) {
	i, ok := slices.BinarySearchFunc(r.entries, key, func(e kept, key string) int { return strings.Compare(e.key, key) })
	if !ok {
		return kept{}, false
	}
	return r.entries[i], true
}

// value returns what the metadata string s of the typed header key publishes as, if
// s is the string Unmarshal wrote for it.
func (r *receipt) value(key, s string) (interface{}, bool) {
	if r == nil {
		return nil, false
	}
	e, ok := r.find(key)
	if !ok || e.enc != s {
		return nil, false
	}
	return fresh(e.val), true
}

// receipts maps the messages Unmarshal returned with typed headers
// (weak.Pointer[message.Message]) to their receipts. An entry goes when its message
// is collected (runtime.AddCleanup): the table keeps no message, and a receipt
// refers to none.
var receipts struct {
	m    sync.Map
	live atomic.Int64 // entries in m
}

// keep records r as msg's receipt.
func keep(msg *message.Message, r *receipt) {
	wp := weak.Make(msg)
	receipts.m.Store(wp, r)
	receipts.live.Add(1)
	runtime.AddCleanup(msg, forget, wp)
}

// forget drops the receipt of a collected message.
func forget(wp weak.Pointer[message.Message]) {
	if _, ok := receipts.m.LoadAndDelete(wp); ok {
		receipts.live.Add(-1)
	}
}

// receiptKey is the context key of the receipt a copy carries (CopyContext).
type receiptKey struct{}

// receiptOf returns the receipt of msg: the one its context carries (a copy), else
// the one Unmarshal kept for msg itself. It is asked only of messages with typed
// headers (weak.Make would otherwise give every message a weak handle).
func receiptOf(msg *message.Message) *receipt {
	if r, ok := msg.Context().Value(receiptKey{}).(*receipt); ok {
		return r
	}
	if r, ok := receipts.m.Load(weak.Make(msg)); ok {
		return r.(*receipt)
	}
	return nil
}

// nan32 and nan64 are the NaNs DecodeValue gives (float).
var nan32, nan64 interface{} = func() (interface{}, interface{}) {
	f32, _ := strconv.ParseFloat("NaN", 32)
	f64, _ := strconv.ParseFloat("NaN", 64)
	return float32(f32), f64
}()

// fresh returns what DecodeValue(EncodeValue(v)) returns, without the JSON, for a
// value EncodeValue encodes: the same Go types and bits, in new arrays, tables and byte
// slices (a caller may change them: PostprocessPublishing sees every header).
func fresh(v interface{}) interface{} {
	switch x := v.(type) {
	case float32:
		if x != x {
			return nan32
		}
	case float64:
		if x != x {
			return nan64
		}
	case []byte:
		return append(make([]byte, 0, len(x)), x...) // never nil, as decoded
	case time.Time:
		if t := time.Unix(x.Unix(), 0); t != x {
			return t
		}
	case []interface{}:
		if len(x) == 0 {
			return []interface{}(nil)
		}
		a := make([]interface{}, len(x))
		for i, e := range x {
			a[i] = fresh(e)
		}
		return a
	case amqp.Table:
		t := make(amqp.Table, len(x))
		for k, e := range x {
			t[k] = fresh(e)
		}
		return t
	}
	return v
}
