package amqp1

// QueueAddress is the RabbitMQ 4 (address format v2) AMQP 1.0 address of a queue:
// "/queues/" and the percent-encoded queue name. A message sent to it goes to that
// queue only; a receiver attached to it consumes from it.
func QueueAddress(queue string) string {
	return "/queues/" + escapeSegment(queue)
}

// ExchangeAddress is the address of an exchange and a routing key: "/exchanges/<name>/<key>",
// both percent-encoded; with an empty key, "/exchanges/<name>" (the key is then empty).
// The default exchange "" is written "amq.default", its AMQP 1.0 name (QueueAddress is
// the simpler way to reach one queue). Publishing to it routes the message like an AMQP 0-9-1 publish; a message nothing
// is bound for is settled released, which Publish reports as ErrNotAccepted.
func ExchangeAddress(exchange, routingKey string) string {
	if exchange == "" {
		exchange = "amq.default"
	}
	if routingKey == "" {
		return "/exchanges/" + escapeSegment(exchange)
	}
	return "/exchanges/" + escapeSegment(exchange) + "/" + escapeSegment(routingKey)
}

// escapeSegment percent-encodes every byte except RFC 3986's unreserved characters
// (ALPHA, DIGIT, "-", ".", "_", "~"), as RabbitMQ's address format v2 asks.
func escapeSegment(s string) string {
	const hex = "0123456789ABCDEF"
	b := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9',
			c == '-', c == '.', c == '_', c == '~':
			b = append(b, c)
		default:
			b = append(b, '%', hex[c>>4], hex[c&15])
		}
	}
	return string(b)
}
