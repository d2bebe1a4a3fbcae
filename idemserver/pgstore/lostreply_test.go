package pgstore

import (
	"context"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

func TestCompleteWhoseReplyWasLost(t *testing.T) {
	// The server stores the response, and its answer is lost before it
	// reaches the store: the connection is cut, and database/sql sends the
	// completion again on another connection, or a pooler answers with an
	// error of its own, and the middleware sends it again. Either way the
	// completion sent again finds its own response stored under its token,
	// and the client gets the handler's response, as every retry will, not
	// a 503 that says the key was lost. So it does when the middleware
	// completes through Store.Complete, as it does for a store that wraps
	// this one in a named field: the response, whose header fields are in
	// a map, is stored in the same bytes each time.
	packed := func(s *Store) idemserver.Store { return s }
	named := func(s *Store) idemserver.Store { return namedStore{s} }
	pooler := errorResponse("08P01", "server conn crashed?")
	for _, tt := range []struct {
		name   string
		wrap   func(*Store) idemserver.Store
		answer []byte // the store's answer in place of the server's, if any
	}{
		{"connection cut", packed, nil},
		{"connection cut, Store.Complete", named, nil},
		{"answered by a pooler", packed, pooler},
		{"answered by a pooler, Store.Complete", named, pooler},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			store, proxy := proxiedStore(t, db, db.newStore(t).table.name)
			proxy.cutAt = "update" // the complete; the claim is a WITH
			proxy.answer = tt.answer

			var runs atomic.Int64
			var events []idemserver.Event
			h := idemserver.Middleware(tt.wrap(store), idemserver.WithObserver(func(e idemserver.Event) { events = append(events, e) }))(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					proxy.armed.Store(true) // this request's completion loses its answer
					for i := range 12 {
						w.Header().Set("X-Field-"+strconv.Itoa(i), "v")
					}
					w.WriteHeader(http.StatusCreated)
					_, _ = io.WriteString(w, "created")
				}))
			// Several keys, so that a map that happens to be walked in the
			// same order twice does not hide a difference.
			for i := range 4 {
				key := "k" + strconv.Itoa(i)
				events = nil
				proxy.cut.Store(false)
				status, body, replayed := post(h, key)
				require.True(t, proxy.cut.Load(), "the completion went through the proxy")
				assert.Equal(t, http.StatusCreated, status, body)
				assert.Equal(t, "created", body)
				assert.False(t, replayed)
				require.Len(t, events, 1)
				assert.Equal(t, idemserver.OutcomeExecuted, events[0].Outcome)
				assert.NotErrorIs(t, events[0].Err, idemserver.ErrLeaseLost)

				status, body, replayed = post(h, key)
				assert.Equal(t, http.StatusCreated, status, body)
				assert.Equal(t, "created", body)
				assert.True(t, replayed)
				assert.Equal(t, int64(i+1), runs.Load())
			}
		})
	}
}

// proxiedStore returns a lease-mode store over table whose connections go
// through a commitCutter, which it returns, armed by the caller: the
// store's statements go as simple queries, which the proxy reads.
func proxiedStore(t *testing.T, db *testDB, table string) (*Store, *commitCutter) {
	t.Helper()
	cfg, err := pgx.ParseConfig(db.dsn)
	require.NoError(t, err)
	proxy := newCommitCutter(t, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), true)
	cfg.Host, cfg.Port = "127.0.0.1", uint16(proxy.ln.Addr().(*net.TCPAddr).Port)
	cfg.RuntimeParams["search_path"] = db.schema
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	pool := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = pool.Close() })
	store, err := New(pool, WithTable(table))
	require.NoError(t, err)
	return store, proxy
}

