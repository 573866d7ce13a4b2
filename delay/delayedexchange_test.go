package delay

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
)

func TestDelayedExchangeEffective(t *testing.T) {
	b := &delayedExchange{names: names{"p"}}
	for _, tt := range []struct {
		requested time.Duration
		want      time.Duration // 0 with tooLong
		tooLong   bool
	}{
		{0, time.Millisecond, false},
		{-time.Second, time.Millisecond, false},
		{time.Nanosecond, time.Millisecond, false},
		{1200 * time.Microsecond, 2 * time.Millisecond, false},
		{5 * time.Second, 5 * time.Second, false},
		{(1<<32 - 1) * time.Millisecond, (1<<32 - 1) * time.Millisecond, false},
		{(1<<32-1)*time.Millisecond + time.Nanosecond, 0, true},
		{50 * 24 * time.Hour, 0, true},
	} {
		got, err := b.Effective(tt.requested)
		switch {
		case tt.tooLong && (!errors.Is(err, ErrDelayTooLong) || !strings.Contains(err.Error(), tt.requested.String())):
			t.Errorf("%s: err %v, want ErrDelayTooLong naming the delay", tt.requested, err)
		case !tt.tooLong && (err != nil || got != tt.want):
			t.Errorf("%s: %s, %v; want %s", tt.requested, got, err, tt.want)
		}
	}
}

func TestDelayedExchangeTopology(t *testing.T) {
	b := &delayedExchange{names: names{"p"}}
	wq := b.WorkQueue("orders")
	if len(wq.Exchanges) != 1 || len(wq.Queues) != 0 || len(wq.Bindings) != 1 {
		t.Fatalf("WorkQueue: %+v, want the exchange and one binding", wq)
	}
	e := wq.Exchanges[0]
	if e.Name != "p.delayed" || e.Kind != topology.ExchangeDelayedMessage || e.Args[topology.DelayedTypeArg] != amqp.ExchangeDirect {
		t.Errorf("exchange %+v, want p.delayed of type x-delayed-message, x-delayed-type direct", e)
	}
	if _, ok := e.Args[topology.AlternateExchangeArg]; ok {
		t.Error("an alternate exchange would receive every delayed publish at once")
	}
	if bd := wq.Bindings[0]; bd.Exchange != "p.delayed" || bd.Destination != "orders" || bd.Key != "orders" || bd.ToExchange {
		t.Errorf("binding %+v, want orders under its own name", bd)
	}
}

func TestDelayedExchangePublishRefusesEmptyQueue(t *testing.T) {
	b := &delayedExchange{names: names{"p"}, bound: map[string]bool{}}
	if err := b.Publish("", message.NewMessage("m", nil)); err == nil {
		t.Fatal("published to an empty queue name")
	}
}
