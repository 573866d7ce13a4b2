// Command waitbroker waits until the RabbitMQ at AMQP_URI accepts a connection, for at
// most -timeout; it exits 1 if it does not. The password never appears in its output.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
)

func main() {
	timeout := flag.Duration("timeout", 0, "how long to keep trying")
	flag.Parse()
	if err := brokertest.Wait(*timeout); err != nil {
		fmt.Fprintf(os.Stderr, "waitbroker: no RabbitMQ at %s: %v\n", brokertest.Redact(brokertest.URI()), err)
		os.Exit(1)
	}
}
