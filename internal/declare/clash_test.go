package declare_test

import (
	"testing"

	"github.com/amqpretry/amqpretry/internal/declare"
)

// The texts are RabbitMQ's own: 3.10.8's and 4.3's, read off their 406s.
func TestParseClash(t *testing.T) {
	for _, tc := range []struct {
		text string
		want declare.Clash
		ok   bool
	}{
		{`PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received none but current is the value 'quorum' of type 'longstr'`,
			declare.Clash{Arg: "x-queue-type", Asked: "none", Has: "quorum"}, true},
		{`PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received 'classic' but current is 'quorum'`,
			declare.Clash{Arg: "x-queue-type", Asked: "classic", Has: "quorum"}, true},
		{`PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received the value 'quorum' of type 'longstr' but current is none`,
			declare.Clash{Arg: "x-queue-type", Asked: "quorum", Has: "none"}, true},
		{`PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received the value '2000' of type 'signedint' but current is none`,
			declare.Clash{Arg: "x-message-ttl", Asked: "2000", Has: "none"}, true},
		{`PRECONDITION_FAILED - invalid arg 'x-queue-type'`, declare.Clash{}, false},
		{``, declare.Clash{}, false},
	} {
		got, ok := declare.ParseClash(tc.text)
		if got != tc.want || ok != tc.ok {
			t.Errorf("ParseClash(%q) = %+v, %v; want %+v, %v", tc.text, got, ok, tc.want, tc.ok)
		}
	}
}

func FuzzParseClash(f *testing.F) {
	f.Add(`inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received none but current is the value 'quorum' of type 'longstr'`)
	f.Fuzz(func(t *testing.T, text string) {
		c, ok := declare.ParseClash(text)
		if !ok && c != (declare.Clash{}) {
			t.Fatalf("not a clash, yet %+v", c)
		}
	})
}
