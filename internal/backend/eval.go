package backend

import (
	"context"
	"strconv"
	"strings"
)

// Eval runs an Erlang expression on the broker's node (rabbitmqctl eval, as ops runs
// it with its Config.Rabbitmqctl) and returns what it printed.
type Eval func(ctx context.Context, expr string) ([]byte, error)

// ErlBinary spells s as an Erlang binary of its bytes, for an Eval expression: nothing
// in a name can break out of it.
func ErlBinary(s string) string {
	var b strings.Builder
	b.WriteString("<<")
	for i := 0; i < len(s); i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(int(s[i])))
	}
	b.WriteString(">>")
	return b.String()
}
