package pgstore

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// BenchmarkPaths measures the middleware over each store, and a
// hand-written floor, on three paths: new keys, replays (of 200 completed
// keys), and a hot key (the clients on ten completed keys). The handler does one INSERT of its own.
// Besides ns/op it reports the 99th percentile latency, the statements sent
// to the database and the WAL written, per request. Run it with
//
//	scripts/with-postgres.sh go test -run '^$' -bench BenchmarkPaths -benchtime 2s ./idemserver/pgstore/
func BenchmarkPaths(b *testing.B) {
	db := newTestDB(b, 80)
	_, err := db.ExecContext(b.Context(), "CREATE TABLE items (key text NOT NULL)")
	require.NoError(b, err)
	_, err = db.ExecContext(b.Context(), "CREATE TABLE floor_keys (key text PRIMARY KEY, status int, body bytea)")
	require.NoError(b, err)

	insert := func(ctx context.Context, q querier, key string) error {
		_, err := q.ExecContext(ctx, "INSERT INTO items (key) VALUES ($1)", key)
		return err
	}
	handler := func(w http.ResponseWriter, r *http.Request) {
		var q querier = db.DB
		if tx := Tx(r.Context()); tx != nil {
			q = tx
		}
		if err := insert(r.Context(), q, r.Header.Get("Idempotency-Key")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"0123456789abcdef","status":"created"}`))
	}
	stores := []struct {
		name string
		new  func() http.Handler
	}{
		{"floor", func() http.Handler { return &floor{db: db.DB, next: http.HandlerFunc(handler)} }},
		{"memory", func() http.Handler {
			return idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(handler))
		}},
		{"lease", func() http.Handler { return idemserver.Middleware(db.newStore(b))(http.HandlerFunc(handler)) }},
		{"transactional", func() http.Handler {
			return idemserver.Middleware(db.newStore(b, WithTransactional()))(http.HandlerFunc(handler))
		}},
	}
	var run atomic.Int64
	for _, path := range []string{"new", "replay", "hot"} {
		for _, c := range []int{1, 16, 64} {
			for _, st := range stores {
				b.Run(fmt.Sprintf("path=%s/C=%d/store=%s", path, c, st.name), func(b *testing.B) {
					h := st.new()
					prefix := "r" + strconv.FormatInt(run.Add(1), 10) + "-"
					keyOf := func(i int) string { return prefix + strconv.Itoa(i) }
					switch path {
					case "replay":
						for i := range replayKeys {
							serveKey(b, h, keyOf(i))
						}
						keyOf = func(i int) string { return prefix + strconv.Itoa(i%replayKeys) }
					case "hot":
						for i := range 10 {
							serveKey(b, h, keyOf(i))
						}
						keyOf = func(i int) string { return prefix + strconv.Itoa(i%10) }
					}
					measure(b, db, c, func(i int) { serveKey(b, h, keyOf(i)) })
				})
			}
		}
	}
}

// replayKeys is how many completed keys the replay path cycles through.
const replayKeys = 200

// serveKey serves a POST with key and fails unless it succeeds.
func serveKey(b *testing.B, h http.Handler, key string) {
	r := httptest.NewRequest(http.MethodPost, "/items", strings.NewReader(`{"amount":100}`))
	r.Header.Set("Idempotency-Key", key)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusCreated {
		b.Errorf("key %s: status %d: %s", key, w.Code, w.Body)
	}
}

// measure runs b.N calls of do, on c goroutines, and reports the 99th
// percentile latency, and the database statements and WAL bytes per call.
func measure(b *testing.B, db *testDB, c int, do func(i int)) {
	var next atomic.Int64
	lat := make([][]time.Duration, c)
	wal := walPosition(b, db.DB)
	calls := db.calls.Load()
	b.ResetTimer()
	var wg sync.WaitGroup
	for g := range c {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= b.N {
					return
				}
				start := time.Now()
				do(i)
				lat[g] = append(lat[g], time.Since(start))
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	walBytes := walPosition(b, db.DB) - wal
	calls = db.calls.Load() - calls - 1 // less walPosition's own
	all := slices.Concat(lat...)
	slices.Sort(all)
	b.ReportMetric(float64(all[len(all)*99/100].Microseconds()), "p99-µs")
	b.ReportMetric(float64(calls)/float64(b.N), "stmts/op")
	b.ReportMetric(float64(walBytes)/float64(b.N), "WAL-B/op")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
}

// walPosition returns the server's current WAL position, in bytes.
func walPosition(b *testing.B, db *sql.DB) int64 {
	var pos int64
	require.NoError(b, db.QueryRow("SELECT pg_current_wal_lsn() - '0/0'").Scan(&pos))
	return pos
}

// floor is the textbook middleware the benchmark compares with: a claim or
// read in one statement, the handler, then an UPDATE of the response; no
// fingerprint, no header fields, no lease.
type floor struct {
	db   *sql.DB
	next http.Handler
}

const floorClaim = `WITH ins AS (
	INSERT INTO floor_keys (key) VALUES ($1) ON CONFLICT DO NOTHING RETURNING true AS claimed
)
SELECT claimed, NULL::int, NULL::bytea FROM ins
UNION ALL
SELECT false, status, body FROM floor_keys WHERE key = $1 AND NOT EXISTS (SELECT FROM ins)`

func (f *floor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	var (
		claimed bool
		status  sql.NullInt64
		body    []byte
		err     error
	)
	for range 3 {
		err = f.db.QueryRowContext(r.Context(), floorClaim, key).Scan(&claimed, &status, &body)
		if err != sql.ErrNoRows {
			break
		}
	}
	switch {
	case err != nil:
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
	case claimed:
		rec := &floorRecorder{header: make(http.Header)}
		f.next.ServeHTTP(rec, r)
		if _, err := f.db.ExecContext(r.Context(), "UPDATE floor_keys SET status = $2, body = $3 WHERE key = $1",
			key, rec.status, rec.body.Bytes()); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(rec.status)
		_, _ = w.Write(rec.body.Bytes())
	case !status.Valid:
		http.Error(w, "in progress", http.StatusConflict)
	default:
		w.WriteHeader(int(status.Int64))
		_, _ = w.Write(body)
	}
}

type floorRecorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (r *floorRecorder) Header() http.Header { return r.header }
func (r *floorRecorder) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
}
func (r *floorRecorder) Write(p []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.body.Write(p)
}
