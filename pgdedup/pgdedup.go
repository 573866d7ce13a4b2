// Package pgdedup is a durable amqpretry.DedupStore: a table in PostgreSQL, reached
// through the application's own *sql.DB (any driver: pgx's stdlib, lib/pq), so that
// the messages a Retry's Config.Dedup remembers survive a restart and are shared by
// every instance of the application:
//
//	store, err := pgdedup.New(ctx, db, "") // the table amqpretry_dedup, created if missing
//	if err != nil { ... }
//	retry, err := wamqp3.New(amqpCfg, amqpretry.Config{Dedup: 7 * 24 * time.Hour, DedupStore: store})
//
// Each message handled costs two statements: a SELECT by primary key before the
// handler, an INSERT ... ON CONFLICT after it. One Record in 1,000 also deletes up to
// 1,000 rows past their time. PostgreSQL because applications that need a durable
// dedup usually run it already (the outbox of NServiceBus and the inbox of MassTransit
// live in the application's database), and because database/sql keeps this module free
// of any driver: its tests use lib/pq.
package pgdedup

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"
)

// DefaultTable is the table New uses when given "".
const DefaultTable = "amqpretry_dedup"

// Store is the table of one application's dedup keys. Safe for concurrent use.
type Store struct {
	db                   *sql.DB
	seen, record, expire string
	records              atomic.Int64
}

// purgeEvery is how many Records between two deletions of rows past their time.
const purgeEvery = 1000

// New returns the Store of table in db (DefaultTable for ""), creating the table and
// its index if they do not exist. The table name is one identifier, quoted: a name
// with a dot is not a schema-qualified name (set the connection's search_path for a
// schema). It fails when db cannot reach PostgreSQL or cannot create the table.
func New(ctx context.Context, db *sql.DB, table string) (*Store, error) {
	if db == nil {
		return nil, errors.New("pgdedup: db is nil")
	}
	if table == "" {
		table = DefaultTable
	}
	if len(table) > 63-len("_until") {
		return nil, fmt.Errorf("pgdedup: table name %q is longer than %d bytes (PostgreSQL's identifiers have 63, and its index adds _until)", table, 63-len("_until"))
	}
	t, idx := quote(table), quote(table+"_until")
	ddl := fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (key text PRIMARY KEY, until timestamptz NOT NULL);
CREATE INDEX IF NOT EXISTS %s ON %s (until)`, t, idx, t)
	if _, err := db.ExecContext(ctx, ddl); err != nil {
		return nil, fmt.Errorf("pgdedup: create table %s: %w (the user needs CREATE on the schema, or create it yourself: %s)", t, err, ddl)
	}
	return &Store{
		db:     db,
		seen:   fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE key = $1 AND until > $2)`, t),
		record: fmt.Sprintf(`INSERT INTO %s (key, until) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET until = EXCLUDED.until`, t),
		expire: fmt.Sprintf(`DELETE FROM %s WHERE key IN (SELECT key FROM %s WHERE until <= $1 LIMIT %d)`, t, t, purgeEvery),
	}, nil
}

// quote quotes a PostgreSQL identifier.
func quote(name string) string { return `"` + strings.ReplaceAll(name, `"`, `""`) + `"` }

// Seen tells whether key was recorded and is not past its time (by this process's
// clock, as Record's times are).
func (s *Store) Seen(ctx context.Context, key string) (bool, error) {
	var seen bool
	if err := s.db.QueryRowContext(ctx, s.seen, key, time.Now()).Scan(&seen); err != nil {
		return false, fmt.Errorf("pgdedup: %w", err)
	}
	return seen, nil
}

// Record records key until the time given; recording it again moves its time. One
// call in 1,000 also deletes up to 1,000 rows past their time.
func (s *Store) Record(ctx context.Context, key string, until time.Time) error {
	if _, err := s.db.ExecContext(ctx, s.record, key, until); err != nil {
		return fmt.Errorf("pgdedup: %w", err)
	}
	if s.records.Add(1)%purgeEvery == 0 {
		// A deletion that fails is tried again 1,000 Records later: rows past their
		// time are never seen (Seen compares), they only take room meanwhile.
		_, _ = s.db.ExecContext(ctx, s.expire, time.Now())
	}
	return nil
}
