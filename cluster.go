package amqpretry

import (
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/backend"
)

// Cluster returns an amqp091-go Config whose connections go to any of the nodes of a
// RabbitMQ cluster, given as "host:port": each dial tries the nodes in turn, starting
// with the one after the node the previous dial reached, and returns the first that
// accepts a TCP connection within 5 seconds. A connection lost with its node is
// therefore dialled again to another node, by watermill-amqp's reconnection and by the
// library's hand-off alike. Set it as Connection.AmqpConfig of the subscriber config
// given to New, and of your publishers' configs: the URI then gives only the
// credentials, the vhost and the scheme (the host of an amqps URI is the TLS server
// name unless TLSClientConfig names another).
//
// No process is needed in between; a TCP load balancer in front of the nodes, with the
// URI pointing at it, is the alternative, and behaves the same. Do not set Properties
// on the returned Config when it is shared: amqp091-go writes into that map at every
// dial, and the subscriber and your publishers may dial at the same moment.
func Cluster(nodes ...string) *amqp.Config {
	d := &dialer{nodes: nodes}
	return &amqp.Config{Dial: d.dial, Heartbeat: backend.Heartbeat, Locale: backend.Locale}
}

// dialer dials the nodes in turn.
type dialer struct {
	nodes []string
	next  atomic.Uint64
}

const nodeTimeout = 5 * time.Second

func (d *dialer) dial(network, _ string) (net.Conn, error) {
	if len(d.nodes) == 0 {
		return nil, errors.New("cluster: no node given")
	}
	start := d.next.Load()
	var errs []error
	for i := range uint64(len(d.nodes)) {
		n := (start + i) % uint64(len(d.nodes))
		conn, err := amqp.DefaultDial(nodeTimeout)(network, d.nodes[n])
		if err == nil {
			d.next.Store(n + 1)
			return conn, nil
		}
		errs = append(errs, fmt.Errorf("node %s: %w", d.nodes[n], err))
	}
	d.next.Store(start + 1)
	return nil, fmt.Errorf("cluster: no node answers: %w", errors.Join(errs...))
}
