package brokertest

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ReadableDepth is the deepest nesting of header tables and arrays amqp091-go
// v1.16.0 reads (its maxFieldDepth): a delivery with a deeper header makes it close
// the whole connection (501 FRAME_ERROR, "invalid field or value inside of a
// frame"). Older versions read any depth.
const ReadableDepth = 32

// DialFlattening connects to the test broker (a plain amqp:// AMQP_URI) like Dial,
// but reads what any amqp091-go version can read: a header table or array nested
// deeper than ReadableDepth arrives as a byte array ([]byte) with its AMQP
// encoding, the rest of the headers as they are. It is how a test reads a delivery
// the client it is built with cannot (x-death, the UUID). The rewrite keeps every
// frame's size: only the value's type tag changes ('F' or 'A' to 'x', all three
// a 32-bit length and that many bytes).
func DialFlattening(t testing.TB) *amqp.Connection {
	t.Helper()
	Dial(t) // skips the test, or fails it under CI=true, when no broker answers
	conn, err := amqp.DialConfig(URI(), amqp.Config{Dial: func(network, addr string) (net.Conn, error) {
		c, err := net.DialTimeout(network, addr, 30*time.Second)
		if err != nil {
			return nil, err
		}
		return &flattening{Conn: c}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// ClientReads tells whether the amqp091-go this test is built with reads a delivery
// with headers h: it publishes one to a queue of its own and takes it back with
// basic.get. A client that cannot read it loses its connection.
func ClientReads(t testing.TB, h amqp.Table) bool {
	t.Helper()
	conn := Dial(t)
	q := Prefix(t) + ".readable"
	Cleanup(t, []string{q}, nil)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(q, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", q, true, false, amqp.Publishing{Headers: h})
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := dc.WaitContext(context.Background()); !ok || err != nil {
		t.Fatalf("publish to %s not confirmed: %v", q, err)
	}
	reader, err := amqp.Dial(URI())
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	rch, err := reader.Channel()
	if err != nil {
		t.Fatal(err)
	}
	_, ok, err := rch.Get(q, true)
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) && (amqpErr.Code == amqp.FrameError || amqpErr.Code == amqp.SyntaxError) {
		return false
	}
	if err != nil || !ok {
		t.Fatalf("basic.get from %s: got %v, %v", q, ok, err)
	}
	return true
}

// flattening is a connection whose incoming content header frames have header values
// nested deeper than ReadableDepth retagged as byte arrays. It reads whole frames.
type flattening struct {
	net.Conn
	buf     []byte // what was read and rewritten, not yet returned
	started bool
}

func (f *flattening) Read(p []byte) (int, error) {
	if len(f.buf) == 0 {
		if err := f.fill(); err != nil {
			return 0, err
		}
	}
	n := copy(p, f.buf)
	f.buf = f.buf[n:]
	return n, nil
}

// fill reads the next frame (or, first, a protocol header the broker may send
// instead of one) and rewrites it.
func (f *flattening) fill() error {
	head := make([]byte, 7)
	if _, err := io.ReadFull(f.Conn, head); err != nil {
		return err
	}
	if !f.started && string(head[:4]) == "AMQP" { // the broker refuses our protocol version
		f.buf = head
		return nil
	}
	f.started = true
	size := binary.BigEndian.Uint32(head[3:7])
	frame := make([]byte, 7+int(size)+1)
	copy(frame, head)
	if _, err := io.ReadFull(f.Conn, frame[7:]); err != nil {
		return err
	}
	if head[0] == 2 { // a content header frame
		flattenProperties(frame[7 : 7+size])
	}
	f.buf = frame
	return nil
}

// flattenProperties retags the too-deep values of the headers property of a content
// header payload: class and weight (2+2), body size (8), property flags (2), then
// content-type and content-encoding (short strings) before headers (a table).
func flattenProperties(b []byte) {
	if len(b) < 14 {
		return
	}
	flags := binary.BigEndian.Uint16(b[12:14])
	if flags&0x2000 == 0 || flags&1 != 0 { // no headers, or more flag words (never sent)
		return
	}
	i := 14
	for _, bit := range []uint16{0x8000, 0x4000} {
		if flags&bit != 0 {
			if i >= len(b) {
				return
			}
			i += 1 + int(b[i])
		}
	}
	if i+4 > len(b) {
		return
	}
	n := int(binary.BigEndian.Uint32(b[i:]))
	if i+4+n > len(b) {
		return
	}
	flattenTable(b[i+4:i+4+n], 0)
}

// flattenTable walks the entries of a table's content at depth (0: the headers).
func flattenTable(b []byte, depth int) {
	for i := 0; i < len(b); {
		i += 1 + int(b[i]) // the name
		if i >= len(b) {
			return
		}
		i = flattenValue(b, i, depth)
	}
}

// flattenArray walks the values of an array's content at depth.
func flattenArray(b []byte, depth int) {
	for i := 0; i < len(b); {
		i = flattenValue(b, i, depth)
	}
}

// flattenValue handles the value whose type tag is at b[i], inside a table or array
// at depth, and returns the index past it (len(b) if malformed).
func flattenValue(b []byte, i, depth int) int {
	fixed := map[byte]int{'t': 1, 'b': 1, 'B': 1, 's': 2, 'u': 2, 'I': 4, 'i': 4, 'f': 4, 'l': 8, 'd': 8, 'T': 8, 'D': 5, 'V': 0}
	tag := b[i]
	i++
	if n, ok := fixed[tag]; ok {
		return i + n
	}
	if i+4 > len(b) {
		return len(b)
	}
	n := int(binary.BigEndian.Uint32(b[i:]))
	end := i + 4 + n
	if end > len(b) {
		return len(b)
	}
	switch {
	case (tag == 'F' || tag == 'A') && depth+1 > ReadableDepth:
		b[i-1] = 'x'
	case tag == 'F':
		flattenTable(b[i+4:end], depth+1)
	case tag == 'A':
		flattenArray(b[i+4:end], depth+1)
	}
	return end
}
