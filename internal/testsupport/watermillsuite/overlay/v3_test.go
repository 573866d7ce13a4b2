//go:build amqpretry_watermillsuite

// Added by scripts/watermill-suite.sh, through `go test -overlay`, to watermill-amqp
// v3's own pkg/amqp test package, whose pubsub_test.go the script patches (at run
// time, never committed) to build every subscriber with the functions below instead
// of amqp.NewSubscriber and amqp.NewSubscriberWithConnection: the subscriber config
// goes through wamqp3.New and Retry.SubscriberConfig, so the suite runs with our
// marshaler and topology builder. v2_test.go is the same for v2.

package amqp_test

import (
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// amqpretrySubscriber is the suite's subscriber, built from our SubscriberConfig; its
// Close closes the Retry after the subscriber.
type amqpretrySubscriber struct {
	*amqp.Subscriber
	retry *wamqp3.Retry
	once  sync.Once
	err   error
}

func (s *amqpretrySubscriber) Close() error {
	err := s.Subscriber.Close()
	s.once.Do(func() { s.err = s.retry.Close() })
	if err != nil {
		return err
	}
	return s.err
}

// amqpretryRetry builds the Retry for cfg: one prefix (AMQPRETRY_SUITE_PREFIX, which the
// script deletes at the end) and one tier for every Retry of the run, so that they
// share one small topology.
func amqpretryRetry(cfg amqp.Config, logger watermill.LoggerAdapter) (*wamqp3.Retry, error) {
	prefix := os.Getenv("AMQPRETRY_SUITE_PREFIX")
	if prefix == "" {
		return nil, fmt.Errorf("AMQPRETRY_SUITE_PREFIX is not set: run scripts/watermill-suite.sh")
	}
	return wamqp3.New(cfg, amqpretry.Config{
		Prefix:  prefix,
		Backend: delay.TTLTiers(time.Second),
		Logger:  logger,
	})
}

// amqpretrySubscriberConfig is retry.SubscriberConfig(), refused if it did not replace
// the marshaler and the topology builder of cfg: the run would prove nothing.
func amqpretrySubscriberConfig(retry *wamqp3.Retry, cfg amqp.Config) (amqp.Config, error) {
	sc := retry.SubscriberConfig()
	if fmt.Sprintf("%T", sc.Marshaler) == fmt.Sprintf("%T", cfg.Marshaler) || fmt.Sprintf("%T", sc.TopologyBuilder) == fmt.Sprintf("%T", cfg.TopologyBuilder) {
		return sc, fmt.Errorf("SubscriberConfig kept the marshaler (%T) or the topology builder (%T) of the config", sc.Marshaler, sc.TopologyBuilder)
	}
	return sc, nil
}

// amqpretryNewSubscriber replaces amqp.NewSubscriber.
func amqpretryNewSubscriber(cfg amqp.Config, logger watermill.LoggerAdapter) (*amqpretrySubscriber, error) {
	retry, err := amqpretryRetry(cfg, logger)
	if err != nil {
		return nil, err
	}
	subCfg, err := amqpretrySubscriberConfig(retry, cfg)
	if err != nil {
		_ = retry.Close()
		return nil, err
	}
	sub, err := amqp.NewSubscriber(subCfg, logger)
	if err != nil {
		_ = retry.Close()
		return nil, err
	}
	return &amqpretrySubscriber{Subscriber: sub, retry: retry}, nil
}

// amqpretryNewSubscriberWithConnection replaces amqp.NewSubscriberWithConnection. A
// config for a shared connection may have no URI (TestSharedConnection): the Retry,
// which publishes on a connection of its own, then gets the suite's broker URI; the
// subscriber keeps the config's Connection as given.
func amqpretryNewSubscriberWithConnection(cfg amqp.Config, logger watermill.LoggerAdapter, conn *amqp.ConnectionWrapper) (*amqpretrySubscriber, error) {
	retryCfg := cfg
	if retryCfg.Connection.AmqpURI == "" {
		retryCfg.Connection.AmqpURI = amqpURI()
	}
	retry, err := amqpretryRetry(retryCfg, logger)
	if err != nil {
		return nil, err
	}
	subCfg, err := amqpretrySubscriberConfig(retry, cfg)
	if err != nil {
		_ = retry.Close()
		return nil, err
	}
	subCfg.Connection = cfg.Connection
	sub, err := amqp.NewSubscriberWithConnection(subCfg, logger, conn)
	if err != nil {
		_ = retry.Close()
		return nil, err
	}
	return &amqpretrySubscriber{Subscriber: sub, retry: retry}, nil
}
