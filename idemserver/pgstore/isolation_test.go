package pgstore

import (
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// isolationLevels are the values of default_transaction_isolation that a
// database may be given.
var isolationLevels = []string{"read committed", "repeatable read", "serializable"}

// openAtLevel returns another pool on the test's schema whose
// transactions, the implicit one of each statement included, run at the
// isolation level given, as under a database whose
// default_transaction_isolation is set so.
func (db *testDB) openAtLevel(t testing.TB, level string) *sql.DB {
	t.Helper()
	cfg, err := pgx.ParseConfig(db.dsn)
	require.NoError(t, err)
	cfg.RuntimeParams["search_path"] = db.schema
	cfg.RuntimeParams["default_transaction_isolation"] = level
	pool := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = pool.Close() })
	return pool
}

func TestLeaseModeUnderEachIsolationLevel(t *testing.T) {
	// Under read committed, a lease-mode statement that meets a row
	// changed after its snapshot (by a takeover or a sweep that committed
	// meanwhile) re-checks the row's latest version. Under repeatable read
	// or serializable, a database's default for a payments service as
	// often as not, it fails with a serialization failure instead, having
	// changed nothing. Each statement must then give the answer it gives
	// under read committed, not an error: the claim reports the row that
	// won, and Complete, Extend and Release report the lease lost.
	type step struct {
		name string
		// row is the row of key 'k' before the other transaction's
		// write, with the token 'mine'.
		row string
		// run runs the store's statement, which waits for the other
		// transaction's write, and checks its answer (on a goroutine of
		// its own: with assert, not require).
		run func(t *testing.T, s *Store)
	}
	mine := idemserver.Key{Key: "k"}
	// endedLease is a claim of 'mine' whose lease has ended.
	const endedLease = `INSERT INTO {table} (scope, key, fingerprint, token, expires_at, sweep_at)
	VALUES ('', 'k', $1, 'mine', now() - interval '1 second', now() - interval '1 second')`
	steps := []step{
		{"claim of an expired record meets its replacement",
			`INSERT INTO {table} (scope, key, fingerprint, token, expires_at, response, sweep_at)
			VALUES ('', 'k', $1, 'mine', now() - interval '1 second', '\x01', now() - interval '1 second')`,
			func(t *testing.T, s *Store) {
				res, err := s.Claim(t.Context(), testClaim("k", time.Hour))
				if !assert.NoError(t, err) {
					return
				}
				assert.False(t, res.Claimed, "the key was claimed by the other transaction")
				assert.Equal(t, "other", res.Record.Token)
			}},
		{"takeover meets another takeover",
			endedLease,
			func(t *testing.T, s *Store) {
				res, err := s.TakeOver(t.Context(), testClaim("k", time.Hour), "mine")
				if !assert.NoError(t, err) {
					return
				}
				assert.False(t, res.Claimed, "the key was taken over by the other transaction")
				assert.Equal(t, "other", res.Record.Token)
			}},
		{"complete meets a takeover",
			endedLease,
			func(t *testing.T, s *Store) {
				err := s.Complete(t.Context(), mine, "mine", &idemserver.Response{Status: 201}, time.Now().Add(time.Hour))
				assert.ErrorIs(t, err, idemserver.ErrLeaseLost)
			}},
		{"extend meets a takeover",
			endedLease,
			func(t *testing.T, s *Store) {
				assert.ErrorIs(t, s.Extend(t.Context(), mine, "mine", time.Now().Add(time.Hour)), idemserver.ErrLeaseLost)
			}},
		{"release meets a takeover",
			endedLease,
			func(t *testing.T, s *Store) {
				assert.ErrorIs(t, s.Release(t.Context(), mine, "mine"), idemserver.ErrLeaseLost)
			}},
	}
	// The other instance's takeover, left uncommitted while the store's
	// statement waits for the row.
	const takeover = `UPDATE {table} SET token = 'other', expires_at = now() + interval '1 hour', response = NULL,
	sweep_at = now() + interval '2 hours' WHERE key = 'k'`
	for _, level := range isolationLevels {
		t.Run(level, func(t *testing.T) {
			db := newTestDB(t, 4)
			pool := db.openAtLevel(t, level)
			for _, st := range steps {
				t.Run(st.name, func(t *testing.T) {
					s, err := New(pool, WithTable(db.newStore(t).table.name))
					require.NoError(t, err)
					table := strings.NewReplacer("{table}", s.table.quoted())
					_, err = db.ExecContext(t.Context(), table.Replace(st.row), fingerprintOf("b"))
					require.NoError(t, err)

					other, err := db.BeginTx(t.Context(), nil)
					require.NoError(t, err)
					defer func() { _ = other.Rollback() }()
					_, err = other.ExecContext(t.Context(), table.Replace(takeover))
					require.NoError(t, err)

					done := make(chan struct{})
					go func() {
						defer close(done)
						st.run(t, s)
					}()
					waitForLockWait(t, db.DB)
					require.NoError(t, other.Commit())
					<-done
					assert.Equal(t, []string{"other"}, queryStrings(t, db.DB, "SELECT token FROM "+s.table.quoted()),
						"the other instance's claim stays")
				})
			}

		})
	}
}
