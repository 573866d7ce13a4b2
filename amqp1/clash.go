package amqp1

import (
	"regexp"
	"strings"
)

// clash is what RabbitMQ's 406 says of a queue declared with other arguments than the
// existing one's: "inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received
// none but current is the value 'quorum' of type 'longstr'". The management node words
// it as AMQP 0-9-1 does; the root module reads it for its own declarations.
type clash struct {
	arg   string // the argument that differs, such as x-queue-type
	asked string // the value the declaration gave, "none" when it gave none
	has   string // the existing queue's value, "none" when it has none
}

var clashText = regexp.MustCompile(`inequivalent arg '([^']+)'.*?: received (none|(?:the value )?'[^']*')(?: of type '[^']*')? but current is (none|(?:the value )?'[^']*')`)

// parseClash reads a clash from the text of the broker's refusal; ok is false when the
// text is not one.
func parseClash(text string) (c clash, ok bool) {
	m := clashText.FindStringSubmatch(text)
	if m == nil {
		return clash{}, false
	}
	value := func(s string) string { return strings.Trim(strings.TrimPrefix(s, "the value "), "'") }
	return clash{arg: m[1], asked: value(m[2]), has: value(m[3])}, true
}
