package ops

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
)

// The expressions this package runs with rabbitmqctl eval print what they report one
// item a line: a JSON document, or a tag and its text: the expression's result, or an
// error ("<queue>: <what>", or "<what>").
const (
	evalResultTag = "amqpretry-result "
	evalErrorTag  = "amqpretry-error "
)

// evalOutput is what an eval expression printed: the text after its first result tag
// and after its first error tag (each to the end of its line; has* tells there was
// one), and its JSON documents.
type evalOutput struct {
	result, failed       string
	hasResult, hasFailed bool
	json                 []string
}

// readEval reads what an eval expression printed (rabbitmqctl may print warnings
// around it).
func readEval(out []byte) evalOutput {
	var r evalOutput
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(line, "{"):
			r.json = append(r.json, line)
		case strings.HasPrefix(line, evalErrorTag) && !r.hasFailed:
			r.failed, r.hasFailed = strings.TrimSpace(strings.TrimPrefix(line, evalErrorTag)), true
		case strings.HasPrefix(line, evalResultTag) && !r.hasResult:
			r.result, r.hasResult = strings.TrimSpace(strings.TrimPrefix(line, evalResultTag)), true
		}
	}
	return r
}

// eval runs expr with rabbitmqctl eval and returns its JSON lines; a line the
// expression marks as an error fails it, naming queue.
func (o *Ops) eval(ctx context.Context, queue, expr string) ([]peeked, error) {
	if o.ctl == nil {
		return nil, errNoCtl
	}
	out, err := o.ctl(ctx, "-q", "eval", expr)
	if err != nil {
		return nil, fmt.Errorf("queue %q: rabbitmqctl eval (needs admin rights on the node of the broker): %w", queue, o.redact(err))
	}
	r := readEval(out)
	if r.hasFailed {
		what := r.failed
		if name, rest, ok := strings.Cut(what, ": "); ok {
			queue, what = name, rest
		}
		return nil, evalError(queue, what)
	}
	var res []peeked
	for _, line := range r.json {
		var p peeked
		if err := json.Unmarshal([]byte(line), &p); err != nil {
			return res, fmt.Errorf("queue %q: read rabbitmqctl eval output: %w", queue, err)
		}
		p.headers = map[string]string{}
		for k, v := range p.Props {
			if s, ok := v.(string); ok && strings.HasPrefix(k, "header.") {
				p.headers[strings.TrimPrefix(k, "header.")] = s
			}
		}
		res = append(res, p)
	}
	return res, nil
}

// evalError turns what an eval expression reported into an error that names the fix.
func evalError(queue, what string) error {
	switch {
	case strings.Contains(what, "is not a quorum queue"):
		return fmt.Errorf("queue %q: %s", queue, what)
	case what == "not_found":
		return fmt.Errorf("queue %q does not exist", queue)
	case what == "no_delayed_retry":
		return fmt.Errorf("queue %q holds no delayed retries: it is not a quorum queue of RabbitMQ 4.3 or later", queue)
	case what == "no_retry_delayed":
		return fmt.Errorf("queue %q: this broker has no rabbit_quorum_queue:retry_delayed (RabbitMQ 4.3 and later): retry now cannot bring its delayed retries back", queue)
	case strings.Contains(what, "classic_queue_not_supported"), strings.Contains(what, "not_quorum_queue"):
		return fmt.Errorf("queue %q is not a quorum queue: the broker can peek only quorum queues", queue)
	}
	return fmt.Errorf("queue %q: rabbitmqctl eval: %s", queue, what)
}
