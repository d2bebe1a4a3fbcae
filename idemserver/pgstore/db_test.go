package pgstore

import (
	"context"
	"crypto/rand"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"fmt"
	"os"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// dsnVariable names the PostgreSQL server the tests use. Without it they
// skip; scripts/with-postgres.sh starts a server and sets it.
const dsnVariable = "IDEMHTTP_TEST_POSTGRES_DSN"

// testDB is a database schema of one test's own, dropped when it ends, and
// a connection pool whose search_path is that schema.
type testDB struct {
	*sql.DB
	dsn    string
	schema string
	// calls counts the statements the pool sent: queries, execs, and the
	// begin, commit and rollback of transactions.
	calls *atomic.Int64
	// badBegins is how many of the next BEGINs the pool's connections
	// fail with driver.ErrBadConn, as a connection found dead does.
	badBegins *atomic.Int64
	tables    atomic.Int64
}

// newTestDB returns a testDB, or skips the test when no server is named.
// The pool holds at most maxConns connections.
func newTestDB(t testing.TB, maxConns int) *testDB {
	t.Helper()
	dsn := os.Getenv(dsnVariable)
	if dsn == "" {
		t.Skipf("%s is not set; scripts/with-postgres.sh runs the tests with a throwaway PostgreSQL", dsnVariable)
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema := "idemtest_" + hex.EncodeToString(b)
	admin, err := sql.Open("pgx", dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	_, err = admin.ExecContext(t.Context(), "CREATE SCHEMA "+schema)
	require.NoError(t, err, "%s names a server that does not answer", dsnVariable)
	t.Cleanup(func() {
		_, err := admin.ExecContext(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		require.NoError(t, err)
	})

	db := &testDB{dsn: dsn, schema: schema, calls: new(atomic.Int64), badBegins: new(atomic.Int64)}
	db.DB = db.open(t, maxConns)
	return db
}

// open returns another pool on the test's schema, closed when it ends.
func (db *testDB) open(t testing.TB, maxConns int) *sql.DB {
	t.Helper()
	cfg, err := pgx.ParseConfig(db.dsn)
	require.NoError(t, err)
	cfg.RuntimeParams["search_path"] = db.schema
	connector := stdlib.GetConnector(*cfg,
		// A ping before reusing an idle connection would be a round trip
		// of its own, and not the store's.
		stdlib.OptionShouldPing(func(context.Context, stdlib.ShouldPingParams) bool { return false }))
	pool := sql.OpenDB(&countingConnector{Connector: connector, calls: db.calls, badBegins: db.badBegins})
	pool.SetMaxOpenConns(maxConns)
	pool.SetMaxIdleConns(maxConns)
	t.Cleanup(func() { _ = pool.Close() })
	return pool
}

// newStore returns a store over a new table of the test's schema.
func (db *testDB) newStore(t testing.TB, opts ...Option) *Store {
	t.Helper()
	name := fmt.Sprintf("keys_%d", db.tables.Add(1))
	s, err := New(db.DB, append([]Option{WithTable(name)}, opts...)...)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	return s
}

// countingConnector counts the statements its connections send, and
// fails the BEGINs that badBegins asks for.
type countingConnector struct {
	driver.Connector
	calls     *atomic.Int64
	badBegins *atomic.Int64
}

// pgxConn is the driver connection of pgx's stdlib with the optional
// interfaces database/sql looks for.
type pgxConn interface {
	driver.Conn
	driver.ConnBeginTx
	driver.ConnPrepareContext
	driver.ExecerContext
	driver.QueryerContext
	driver.Pinger
	driver.SessionResetter
	driver.NamedValueChecker
}

func (c *countingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &countingConn{pgxConn: conn.(pgxConn), calls: c.calls, badBegins: c.badBegins}, nil
}

type countingConn struct {
	pgxConn
	calls     *atomic.Int64
	badBegins *atomic.Int64
}

func (c *countingConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	c.calls.Add(1)
	return c.pgxConn.QueryContext(ctx, q, args)
}

func (c *countingConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	c.calls.Add(1)
	return c.pgxConn.ExecContext(ctx, q, args)
}

func (c *countingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	for n := c.badBegins.Load(); n > 0; n = c.badBegins.Load() {
		if c.badBegins.CompareAndSwap(n, n-1) {
			return nil, driver.ErrBadConn
		}
	}
	c.calls.Add(1)
	tx, err := c.pgxConn.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &countingTx{Tx: tx, calls: c.calls}, nil
}

type countingTx struct {
	driver.Tx
	calls *atomic.Int64
}

func (t *countingTx) Commit() error {
	t.calls.Add(1)
	return t.Tx.Commit()
}

func (t *countingTx) Rollback() error {
	t.calls.Add(1)
	return t.Tx.Rollback()
}
