package amqp1

import (
	"strings"
	"testing"
	"time"
)

func TestConfigDefaults(t *testing.T) {
	var s SubscriberConfig
	s.setDefaults()
	if s.QueueName("t") != "t" || s.Queue.Type != "quorum" || s.Credit != 1 || s.CloseTimeout != 30*time.Second ||
		s.ReconnectInitialInterval != 100*time.Millisecond || s.ReconnectMaxInterval != 10*time.Second {
		t.Errorf("subscriber defaults: %+v", s)
	}
	var p PublisherConfig
	p.setDefaults()
	if p.Address("t") != "/queues/t" || p.PublishTimeout != 30*time.Second {
		t.Errorf("publisher defaults: %+v", p)
	}
}

func TestConfigValidate(t *testing.T) {
	const uri = "amqp://localhost/"
	for _, tc := range []struct {
		config SubscriberConfig
		want   string
	}{
		{SubscriberConfig{}, "URI is empty"},
		{SubscriberConfig{URI: uri, Queue: QueueConfig{Type: "stream"}}, `Queue.Type "stream"`},
		{SubscriberConfig{URI: uri, Queue: QueueConfig{Arguments: map[string]any{"x-queue-type": "quorum"}}}, "x-queue-type"},
		{SubscriberConfig{URI: uri, Credit: -1}, "Credit -1"},
		{SubscriberConfig{URI: uri, CloseTimeout: -1}, "CloseTimeout"},
		{SubscriberConfig{URI: uri, ReconnectInitialInterval: time.Minute}, "ReconnectInitialInterval"},
	} {
		err := tc.config.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.config, err, tc.want)
		}
	}
	if err := (SubscriberConfig{URI: uri}).Validate(); err != nil {
		t.Error(err)
	}
	if err := (PublisherConfig{URI: uri, PublishTimeout: -1}).Validate(); err == nil {
		t.Error("negative PublishTimeout accepted")
	}
	if err := (PublisherConfig{URI: uri}).Validate(); err != nil {
		t.Error(err)
	}
}
