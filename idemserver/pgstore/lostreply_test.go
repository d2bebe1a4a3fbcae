package pgstore

import (
	"io"
	"net"
	"net/http"
	"strconv"
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
	// The connection is lost after the server stored the response and
	// before its answer reached the store. The middleware sends the
	// completion again, on another connection: it finds its own response
	// stored under its token, and the client gets the handler's response,
	// as every retry will, not a 503 that says the key was lost.
	db := newTestDB(t, 4)
	table := db.newStore(t).table.name
	cfg, err := pgx.ParseConfig(db.dsn)
	require.NoError(t, err)
	proxy := newCommitCutter(t, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), true)
	proxy.cutAt = "update" // the complete; the claim is a WITH
	cfg.Host, cfg.Port = "127.0.0.1", uint16(proxy.ln.Addr().(*net.TCPAddr).Port)
	cfg.RuntimeParams["search_path"] = db.schema
	// Statements go as simple queries, which the proxy reads.
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	pool := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = pool.Close() })
	store, err := New(pool, WithTable(table))
	require.NoError(t, err)

	var runs atomic.Int64
	var events []idemserver.Event
	h := idemserver.Middleware(store, idemserver.WithObserver(func(e idemserver.Event) { events = append(events, e) }))(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			proxy.armed.Store(true) // this request's completion loses its answer
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "created")
		}))
	status, body, replayed := post(h, "k")
	require.True(t, proxy.cut.Load(), "the completion went through the proxy")
	assert.Equal(t, http.StatusCreated, status, body)
	assert.Equal(t, "created", body)
	assert.False(t, replayed)
	require.Len(t, events, 1)
	assert.Equal(t, idemserver.OutcomeExecuted, events[0].Outcome)
	assert.NotErrorIs(t, events[0].Err, idemserver.ErrLeaseLost)

	status, body, replayed = post(h, "k")
	assert.Equal(t, http.StatusCreated, status, body)
	assert.Equal(t, "created", body)
	assert.True(t, replayed)
	assert.Equal(t, int64(1), runs.Load())
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
