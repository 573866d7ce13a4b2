package declare

import (
	"regexp"
	"strings"
)

// Clash is what RabbitMQ's 406 PRECONDITION_FAILED says of a declaration that differs
// from the existing exchange or queue: "inequivalent arg 'x-queue-type' for queue 'q'
// in vhost '/': received none but current is the value 'quorum' of type 'longstr'".
// AMQP 0-9-1 and the AMQP 1.0 management node (RabbitMQ 4) word it the same.
type Clash struct {
	Arg string // the argument that differs, such as x-queue-type
	// Asked is the value the declaration gave the argument, "none" when it gave none
	// (for x-queue-type: the virtual host's default type, classic unless set).
	Asked string
	Has   string // the existing object's value, "none" when it has none
}

var clashText = regexp.MustCompile(`inequivalent arg '([^']+)'.*?: received (none|(?:the value )?'[^']*')(?: of type '[^']*')? but current is (none|(?:the value )?'[^']*')`)

// ParseClash reads a Clash from the text of a broker's error; ok is false when the text
// is not such a refusal.
func ParseClash(text string) (c Clash, ok bool) {
	m := clashText.FindStringSubmatch(text)
	if m == nil {
		return Clash{}, false
	}
	return Clash{Arg: m[1], Asked: clashValue(m[2]), Has: clashValue(m[3])}, true
}

// clashValue is a value as the broker quotes it: none, 'v' or the value 'v'.
func clashValue(s string) string {
	s = strings.TrimPrefix(s, "the value ")
	return strings.Trim(s, "'")
}
