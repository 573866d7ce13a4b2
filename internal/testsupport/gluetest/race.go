//go:build race

package gluetest

// raceEnabled: the race detector is on. watermill-amqp's reconnection races with
// itself (v2.1.3 and v3.0.1: ConnectionWrapper.connect writes the connection and its
// connected channel while Close and IsConnected read them), so the tests that make it
// reconnect run without the detector (scripts/test.sh).
const raceEnabled = true
