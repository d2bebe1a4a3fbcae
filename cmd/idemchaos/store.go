package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/pgstore"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

// storeNames lists the values of -store, for messages.
const storeNames = "memory, postgres, postgres-tx or redis"

// Where the -dsn and -redis flags take their defaults from, in order.
var (
	dsnVariables   = []string{"IDEMHTTP_POSTGRES_DSN", "IDEMHTTP_TEST_POSTGRES_DSN"}
	redisVariables = []string{"IDEMHTTP_TEST_REDIS_ADDR"}
)

// dsnEnv carries the DSN to the server children, so that a password in it
// does not show in the process list.
const dsnEnv = "IDEMCHAOS_DSN"

// serverLease is the lease of the server's claims. A server killed
// mid-handler leaves its claims in progress until their leases end, and
// every retry of them gets 409 until then; a short lease keeps those waits
// short. It is still many times the store's round trip, so a live
// handler's renewals (every third of a lease) keep its claims.
const serverLease = 3 * time.Second

// storeSpec says which store a run uses and where it lives.
type storeSpec struct {
	name      string // memory, postgres, postgres-tx or redis
	dsn       string // the PostgreSQL stores'
	redisAddr string // the Redis store's
	// space is the run's own part of the database: a schema for the
	// PostgreSQL stores, a key prefix for Redis. Each run makes a new one
	// and removes it at the end, so runs never see each other's keys.
	space string
}

// check refuses a spec that cannot work, before anything is started.
func (s storeSpec) check() error {
	switch s.name {
	case "memory":
		return nil
	case "postgres", "postgres-tx":
		if s.dsn == "" {
			return fmt.Errorf("-store %s needs a database: pass -dsn or set %s", s.name, dsnVariables[0])
		}
		return nil
	case "redis":
		if s.redisAddr == "" {
			return fmt.Errorf("-store redis needs a server: pass -redis host:port or set %s", redisVariables[0])
		}
		return nil
	}
	return fmt.Errorf("unknown -store %q: want %s", s.name, storeNames)
}

// persistent reports whether the store keeps its keys when the server
// process dies, so that the server may be killed and restarted.
func (s storeSpec) persistent() bool { return s.name != "memory" }

// transactional reports whether the handler's effect commits with the
// claim: then the payments table is the ledger.
func (s storeSpec) transactional() bool { return s.name == "postgres-tx" }

// newSpace returns a name for a run's space, unique to the run.
func newSpace() string {
	var b [6]byte
	_, _ = rand.Read(b[:]) // never fails
	return "idemchaos_" + hex.EncodeToString(b[:])
}

// prepare makes the run's space: for PostgreSQL a schema holding the
// store's table and, for postgres-tx, the payments table; for Redis it
// checks that the server answers. The function it returns removes the
// space and everything in it.
func (s storeSpec) prepare(ctx context.Context) (remove func() error, err error) {
	switch s.name {
	case "postgres", "postgres-tx":
		db, err := openDB(ctx, s.dsn)
		if err != nil {
			return nil, err
		}
		defer db.Close()
		schema := pgx.Identifier{s.space}.Sanitize()
		stmts := []string{"CREATE SCHEMA " + schema}
		if s.transactional() {
			stmts = append(stmts, "CREATE TABLE "+schema+`.payments (
				id     bigserial PRIMARY KEY,
				op     text   NOT NULL,
				key    text   NOT NULL,
				server bigint NOT NULL)`)
		}
		for _, q := range stmts {
			if _, err := db.ExecContext(ctx, q); err != nil {
				return nil, fmt.Errorf("PostgreSQL: %w", err)
			}
		}
		remove = func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			db, err := openDB(ctx, s.dsn)
			if err != nil {
				return err
			}
			defer db.Close()
			_, err = db.ExecContext(ctx, "DROP SCHEMA "+schema+" CASCADE")
			return err
		}
		store, err := s.openPG(db)
		if err == nil {
			err = store.Migrate(ctx)
		}
		if err != nil {
			return nil, errors.Join(err, remove())
		}
		return remove, nil
	case "redis":
		client, err := s.redis(ctx)
		if err != nil {
			return nil, err
		}
		defer client.Close()
		return func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			client, err := s.redis(ctx)
			if err != nil {
				return err
			}
			defer client.Close()
			return deletePrefixed(ctx, client, s.redisPrefix())
		}, nil
	}
	return func() error { return nil }, nil
}

