package pgstore

import (
	"io"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"

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