func TestClaimWhoseReplyWasLost(t *testing.T) {
	// The server claims the key, and its answer is lost before it reaches
	// the store: the connection is cut, and database/sql sends the claim
	// again on another connection. The claim sent again finds the row its
	// first run wrote, in progress under its own token, which no other
	// claim has: it is this request's claim, and the handler runs. Taken
	// for another request's claim, it would answer 409, and every retry
	// would get 409 too, until the lease that no one holds ran out.
	for _, tt := range []struct {
		name string
		row  string // the row of the key before the request, if any
		cut  string // the statement whose answer is lost
	}{
		{"new key", "", "with"},
		{"takeover of an ended lease", `INSERT INTO {table} (scope, key, fingerprint, token, expires_at, sweep_at)
			VALUES ('', 'k', $1, 'dead', now() - interval '1 second', now() + interval '1 hour')`, "update"},
		{"replacement of an expired record", `INSERT INTO {table} (scope, key, fingerprint, token, expires_at, response, sweep_at)
			VALUES ('', 'k', $1, 'old', now() - interval '1 second', '\x01', now() + interval '1 hour')`, "update"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			store, proxy := proxiedStore(t, db, db.newStore(t).table.name)
			proxy.cutAt = tt.cut
			if tt.row != "" {
				_, err := db.ExecContext(t.Context(), strings.ReplaceAll(tt.row, "{table}", store.table.quoted()), fingerprintOf("b"))
				require.NoError(t, err)
			}
			var runs atomic.Int64
			h := idemserver.Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, "created")
			}))
			proxy.armed.Store(true)
			status, body, replayed := post(h, "k")
			require.True(t, proxy.cut.Load(), "the claim went through the proxy")
			assert.Equal(t, http.StatusCreated, status, body)
			assert.False(t, replayed)
			assert.Equal(t, int64(1), runs.Load())

			status, body, replayed = post(h, "k")
			assert.Equal(t, http.StatusCreated, status, body)
			assert.Equal(t, "created", body)
			assert.True(t, replayed)
			assert.Equal(t, int64(1), runs.Load())
		})
	}
}

// namedStore holds a Store in a named field, as a wrapper that adds
// something of its own to each method (metrics, tracing) does, so that the
// middleware sees none of the store's optional interfaces: no PackedStore,
// so it calls Claim, TakeOver and Complete, and no ResponseHolder.
type namedStore struct{ s *Store }

func (n namedStore) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	return n.s.Claim(ctx, c)
}

func (n namedStore) TakeOver(ctx context.Context, c idemserver.Claim, expiredToken string) (idemserver.ClaimResult, error) {
	return n.s.TakeOver(ctx, c, expiredToken)
}

func (n namedStore) Complete(ctx context.Context, key idemserver.Key, token string, resp *idemserver.Response, expires time.Time) error {
	return n.s.Complete(ctx, key, token, resp, expires)
}

func (n namedStore) Release(ctx context.Context, key idemserver.Key, token string) error {
	return n.s.Release(ctx, key, token)
}

func (n namedStore) Extend(ctx context.Context, key idemserver.Key, token string, leaseExpires time.Time) error {
	return n.s.Extend(ctx, key, token, leaseExpires)
}

func TestBackendTerminatedBetweenClaimAndEnd(t *testing.T) {
	// The store's connections are terminated by the server
	// (pg_terminate_backend) while the handler runs, after the claim:
	// ending the claim takes a new connection. A handler that acted has its
	// response stored and replayed; one that failed has its claim released,
	// so that the retry runs it again.
	for _, tt := range []struct {
		name   string
		status int
		runs   int64 // after the first request and its retry
	}{
		{"handler acted", http.StatusCreated, 1},
		{"handler failed", http.StatusInternalServerError, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			table := db.newStore(t).table.name
			cfg, err := pgx.ParseConfig(db.dsn)
			require.NoError(t, err)
			cfg.RuntimeParams["search_path"] = db.schema
			cfg.RuntimeParams["application_name"] = db.schema
			pool := stdlib.OpenDB(*cfg)
			t.Cleanup(func() { _ = pool.Close() })
			store, err := New(pool, WithTable(table))
			require.NoError(t, err)

			var runs atomic.Int64
			h := idemserver.Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				status := tt.status
				if runs.Add(1) > 1 {
					status = http.StatusCreated
				}
				var killed int
				err := db.QueryRowContext(r.Context(), `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`,
					db.schema).Scan(&killed)
				if !assert.NoError(t, err) || !assert.Positive(t, killed, "the claim's connection was terminated") {
					status = http.StatusServiceUnavailable
				}
				// pg_terminate_backend only signals: wait until the
				// backends are gone.
				assert.Eventually(t, func() bool {
					var left int
					err := db.QueryRowContext(r.Context(), `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, db.schema).Scan(&left)
					return err == nil && left == 0
				}, 10*time.Second, time.Millisecond)
				w.WriteHeader(status)
				_, _ = io.WriteString(w, "run "+strconv.FormatInt(runs.Load(), 10))
			}))
			status, body, replayed := post(h, "k")
			assert.Equal(t, tt.status, status, body)
			assert.Equal(t, "run 1", body)
			assert.False(t, replayed)

			status, body, _ = post(h, "k")
			assert.Equal(t, http.StatusCreated, status, body)
			assert.Equal(t, "run "+strconv.FormatInt(tt.runs, 10), body)
			assert.Equal(t, tt.runs, runs.Load())
			status, body, replayed = post(h, "k")
			assert.Equal(t, http.StatusCreated, status, body)
			assert.Equal(t, "run "+strconv.FormatInt(tt.runs, 10), body)
			assert.True(t, replayed)
		})
	}
}
