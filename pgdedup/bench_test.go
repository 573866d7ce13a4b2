package pgdedup_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
)

// What Config.Dedup costs a message handled: the retry middleware's success path,
// in-process, without it, with the memory store, and with this package's store on the
// PostgreSQL at PGDEDUP_DSN (the machine's, on loopback), a new message UUID each time
// (checked, handled, recorded):
//
//	cd pgdedup && go test -run '^$' -bench . -benchmem
func BenchmarkDedup(b *testing.B) {
	for _, store := range []string{"off", "memory", "postgres"} {
		b.Run(store, func(b *testing.B) {
			cfg := amqpretry.Config{Backend: delay.Memory(discard{})}
			switch store {
			case "memory":
				cfg.Dedup = time.Hour
			case "postgres":
				s, _ := table(b, open(b))
				cfg.Dedup, cfg.DedupStore = time.Hour, s
			}
			r, err := middleware.New(cfg, middleware.Transport{Queue: func(string) string { return "work" }})
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			h := r.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			ids := make([]string, b.N)
			for i := range ids {
				ids[i] = fmt.Sprintf("01J0BENCHMARKMESSAGE%06d", i)
			}
			msg := message.NewMessage("", []byte(`{"order":"12345","amount":"42.00"}`))
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				msg.UUID = ids[i]
				if _, err := h(msg); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			if st := r.Stats(); st.Duplicates != 0 {
				b.Fatalf("%d duplicates: every message is new", st.Duplicates)
			}
		})
	}
}
