//go:build !race

package amqp1

const raceEnabled = false
