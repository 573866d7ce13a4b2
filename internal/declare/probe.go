package declare

import (
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/internal/wire"
)

// maxProbes bounds the declarations QueueArgs makes: one per argument the queue has,
// and one that passes.
const maxProbes = 16

// currentType reads the type RabbitMQ gives the existing value in a 406 on a
// declaration: "... but current is the value '1000000' of type 'long'".
var currentType = regexp.MustCompile(`but current is (?:the value )?'[^']*' of type '([^']+)'`)

// QueueArgs reads, over conn, the arguments of an existing queue that RabbitMQ compares
// on a declaration (every one it gives meaning to). RabbitMQ names one differing
// argument per refusal: it declares the queue again on a throwaway channel, first with
// no argument, then each time with the value the last refusal named, until the
// declaration passes, which changes nothing. RabbitMQ cuts a refusal's text at 255
// bytes: a value cut short is taken from likely where it starts as what is left of
// it. ok is false when it cannot tell: the queue does not exist (nothing is created),
// the user has no configure permission, or a refusal it cannot read.
func QueueArgs(conn *amqp.Connection, queue string, likely amqp.Table) (args amqp.Table, ok bool) {
	if conn == nil || conn.IsClosed() {
		return nil, false
	}
	exists := func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		return err
	}
	if withChannel(conn, exists) != nil {
		return nil, false
	}
	args = amqp.Table{}
	named := map[string]bool{}
	for range maxProbes {
		err := withChannel(conn, func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclare(queue, true, false, false, false, args)
			return err
		})
		if err == nil {
			return args, true
		}
		if !amqperr.IsCode(err, amqp.PreconditionFailed) {
			return nil, false
		}
		reason := amqperr.Reason(err)
		c, ok := ParseClash(reason)
		short := false
		if !ok {
			c.Arg, ok = cutShort(reason, likely)
			short = ok
		}
		if !ok || named[c.Arg] {
			return nil, false // unreadable, or a value it cannot give back as it is
		}
		named[c.Arg] = true
		switch {
		case short:
			args[c.Arg] = likely[c.Arg]
		case c.Has == "none":
			delete(args, c.Arg)
		default:
			typ := ""
			if m := currentType.FindStringSubmatch(reason); m != nil {
				typ = m[1]
			}
			args[c.Arg] = typedValue(c.Has, typ)
		}
	}
	return nil, false
}

// cutShortText is a 406 whose text RabbitMQ cut short (AMQP's reply text is at most
// 255 bytes) within the existing value: "... but current is the value 'app.orders.poi...".
var cutShortText = regexp.MustCompile(`inequivalent arg '([^']+)'.*but current is (?:the value )?'([^']*)\.\.\.$`)

// cutShort reads the argument of a 406 cut short within its existing value, when
// likely has a value for it that starts with what is left of it.
func cutShort(reason string, likely amqp.Table) (arg string, ok bool) {
	m := cutShortText.FindStringSubmatch(reason)
	if m == nil {
		return "", false
	}
	v, isString := likely[m[1]].(string)
	return m[1], isString && strings.HasPrefix(v, m[2])
}

// typedValue is the value RabbitMQ quotes as s, of its type typ ("" when it gives
// none: an integer, a boolean, or else a string).
func typedValue(s, typ string) any {
	switch typ {
	case "longstr":
		return s
	case "long", "signedint", "short", "byte", "":
		if n, err := strconv.ParseInt(s, 10, 64); err == nil {
			switch typ {
			case "signedint":
				return int32(n)
			case "short":
				return int16(n)
			case "byte":
				return int8(n)
			}
			return n
		}
	case "bool":
		return s == "true"
	case "double", "float":
		if f, err := strconv.ParseFloat(s, 64); err == nil {
			return f
		}
	}
	if typ == "" && (s == "true" || s == "false") {
		return s == "true"
	}
	return s
}

// SameArgs tells whether a and b have the same arguments, integers compared by value
// whatever their width.
func SameArgs(a, b amqp.Table) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		w, ok := b[k]
		if !ok || !SameValue(v, w) {
			return false
		}
	}
	return true
}

// SameValue tells whether two argument values are equal, integers compared by value
// whatever their width.
func SameValue(a, b any) bool {
	if x, ok := wire.Integer(a); ok {
		y, ok := wire.Integer(b)
		return ok && x == y
	}
	if s, ok := a.(string); ok {
		t, ok := b.(string)
		return ok && s == t
	}
	return fmt.Sprint(a) == fmt.Sprint(b)
}

// FormatArgs lists args sorted by name, each as `name: value` (a string quoted).
func FormatArgs(args amqp.Table) string {
	if len(args) == 0 {
		return "no arguments"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(args)) {
		parts = append(parts, k+": "+FormatValue(args[k]))
	}
	return strings.Join(parts, ", ")
}

// FormatValue is an argument's value as FormatArgs writes it.
func FormatValue(v any) string {
	if s, ok := v.(string); ok {
		return strconv.Quote(s)
	}
	return fmt.Sprint(v)
}
