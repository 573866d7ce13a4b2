//go:build race

package amqp1

// raceEnabled: the race detector is on. Watermill v1.5.1's TestReconnect has a data
// race of its own (publishedMessages is appended to and read without a lock), so the
// suite's reconnect test runs only without -race; TestReconnectBrokerSideClose covers
// reconnection under -race.
const raceEnabled = true
