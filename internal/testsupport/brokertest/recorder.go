package brokertest

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Published is one message given to a Recorder, with its topic.
type Published struct {
	Topic string
	Msg   *message.Message
}

// Recorder is a message.Publisher that hands each message it is given to its channel:
// the memory backend's publisher in tests. Its buffer must fit what a test publishes.
type Recorder chan Published

// NewRecorder returns a Recorder that keeps up to n messages.
func NewRecorder(n int) Recorder { return make(Recorder, n) }

// Publish hands each message to the channel, with topic.
func (r Recorder) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		r <- Published{topic, m}
	}
	return nil
}

// Close does nothing.
func (Recorder) Close() error { return nil }

// Next returns the next message published, or fails t after 10 s.
func (r Recorder) Next(t testing.TB) Published {
	t.Helper()
	select {
	case p := <-r:
		return p
	case <-time.After(10 * time.Second):
		t.Fatal("nothing published within 10s")
	}
	return Published{}
}
