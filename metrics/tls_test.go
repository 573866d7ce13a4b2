package metrics_test

import (
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/brokertest"
	"github.com/amqpretry/amqpretry/internal/testsupport/tlstest"
	"github.com/amqpretry/amqpretry/metrics"
)

// TestTLSGauges: an application over amqps poisons messages, and the queue gauges read
// them over amqps, the CA in the URI or in Config.AMQP; with the wrong CA the refresh
// fails with the TLS error and never the password.
func TestTLSGauges(t *testing.T) {
	const m = 2
	env := tlstest.Get(t)
	withCA := tlstest.WithQuery(t, env.URI, "cacertfile", env.File("ca.pem"))
	r := start(t, withCA, amqpretry.Config{Prefix: brokertest.Prefix(t), Backend: delay.TTLTiers(time.Second)},
		func(*message.Message) error { return amqpretry.Permanent(errors.New("malformed")) })
	r.publish(t, 0, m)
	poisoned := fmt.Sprintf(`amqpretry_poisoned_total{queue=%q,reason="permanent"}`, r.topic)
	r.waitFor(t, 30*time.Second, func(got map[string]float64) bool { return got[poisoned] == m })

	gauge := fmt.Sprintf(`amqpretry_poison_queue_messages{queue=%q}`, r.cfg.Prefix+".poison")
	if err := r.mx.RefreshQueues(withCA, r.cfg); err != nil {
		t.Fatalf("RefreshQueues over amqps, CA in the URI: %v", err)
	}
	if v := flatten(mustGather(t, r.reg))[gauge]; v != m {
		t.Errorf("poison queue gauge over amqps = %v, want %d", v, m)
	}

	reg := prometheus.NewRegistry()
	mx, err := metrics.New(metrics.Config{Registerer: reg, AMQP: amqp.Config{TLSClientConfig: env.Config(t)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := mx.RefreshQueues(env.URI, r.cfg); err != nil {
		t.Fatalf("RefreshQueues over amqps, CA in Config.AMQP: %v", err)
	}
	if v := flatten(mustGather(t, reg))[gauge]; v != m {
		t.Errorf("poison queue gauge over amqps (Config.AMQP) = %v, want %d", v, m)
	}

	uri, secret := tlstest.WithPassword(t, env.URI)
	bad, err := metrics.New(metrics.Config{Registerer: prometheus.NewRegistry(), AMQP: amqp.Config{TLSClientConfig: env.WrongCA(t)}})
	if err != nil {
		t.Fatal(err)
	}
	err = bad.RefreshQueues(uri, r.cfg)
	var unknown x509.UnknownAuthorityError
	if err == nil || !errors.As(err, &unknown) || strings.Contains(err.Error(), secret) {
		t.Errorf("RefreshQueues with the wrong CA: %v; want the TLS error, without the password", err)
	}
}
