package handoff

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/topology"
)

// dialTest connects a hand-off to the test broker (or skips, see brokertest.Dial), closed
// when the test ends.
func dialTest(t *testing.T, cfg backend.HandoffConfig) *publisher {
	t.Helper()
	brokertest.Dial(t)
	cfg.URI = brokertest.URI()
	h, err := dial(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	return h
}

// withQueue dials a Handoff and declares a classic queue for it, deleted at the end.
func withQueue(t *testing.T) (*publisher, string) {
	t.Helper()
	h := dialTest(t, backend.HandoffConfig{})
	q := brokertest.Prefix(t) + ".q"
	brokertest.Cleanup(t, []string{q}, nil)
	if err := h.Ensure(topology.ModeDeclare, topology.Topology{Queues: []topology.Queue{{Name: q}}}); err != nil {
		t.Fatal(err)
	}
	return h, q
}

func TestHandoffFailuresAreReportedAndRecovered(t *testing.T) {
	h, q := withQueue(t)
	ctx := context.Background()
	msg := func() *message.Message { return message.NewMessage("m", []byte("body")) }

	// Unroutable: the broker returns the mandatory publish before it acks it.
	err := h.Publish(ctx, "", q+".nowhere", msg(), nil, true, nil)
	if !errors.Is(err, backend.ErrReturned) || !strings.Contains(err.Error(), "312 NO_ROUTE") || backend.Cause(err) != "returned" {
		t.Fatalf("publish to a missing queue: %v (cause %s), want backend.ErrReturned", err, backend.Cause(err))
	}
	// A missing exchange makes the broker close the channel: no confirm ever comes.
	err = h.Publish(ctx, q+".no-such-exchange", q, msg(), nil, true, nil)
	if !errors.Is(err, backend.ErrNotConfirmed) || !amqperr.IsCode(err, amqp.NotFound) || backend.Cause(err) != "connection" {
		t.Fatalf("publish to a missing exchange: %v (cause %s), want backend.ErrNotConfirmed with the 404", err, backend.Cause(err))
	}
	// The next publish opens a new channel and goes through.
	if err := h.Publish(ctx, "", q, msg(), nil, true, nil); err != nil {
		t.Fatalf("publish after a closed channel: %v", err)
	}
	// So does one after the connection closed.
	conn, err := h.Connection()
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.Close()
	if err := h.Publish(ctx, "", q, msg(), nil, true, nil); err != nil {
		t.Fatalf("publish after a closed connection: %v", err)
	}
	if n := brokertest.QueueLength(t, q); n != 2 {
		t.Fatalf("queue %s has %d messages, want exactly the 2 confirmed ones", q, n)
	}
}

func TestHandoffPublishesSafeCopies(t *testing.T) {
	h, q := withQueue(t)
	ctx := context.Background()
	const n = 50
	var wg sync.WaitGroup
	errs := make(chan error, 2*n)
	for range n { // concurrent publishes share the confirm channel
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := message.NewMessage("same-uuid", []byte("body"))
			m.Metadata.Set("x-death", "stale")
			m.Metadata.Set("user-key", "kept")
			before := maps.Clone(m.Metadata)
			errs <- h.publish(ctx, "", q, amqp.Publishing{Body: m.Payload, Expiration: "60000", DeliveryMode: amqp.Transient, MessageId: "fixed"}, true)
			errs <- h.Publish(ctx, "", q, m, amqp.Table{"added": int32(1)}, true, nil)
			if !maps.Equal(m.Metadata, before) {
				errs <- fmt.Errorf("Publish modified the message: %v", m.Metadata)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	fromMessages := 0
	for range 2 * n {
		d, ok, err := ch.Get(q, true)
		if err != nil || !ok {
			t.Fatalf("get: ok=%v err=%v", ok, err)
		}
		if d.DeliveryMode != amqp.Persistent || d.Expiration != "" || d.MessageId == "" || d.MessageId == "fixed" || ids[d.MessageId] {
			t.Fatalf("unsafe copy: mode=%d expiration=%q id=%q (seen before: %v)", d.DeliveryMode, d.Expiration, d.MessageId, ids[d.MessageId])
		}
		ids[d.MessageId] = true
		if _, ok := d.Headers["x-death"]; ok {
			t.Errorf("broker-owned header x-death was sent back")
		}
		if uuid, ok := d.Headers["_watermill_message_uuid"]; ok { // published from the message
			fromMessages++
			if uuid != "same-uuid" || d.Headers["user-key"] != "kept" || d.Headers["added"] != int32(1) {
				t.Errorf("headers lost: %v", d.Headers)
			}
		}
	}
	if fromMessages != n {
		t.Errorf("%d copies of the message, want %d", fromMessages, n)
	}
}

// TestHandoffMarshalsWithTheSubscribersOptions: the copy carries the UUID in the
// header the subscriber reads it from.
func TestHandoffMarshalsWithTheSubscribersOptions(t *testing.T) {
	h := dialTest(t, backend.HandoffConfig{})
	h.cfg.Marshal.MessageUUIDHeaderKey = "id"
	q := brokertest.Prefix(t) + ".q"
	brokertest.Cleanup(t, []string{q}, nil)
	if err := h.ToQueue(context.Background(), q, message.NewMessage("u-1", nil)); err != nil {
		t.Fatal(err)
	}
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	d, ok, err := ch.Get(q, true)
	if err != nil || !ok || d.Headers["id"] != "u-1" {
		t.Fatalf("get: %v %v, headers %v", ok, err, d.Headers)
	}
	if _, ok := d.Headers["_watermill_message_uuid"]; ok {
		t.Errorf("UUID in the default header too: %v", d.Headers)
	}
}

// TestFrameMax: a publish whose header frame would not fit the negotiated frame_max is
// refused before it is sent (the broker would close the whole connection); the largest
// one the check lets through is accepted by the broker.
func TestFrameMax(t *testing.T) {
	h, q := withQueue(t)
	ctx := context.Background()
	pc, err := h.channel()
	if err != nil {
		t.Fatal(err)
	}
	frameMax := pc.frameMax
	if frameMax <= 0 {
		t.Fatalf("negotiated frame_max %d", frameMax)
	}
	publishing := func(n int) amqp.Publishing {
		return amqp.Publishing{Headers: amqp.Table{"big": strings.Repeat("x", n)}, ContentType: "text/plain"}
	}
	// The largest header value that fits, as publish sends it (a 26-byte MessageId).
	fits := func(n int) bool {
		p := publishing(n)
		p.MessageId = strings.Repeat("0", 26)
		return fitsFrame(p, frameMax) == nil
	}
	lo, hi := 0, frameMax
	for lo < hi {
		mid := (lo + hi + 1) / 2
		if fits(mid) {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	if lo < frameMax-200 {
		t.Fatalf("largest header value that fits: %d bytes of frame_max %d: the check is too strict", lo, frameMax)
	}
	if err := h.publish(ctx, "", q, publishing(lo), true); err != nil {
		t.Fatalf("the largest publish the check allows (%d bytes): %v", lo, err)
	}
	err = h.publish(ctx, "", q, publishing(lo+1), true)
	if !errors.Is(err, backend.ErrTooLarge) || backend.Cause(err) != "too-large" || !strings.Contains(err.Error(), fmt.Sprintf("over frame_max %d", frameMax)) {
		t.Fatalf("one byte more: %v (cause %s), want backend.ErrTooLarge naming frame_max", err, backend.Cause(err))
	}
	msg := message.NewMessage("huge", nil)
	msg.Metadata.Set("huge", strings.Repeat("h", 2*frameMax))
	if err := h.Publish(ctx, "", q, msg, nil, true, nil); !errors.Is(err, backend.ErrTooLarge) {
		t.Fatalf("Publish of a message larger than frame_max: %v", err)
	}
	if conn, err := h.Connection(); err != nil || conn.IsClosed() || conn != pc.chConn(h) {
		t.Fatalf("the refused publishes disturbed the connection (err %v)", err)
	}
	if n := brokertest.QueueLength(t, q); n != 1 {
		t.Errorf("queue has %d messages, want the one that fit", n)
	}
}

// chConn returns the connection pc's channel belongs to, the hand-off's current one.
func (pc *pubChannel) chConn(h *publisher) *amqp.Connection {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.pc != pc {
		return nil
	}
	return h.conn
}

func TestFitsFrame(t *testing.T) {
	if err := fitsFrame(amqp.Publishing{Headers: amqp.Table{"a": strings.Repeat("x", 1<<20)}}, 0); err != nil {
		t.Errorf("frame_max 0 is no limit: %v", err)
	}
	if err := fitsFrame(amqp.Publishing{Headers: amqp.Table{"u": uint64(1)}}, 4096); err == nil || errors.Is(err, backend.ErrTooLarge) {
		t.Errorf("a header amqp091-go cannot publish: %v", err)
	}
	// Every property counts, at its full length.
	base := amqp.Publishing{Headers: amqp.Table{}}
	size := func(p amqp.Publishing) int {
		var n int
		if _, err := fmt.Sscanf(fitsFrame(p, 1).Error()[len(backend.ErrTooLarge.Error())+2:], "header frame of %d bytes", &n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	empty := size(base)
	for _, set := range []func(*amqp.Publishing){
		func(p *amqp.Publishing) { p.ContentType = "0123456789" },
		func(p *amqp.Publishing) { p.ContentEncoding = "0123456789" },
		func(p *amqp.Publishing) { p.CorrelationId = "0123456789" },
		func(p *amqp.Publishing) { p.ReplyTo = "0123456789" },
		func(p *amqp.Publishing) { p.Expiration = "0123456789" },
		func(p *amqp.Publishing) { p.MessageId = "0123456789" },
		func(p *amqp.Publishing) { p.Type = "0123456789" },
		func(p *amqp.Publishing) { p.UserId = "0123456789" },
		func(p *amqp.Publishing) { p.AppId = "0123456789" },
		func(p *amqp.Publishing) { p.Headers = amqp.Table{"k": "012345"} }, // 1+1 key, 1 type, 4 length, 6
	} {
		p := base
		set(&p)
		if got := size(p); got != empty+10+3*boolInt(len(p.Headers) > 0) {
			t.Errorf("%+v: %d bytes, want %d", p, got, empty+10)
		}
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestDeletedOwnedRouteIsDeclaredAgain: a route of the library's deleted while the
// application runs comes back at the first publish that needs it, once, in topology
// mode declare only.
func TestDeletedOwnedRouteIsDeclaredAgain(t *testing.T) {
	h := dialTest(t, backend.HandoffConfig{})
	ctx := context.Background()
	prefix := brokertest.Prefix(t)
	q, x := prefix+".q", prefix+".x"
	owned := topology.Topology{
		Exchanges: []topology.Exchange{{Name: x, Kind: amqp.ExchangeDirect}},
		Queues:    []topology.Queue{{Name: q}},
		Bindings:  []topology.Binding{{Exchange: x, Destination: q, Key: q}},
	}
	brokertest.CleanupTopology(t, owned)
	declared := 0
	ownedFn := func() topology.Topology { declared++; return owned }

	// Nothing exists: the exchange is missing (404), declared with the queue, published.
	if err := h.Publish(ctx, x, q, message.NewMessage("1", nil), nil, true, ownedFn); err != nil {
		t.Fatalf("publish to a deleted route: %v", err)
	}
	// The queue deleted: returned, declared again, published.
	ch, err := brokertest.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDelete(q, false, false, false); err != nil {
		t.Fatal(err)
	}
	if err := h.Publish(ctx, x, q, message.NewMessage("2", nil), nil, true, ownedFn); err != nil {
		t.Fatalf("publish after the queue was deleted: %v", err)
	}
	if declared != 2 || brokertest.QueueLength(t, q) != 1 {
		t.Fatalf("declared %d times, queue has %d; want 2 and the last message", declared, brokertest.QueueLength(t, q))
	}
	// A route that stays unroutable after declaring: the error stands, one try only.
	err = h.Publish(ctx, x, q+".other", message.NewMessage("3", nil), nil, true, ownedFn)
	if !errors.Is(err, backend.ErrReturned) || declared != 3 {
		t.Fatalf("unroutable after declaring: %v, declared %d times", err, declared)
	}
	// Without owned, or in another mode, nothing is declared.
	if _, err := ch.QueueDelete(q, false, false, false); err != nil {
		t.Fatal(err)
	}
	if err := h.Publish(ctx, x, q, message.NewMessage("4", nil), nil, true, nil); !errors.Is(err, backend.ErrReturned) {
		t.Fatalf("no owned topology: %v", err)
	}
	for _, mode := range []topology.Mode{topology.ModeVerify, topology.ModeNone} {
		hv := dialTest(t, backend.HandoffConfig{Topology: mode})
		if err := hv.Publish(ctx, x, q, message.NewMessage("5", nil), nil, true, ownedFn); !errors.Is(err, backend.ErrReturned) || declared != 3 {
			t.Fatalf("mode %s: %v, declared %d times; want backend.ErrReturned and nothing declared", mode, err, declared)
		}
	}

	// ToQueue declares a deleted poison queue again, as a review queue.
	poison := prefix + ".poison"
	brokertest.Cleanup(t, []string{poison}, nil)
	if err := h.ToQueue(ctx, poison, message.NewMessage("p", nil)); err != nil {
		t.Fatal(err)
	}
	if o, err := declare.CheckQueue(brokertest.Dial(t), declare.ReviewQueue(poison, "poison"), true); err != nil || o.Status != declare.OK {
		t.Fatalf("poison queue declared again: %+v, %v", o, err)
	}
}

func TestEnsure(t *testing.T) {
	h := dialTest(t, backend.HandoffConfig{})
	prefix := brokertest.Prefix(t)
	top := topology.Topology{Queues: []topology.Queue{{Name: prefix + ".q"}}}
	brokertest.CleanupTopology(t, top)
	if err := h.Ensure(topology.ModeNone, top); err != nil {
		t.Fatal(err)
	}
	if err := h.Ensure(topology.ModeVerify, top); !errors.Is(err, topology.ErrMissing) {
		t.Fatalf("verify a missing queue: %v", err)
	}
	if err := h.Ensure(topology.ModeDeclare, top); err != nil {
		t.Fatal(err)
	}
	if err := h.Ensure(topology.ModeVerify, top); err != nil {
		t.Fatal(err)
	}
	// A failed declaration closes its own channel, not the publishing one.
	clash := topology.Topology{Queues: []topology.Queue{{Name: prefix + ".q", Args: amqp.Table{declare.MessageTTLArg: int64(1)}}}}
	if err := h.Ensure(topology.ModeDeclare, clash); !errors.Is(err, topology.ErrMismatch) {
		t.Fatalf("clash: %v", err)
	}
	if err := h.Publish(context.Background(), "", prefix+".q", message.NewMessage("m", nil), nil, true, nil); err != nil {
		t.Fatalf("publish after a failed declaration: %v", err)
	}
}

// TestVersion reads the broker's version without disturbing the hand-off connection.
func TestVersion(t *testing.T) {
	h := dialTest(t, backend.HandoffConfig{})
	before, err := h.Connection()
	if err != nil {
		t.Fatal(err)
	}
	v := h.Version()
	if _, ok := version.Parse(v); !ok {
		t.Errorf("version %q", v)
	}
	after, err := h.Connection()
	if err != nil || after != before || after.IsClosed() {
		t.Errorf("reading the version disturbed the hand-off connection (err %v)", err)
	}
	t.Logf("RabbitMQ %s", v)
}

func TestDialErrorsHideThePassword(t *testing.T) {
	for _, uri := range []string{
		"amqp://guest:hunter2@127.0.0.1:1/",   // nothing listens
		"amqp://guest:hunter2@127.0.0.1:1:2/", // malformed
	} {
		_, err := dial(backend.HandoffConfig{URI: uri})
		if err == nil || strings.Contains(err.Error(), "hunter2") || !strings.Contains(err.Error(), "127.0.0.1") {
			t.Errorf("dial(%s): %v, want an error naming the host without the password", strings.ReplaceAll(uri, "hunter2", "***"), err)
		}
	}
	brokertest.Dial(t)
	wrong := strings.Replace(brokertest.URI(), "guest:guest@", "guest:hunter2@", 1)
	if wrong == brokertest.URI() {
		t.Skip("AMQP_URI does not use guest:guest")
	}
	if _, err := dial(backend.HandoffConfig{URI: wrong}); err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("wrong password: %v", err)
	}
}

func TestCause(t *testing.T) {
	for _, tt := range []struct {
		err  error
		want string
	}{
		{fmt.Errorf("p: %w: 312 NO_ROUTE", backend.ErrReturned), "returned"},
		{fmt.Errorf("p: %w", backend.ErrTooLarge), "too-large"},
		{fmt.Errorf("p: %w: %w", backend.ErrNotConfirmed, context.DeadlineExceeded), "timeout"},
		{fmt.Errorf("p: %w: %w", backend.ErrNotConfirmed, &amqp.Error{Code: amqp.NotFound}), "connection"},
		{fmt.Errorf("p: %w", amqp.ErrClosed), "connection"},
		{fmt.Errorf("connect: %w", &net.OpError{Op: "dial", Err: errors.New("refused")}), "connection"},
		{fmt.Errorf("p: %w", backend.ErrNotConfirmed), "nacked"},
		{errors.New("x"), "other"},
		{nil, "other"},
	} {
		if got := backend.Cause(tt.err); got != tt.want {
			t.Errorf("Cause(%v) = %q, want %q", tt.err, got, tt.want)
		}
	}
}
