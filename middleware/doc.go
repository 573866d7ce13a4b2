// Package middleware describes what the retry middleware writes and reports: the
// failure Envelope on every retried and poisoned copy, the poison Reasons, the Events
// it tells amqpretry.Config.Observe, and its Stats. Import it to read the poison queue,
// to build metrics, or to match a Reason.
//
// The middleware itself is built by the transport package of your watermill-amqp
// major (github.com/amqpretry/amqpretry/wamqp3 or wamqp2); package amqpretry
// configures it.
package middleware
