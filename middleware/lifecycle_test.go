package middleware

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
)

// TestCloseWaitsForHandoffsInFlightThenHandsNothingOff: Close returns only once the
// hand-off that began before it is over, and says it waited for it; a message that
// fails after Close is not handed off (nacked for redelivery, ErrHandoff), logged once;
// a second Close does nothing.
func TestCloseWaitsForHandoffsInFlightThenHandsNothingOff(t *testing.T) {
	parking, release := make(chan struct{}), make(chan struct{})
	var parkDone atomic.Bool
	b := &fakeBackend{park: func(*message.Message) error {
		if parkDone.Load() {
			return nil
		}
		close(parking)
		<-release
		parkDone.Store(true)
		return nil
	}}
	logs := watermill.NewCaptureLogger()
	e, poison := newEngine(t, amqpretry.Config{Logger: logs}, b)
	r := &retry{engine: e, cfg: e.cfg}
	handlerErr := errors.New("boom")

	handled := make(chan error, 1)
	go func() {
		_, err := e.Middleware(failing(handlerErr))(message.NewMessage("in-flight", nil))
		handled <- err
	}()
	<-parking
	closed := make(chan bool, 1)
	go func() {
		_ = r.close()
		closed <- parkDone.Load()
	}()
	// Closed (and the hand-offs in flight counted) before the hand-off may end.
	select {
	case <-e.life.closing():
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not begin within 10s")
	}
	close(release)
	if !<-closed {
		t.Error("Close returned before the hand-off in flight was over")
	}
	if err := <-handled; err != nil {
		t.Errorf("the hand-off in flight: %v, want it confirmed", err)
	}

	_, err := e.Middleware(failing(handlerErr))(hurried("late"))
	if !errors.Is(err, amqpretry.ErrHandoff) || !errors.Is(err, handlerErr) || !strings.Contains(err.Error(), "close the router first") {
		t.Errorf("a failure after Close: %v, want ErrHandoff (nack) naming the order to close in", err)
	}
	if _, err := e.Middleware(failing(amqpretry.Permanent(handlerErr)))(hurried("late-poison")); !errors.Is(err, amqpretry.ErrHandoff) {
		t.Errorf("a permanent failure after Close: %v, want ErrHandoff (nack)", err)
	}
	if n := len(b.msgs()); n != 1 {
		t.Errorf("%d messages parked, want only the one in flight before Close", n)
	}
	if n := len(poison.got()); n != 0 {
		t.Errorf("%d messages poisoned after Close", n)
	}
	if err := r.close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	captured := logs.Captured()
	after, closings := 0, 0
	for _, l := range captured[watermill.ErrorLogLevel] {
		if strings.Contains(l.Msg, "after Close") {
			after++
		}
	}
	for _, l := range captured[watermill.InfoLogLevel] {
		if l.Msg == "Broker-side retry closed" {
			closings++
			if l.Fields["handoffs_waited_for"] != int64(1) || l.Fields["retries"] != int64(1) {
				t.Errorf("closing line %v, want 1 hand-off waited for, 1 retry", l.Fields)
			}
		}
	}
	if after != 1 || closings != 1 {
		t.Errorf("%d lines for failures after Close (want 1), %d closing lines (want 1)", after, closings)
	}
}
