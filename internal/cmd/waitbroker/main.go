// Command waitbroker waits until the RabbitMQ at AMQP_URI accepts a connection, for at
// most -timeout; it exits 1 if it does not. The password never appears in its output.
package main

import (
	"flag"
	"fmt"
	"os"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/brokertest"
)

func main() {
	timeout := flag.Duration("timeout", 0, "how long to keep trying")
	flag.Parse()
	deadline := time.Now().Add(*timeout)
	for {
		conn, err := amqp.Dial(brokertest.URI())
		if err == nil {
			_ = conn.Close()
			return
		}
		if time.Now().After(deadline) {
			fmt.Fprintf(os.Stderr, "waitbroker: no RabbitMQ at %s: %v\n", brokertest.Redact(brokertest.URI()), err)
			os.Exit(1)
		}
		time.Sleep(500 * time.Millisecond)
	}
}
