package pgstore

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/internal/cputime"
)

// BenchmarkPaths measures the middleware over each store, and a
// hand-written floor, on three paths: new keys, replays (of 200 completed
// keys), and a hot key (the clients on ten completed keys). The handler
// does one INSERT of its own. Every column, the floor included, is driven
// by the same lean harness (see [client]): requests and ResponseWriters
// made once and reused, keys made before the clock starts, so that what
// differs between columns is the middleware and the store. Besides ns/op
// it reports the 99th percentile latency, the statements sent to the
// database and the WAL written, per request, req/s, the allocations of the
// whole process per request, and the CPU time per request of this process
// (cpu-ns/op) and of the PostgreSQL server (pg-cpu-ns/op, when the server
// runs on this machine and its data directory can be read; see
// serverCPU). Run it with
//
//	scripts/with-postgres.sh go test -run '^$' -bench BenchmarkPaths -benchtime 2000x -count 3 ./idemserver/pgstore/
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
					// The keys are made before the clock starts.
					n := b.N
					switch path {
					case "replay":
						n = replayKeys
					case "hot":
						n = 10
					}
					keys := make([]string, n)
					for i := range keys {
						keys[i] = prefix + strconv.Itoa(i)
					}
					if path != "new" {
						setup := newClient()
						for _, key := range keys {
							setup.serve(b, h, key)
						}
					}
					measure(b, db, c, func(cl *client, i int) { cl.serve(b, h, keys[i%len(keys)]) })
				})
			}
		}
	}
}

// replayKeys is how many completed keys the replay path cycles through.
const replayKeys = 200

// requestBody is the body of every request the benchmark sends.
const requestBody = `{"amount":100}`

// A client sends the benchmark's requests, one at a time, to a handler in
// process. Its request, body and ResponseWriter are made once and reused,
// so that the harness costs every column the same, and little: it builds
// no request from text and allocates nothing per request.
type client struct {
	r    http.Request
	body reusableBody
	key  [1]string
	w    statusWriter
}

func newClient() *client {
	c := &client{w: statusWriter{header: make(http.Header)}}
	c.r = http.Request{
		Method: http.MethodPost, URL: &url.URL{Path: "/items"}, RequestURI: "/items", Host: "example.com",
		Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {"application/json"}}, ContentLength: int64(len(requestBody)),
	}
	return c
}

// serve sends a POST with key to h and fails unless it succeeds.
func (c *client) serve(b *testing.B, h http.Handler, key string) {
	c.body.Reset(requestBody)
	c.r.Body = &c.body
	c.key[0] = key
	c.r.Header["Idempotency-Key"] = c.key[:]
	clear(c.w.header)
	c.w.status = 0
	h.ServeHTTP(&c.w, &c.r)
	if c.w.status != http.StatusCreated {
		b.Errorf("key %s: status %d", key, c.w.status)
	}
}

// reusableBody is a request body that can be read again after a Reset.
type reusableBody struct{ strings.Reader }

func (*reusableBody) Close() error { return nil }

// statusWriter is a ResponseWriter that keeps the status and drops the
// body.
type statusWriter struct {
	header http.Header
	status int
}

func (w *statusWriter) Header() http.Header { return w.header }
func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}
func (w *statusWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return len(p), nil
}

// measure runs b.N calls of do, on c goroutines with a client each, and
// reports the 99th percentile latency, and the database statements and WAL
// bytes per call.
func measure(b *testing.B, db *testDB, c int, do func(cl *client, i int)) {
	var next atomic.Int64
	lat := make([][]time.Duration, c)
	for g := range lat {
		lat[g] = make([]time.Duration, 0, b.N/c+1)
	}
	clients := make([]*client, c)
	for g := range clients {
		clients[g] = newClient()
	}
	wal := walPosition(b, db.DB)
	calls := db.calls.Load()
	server, serverOK := serverCPU(db.DB)
	b.ReportAllocs()
	cpu := cputime.Start()
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
				do(clients[g], i)
				lat[g] = append(lat[g], time.Since(start))
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	cpu.Report(b, b.N)
	if end, ok := serverCPU(db.DB); ok && serverOK {
		b.ReportMetric(float64((end-server).Nanoseconds())/float64(b.N), "pg-cpu-ns/op")
	}
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