// openStore returns the server's store, and a function that closes it. It
// is the one place a store is chosen; a new store is a case here, in check
// and in prepare.
func (s storeSpec) openStore(ctx context.Context) (idemserver.Store, func() error, error) {
	switch s.name {
	case "memory":
		st := idemserver.NewMemoryStore()
		return st, st.Close, nil
	case "postgres", "postgres-tx":
		db, err := openDB(ctx, s.dsn)
		if err != nil {
			return nil, nil, err
		}
		st, err := s.openPG(db)
		if err != nil {
			db.Close()
			return nil, nil, err
		}
		return st, db.Close, nil
	case "redis":
		client, err := s.redis(ctx)
		if err != nil {
			return nil, nil, err
		}
		return redisstore.New(client, redisstore.WithPrefix(s.redisPrefix())), client.Close, nil
	}
	return nil, nil, s.check()
}

func (s storeSpec) openPG(db *sql.DB) (*pgstore.Store, error) {
	opts := []pgstore.Option{pgstore.WithTable(s.space + ".idempotency_keys")}
	if s.transactional() {
		opts = append(opts, pgstore.WithTransactional())
	}
	return pgstore.New(db, opts...)
}

// paymentsTable is the quoted name of the postgres-tx payments table.
func (s storeSpec) paymentsTable() string {
	return pgx.Identifier{s.space, "payments"}.Sanitize()
}

// payments reads the payments table of a postgres-tx run, in the order the
// rows were inserted, as ledger entries.
func (s storeSpec) payments(ctx context.Context) ([]entry, error) {
	db, err := openDB(ctx, s.dsn)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	rows, err := db.QueryContext(ctx, "SELECT op, key, server FROM "+s.paymentsTable()+" ORDER BY id")
	if err != nil {
		return nil, fmt.Errorf("payments table: %w", err)
	}
	defer rows.Close()
	var entries []entry
	for rows.Next() {
		e := entry{kind: kindCharged}
		if err := rows.Scan(&e.op, &e.key, &e.server); err != nil {
			return nil, fmt.Errorf("payments table: %w", err)
		}
		entries = append(entries, e)
	}
	return entries, rows.Err()
}

// redis connects to the Redis server and checks that it answers.
func (s storeSpec) redis(ctx context.Context) (*redis.Client, error) {
	client := redis.NewClient(&redis.Options{Addr: s.redisAddr, DialTimeout: 5 * time.Second, ContextTimeoutEnabled: true})
	if err := client.Ping(ctx).Err(); err != nil {
		client.Close()
		return nil, fmt.Errorf("no answer from Redis at %s: %w", s.redisAddr, err)
	}
	return client, nil
}

func (s storeSpec) redisPrefix() string { return s.space + ":" }

// prefixed returns the Redis keys that start with prefix, which holds no
// glob characters.
func prefixed(ctx context.Context, client *redis.Client, prefix string) ([]string, error) {
	iter := client.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	return keys, iter.Err()
}

// deletePrefixed deletes the Redis keys that start with prefix.
func deletePrefixed(ctx context.Context, client *redis.Client, prefix string) error {
	keys, err := prefixed(ctx, client, prefix)
	if err != nil {
		return err
	}
	for len(keys) > 0 {
		n := min(len(keys), 1000)
		if err := client.Del(ctx, keys[:n]...).Err(); err != nil {
			return err
		}
		keys = keys[n:]
	}
	return nil
}

// openDB connects to the PostgreSQL at dsn and checks that it answers.
func openDB(ctx context.Context, dsn string) (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("-dsn: %w", err)
	}
	cfg.ConnectTimeout = 5 * time.Second
	db := stdlib.OpenDB(*cfg)
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("PostgreSQL at %s:%d: %w", cfg.Host, cfg.Port, err)
	}
	return db, nil
}

// envDefault returns the value of the first of the variables that is set.
func envDefault(variables []string) string {
	for _, v := range variables {
		if s := os.Getenv(v); s != "" {
			return s
		}
	}
	return ""
}
