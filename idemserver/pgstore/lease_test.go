package pgstore

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/internal/respcodec"
)

func testClaim(key string, lease time.Duration) idemserver.Claim {
	now := time.Now()
	return idemserver.Claim{Key: idemserver.Key{Key: key}, Fingerprint: [32]byte{1}, Token: "token-" + key,
		Now: now, LeaseExpires: now.Add(lease)}
}

// waitForLockWait polls until a backend of the test's database is waiting
// for a lock, which is where a statement that conflicts with an open
// transaction stops.
func waitForLockWait(t *testing.T, db *sql.DB) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		err := db.QueryRowContext(t.Context(),
			`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`).Scan(&n)
		return err == nil && n > 0
	}, 10*time.Second, time.Millisecond)
}

func TestClaimRerunsWhenItsSnapshotMissesTheRow(t *testing.T) {
	// A claim whose snapshot was taken before a concurrent claim committed
	// the row finds the conflict but cannot read the row: neither half of
	// its statement returns a row. It must run again and report the row,
	// never claim the key a second time or fail.
	fp := make([]byte, 32)
	fp[0] = 1
	resp := respcodec.Encode(&idemserver.Response{Status: 200})
	for _, tt := range []struct {
		name string
		// setup puts a row in the table, or none, before the other
		// transaction writes one.
		setup string
		// write is the other transaction's claim, left uncommitted.
		write string
	}{
		{"insert", "",
			`INSERT INTO {table} VALUES ('', 'k', $1, 'other', now() + interval '1 hour')`},
		{"replace of an expired record", `INSERT INTO {table} VALUES ('', 'k', $1, 'old', now() - interval '1 second', $2)`,
			`UPDATE {table} SET token = 'other', expires_at = now() + interval '1 hour', response = NULL WHERE key = 'k' AND $1::bytea IS NOT NULL`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			s := db.newStore(t)
			reruns := atomic.Int64{}
			s.testHookRerun = func() { reruns.Add(1) }
			table := strings.NewReplacer("{table}", s.table.quoted())
			if tt.setup != "" {
				_, err := db.ExecContext(t.Context(), table.Replace(tt.setup), fp, resp)
				require.NoError(t, err)
			}
			tx, err := db.BeginTx(t.Context(), nil)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback() }()
			_, err = tx.ExecContext(t.Context(), table.Replace(tt.write), fp)
			require.NoError(t, err)

			type result struct {
				res idemserver.ClaimResult
				err error
			}
			done := make(chan result, 1)
			go func() {
				c := testClaim("k", time.Hour)
				c.Fingerprint = idemserver.Fingerprint{1}
				res, err := s.Claim(context.Background(), c)
				done <- result{res, err}
			}()
			waitForLockWait(t, db.DB)
			require.NoError(t, tx.Commit())
			r := <-done
			require.NoError(t, r.err)
			assert.False(t, r.res.Claimed, "the key was claimed by the other transaction")
			assert.Equal(t, "other", r.res.Record.Token)
			assert.Positive(t, reruns.Load(), "the claim ran again")
		})
	}
}

// newCompleted returns a lease-mode store over a new table that holds one
// record, of key, completed with a 201 kept until expires.
func newCompleted(t *testing.T, key string, expires time.Time) (*testDB, *Store) {
	t.Helper()
	db := newTestDB(t, 4)
	s := db.newStore(t)
	c := testClaim(key, time.Hour)
	_, err := s.Claim(t.Context(), c)
	require.NoError(t, err)
	require.NoError(t, s.Complete(t.Context(), c.Key, c.Token, &idemserver.Response{Status: 201}, expires))
	return db, s
}

func TestReplayTakesNoRowLock(t *testing.T) {
	// A replay only reads: a transaction holding the row's lock does not
	// hold it up, as it would an INSERT ... ON CONFLICT DO UPDATE.
	db, s := newCompleted(t, "k", time.Now().Add(time.Hour))

	tx, err := db.BeginTx(t.Context(), nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	_, err = tx.ExecContext(t.Context(), "SELECT 1 FROM "+s.table.quoted()+" WHERE key = 'k' FOR UPDATE")
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	c2 := testClaim("k", time.Hour)
	c2.Token = "replay"
	res, err := s.Claim(ctx, c2)
	require.NoError(t, err, "the replay waited for the row lock")
	require.True(t, res.Record.Completed())
	assert.Equal(t, 201, res.Record.Response.Status)
}

func TestReplayProbesTheKeyOnce(t *testing.T) {
	// The claim reads first: on a replay its insert gets no row to try,
	// so it does not probe the primary key (and the dead entries that
	// completed rows leave there) a second time. The plan, run with
	// ANALYZE, reports what the insert tried.
	db, s := newCompleted(t, "k", time.Now().Add(time.Hour))

	var plan string
	require.NoError(t, db.QueryRowContext(t.Context(), "EXPLAIN (ANALYZE, FORMAT JSON) "+s.stmt().claim,
		[]byte(""), "k", make([]byte, 32), "replay", 60.0, 60.0).Scan(&plan))
	var found bool
	var walk func(node map[string]any)
	walk = func(node map[string]any) {
		if node["Node Type"] == "ModifyTable" {
			found = true
			assert.EqualValues(t, 0, node["Conflicting Tuples"], "the insert tried the row: %v", node)
			assert.EqualValues(t, 0, node["Tuples Inserted"])
		}
		children, _ := node["Plans"].([]any)
		for _, child := range children {
			walk(child.(map[string]any))
		}
	}
	var doc []map[string]any
	require.NoError(t, json.Unmarshal([]byte(plan), &doc))
	walk(doc[0]["Plan"].(map[string]any))
	require.True(t, found, "no insert in the plan:\n%s", plan)

	var n int
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT count(*) FROM "+s.table.quoted()+" WHERE token = 'replay'").Scan(&n))
	assert.Zero(t, n)
}

func TestRoundTrips(t *testing.T) {
	db := newTestDB(t, 4)
	s := db.newStore(t)
	_, err := db.ExecContext(t.Context(), "CREATE TABLE payments (key text)")
	require.NoError(t, err)
	h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := db.ExecContext(r.Context(), "INSERT INTO payments VALUES ($1)", r.Header.Get("Idempotency-Key"))
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	calls := func(key string) int64 {
		before := db.calls.Load()
		w := httptest.NewRecorder()
		r := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader("b"))
		r.Header.Set("Idempotency-Key", key)
		h.ServeHTTP(w, r)
		require.Equal(t, http.StatusCreated, w.Code, w.Body.String())
		return db.calls.Load() - before
	}
	assert.Equal(t, int64(3), calls("new"), "new key: claim, the handler's insert, complete")
	assert.Equal(t, int64(1), calls("new"), "replay: the claim")
	assert.Equal(t, int64(1), calls("new"), "replay: the claim")
	assert.Equal(t, int64(3), calls("other"), "new key")

	// An expired record is replaced: claim, replace, insert, complete.
	_, err = db.ExecContext(t.Context(), "UPDATE "+s.table.quoted()+" SET expires_at = now() - interval '1 second' WHERE key = 'new'")
	require.NoError(t, err)
	assert.Equal(t, int64(4), calls("new"), "expired key: claim, replace, the handler's insert, complete")
}

func TestDatabaseClockIsTheOnlyClock(t *testing.T) {
	// Claims stamped by clocks far off the database's (instances whose
	// clocks are skewed, each store with its instance's clock) still agree
	// on the lease: only its length counts, measured on the database's
	// clock.
	db := newTestDB(t, 4)
	s := db.newStore(t)
	for _, skew := range []time.Duration{-24 * time.Hour, 24 * time.Hour} {
		skewed, err := New(db.DB, WithTable(s.table.name), WithClock(func() time.Time { return time.Now().Add(skew) }))
		require.NoError(t, err)
		key := fmt.Sprintf("skew %v", skew)
		c := testClaim(key, time.Hour)
		c.Now, c.LeaseExpires = c.Now.Add(skew), c.LeaseExpires.Add(skew)
		res, err := skewed.Claim(t.Context(), c)
		require.NoError(t, err)
		require.True(t, res.Claimed)

		c2 := testClaim(key, time.Hour)
		c2.Token = "second"
		res, err = s.Claim(t.Context(), c2)
		require.NoError(t, err)
		require.False(t, res.Claimed)
		left := res.Record.LeaseExpires.Sub(c2.Now)
		assert.True(t, left > 50*time.Minute && left <= time.Hour, "lease left: %v", left)
	}
}

func TestUnreadableResponseFailsClosed(t *testing.T) {
	// A response in a format this release does not know is never replayed
	// as something else: the claim fails and the middleware answers 503.
	db := newTestDB(t, 4)
	s := db.newStore(t)
	future := respcodec.Encode(&idemserver.Response{Status: 201, Body: []byte("x")})
	future[0] = respcodec.Version + 1
	_, err := db.ExecContext(t.Context(), "INSERT INTO "+s.table.quoted()+
		" VALUES ('', 'k', $1, 't', now() + interval '1 hour', $2)", fingerprintOf("b"), future)
	require.NoError(t, err)

	_, err = s.Claim(t.Context(), testClaim("k", time.Hour))
	require.ErrorIs(t, err, respcodec.ErrUnknownVersion)
	assert.Contains(t, err.Error(), `"k"`)

	runs := 0
	h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs++ }))
	w := httptest.NewRecorder()
	r := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader("b"))
	r.Header.Set("Idempotency-Key", "k")
	h.ServeHTTP(w, r)
	assert.Equal(t, http.StatusServiceUnavailable, w.Code)
	assert.Zero(t, runs)
}

func TestDamagedResponseFailsClosed(t *testing.T) {
	// A stored response that is damaged is never replayed, in part or
	// misread, and never taken for an absent one that would run the
	// handler again: Claim fails, and the middleware answers 503 without
	// running the handler, in either mode.
	good := respcodec.Encode(&idemserver.Response{Status: 201, Header: http.Header{"Location": {"/p/1"}}, Body: []byte("created")})
	for _, tt := range []struct {
		name   string
		stored []byte
	}{
		{"empty", []byte{}},
		{"version only", good[:1]},
		{"body cut short", good[:len(good)-1]},
		{"header cut short", good[:6]},
		{"bytes after the body", append(append([]byte(nil), good...), 'x')},
		{"body length past the end", func() []byte {
			b := append([]byte(nil), good...)
			b[len(b)-len("created")-1] = 0x7f
			return b
		}()},
	} {
		for _, mode := range modes {
			t.Run(tt.name+"/"+mode.name, func(t *testing.T) {
				db := newTestDB(t, 4)
				s := db.newStore(t, mode.opts...)
				_, err := db.ExecContext(t.Context(), "INSERT INTO "+s.table.quoted()+
					" (scope, key, fingerprint, token, expires_at, response) VALUES ('', 'k', $1, 't', now() + interval '1 hour', $2)",
					fingerprintOf("b"), tt.stored)
				require.NoError(t, err)

				_, err = s.Claim(t.Context(), testClaim("k", time.Hour))
				require.Error(t, err)
				assert.Contains(t, err.Error(), `"k"`)

				runs := 0
				h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs++ }))
				status, body, _ := post(h, "k")
				assert.Equal(t, http.StatusServiceUnavailable, status, body)
				assert.NotContains(t, body, "created")
				assert.Zero(t, runs)
			})
		}
	}
}

var _ idemserver.PackedStore = (*Store)(nil)

// modes are the store's two modes, as options of New.
var modes = []struct {
	name string
	opts []Option
}{
	{"lease", nil},
	{"transactional", []Option{WithTransactional()}},
}

func TestResponsesKeptPacked(t *testing.T) {
	// Through the middleware (the PackedStore methods) the store keeps the
	// response in respcodec's form, translated from the packed one, and
	// replays it as it was sent; Claim reads the same row as a Response.
	for _, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			s := db.newStore(t, mode.opts...)
			runs := 0
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				w.Header().Set("Content-Type", "application/json")
				w.Header()["Link"] = []string{"</a>", "</b>"}
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write([]byte(`{"id":1}`))
			}))
			first := serveOnce(h, "k")
			require.Equal(t, http.StatusCreated, first.Code)

			var stored []byte
			require.NoError(t, db.QueryRowContext(t.Context(),
				"SELECT response FROM "+s.table.quoted()+" WHERE key = 'k'").Scan(&stored))
			decoded, err := respcodec.Decode(stored)
			require.NoError(t, err)
			assert.Equal(t, http.StatusCreated, decoded.Status)
			assert.Equal(t, `{"id":1}`, string(decoded.Body))
			assert.Equal(t, []string{"</a>", "</b>"}, decoded.Header["Link"])

			replay := serveOnce(h, "k")
			assert.Equal(t, 1, runs)
			assert.Equal(t, first.Code, replay.Code)
			assert.Equal(t, first.Body.String(), replay.Body.String())
			assert.Equal(t, []string{"</a>", "</b>"}, replay.Header()["Link"])
			assert.Equal(t, "application/json", replay.Header().Get("Content-Type"))
			assert.Equal(t, "true", replay.Header().Get(idemserver.ReplayedHeader))

			c := testClaim("k", time.Hour)
			c.Fingerprint = idemserver.Fingerprint(fingerprintOf("b"))
			res, err := s.Claim(t.Context(), c)
			require.NoError(t, err)
			require.True(t, res.Record.Completed())
			assert.Equal(t, http.StatusCreated, res.Record.Response.Status)
			assert.Equal(t, `{"id":1}`, string(res.Record.Response.Body))
			assert.Equal(t, []string{"</a>", "</b>"}, res.Record.Response.Header["Link"])
		})
	}
}

func TestEncodedResponsesReplay(t *testing.T) {
	// A response that respcodec.Encode wrote, as the store's Complete did
	// before the store took packed responses, is read by Claim and through
	// the middleware's packed path alike.
	for _, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			s := db.newStore(t, mode.opts...)
			v1 := respcodec.Encode(&idemserver.Response{Status: http.StatusCreated,
				Header: http.Header{"Location": {"/pay/7"}}, Body: []byte("seven")})
			require.Equal(t, byte(1), v1[0])
			_, err := db.ExecContext(t.Context(), "INSERT INTO "+s.table.quoted()+
				" VALUES ('', 'k', $1, 't', now() + interval '1 hour', $2)", fingerprintOf("b"), v1)
			require.NoError(t, err)

			runs := 0
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs++ }))
			w := serveOnce(h, "k")
			assert.Zero(t, runs)
			assert.Equal(t, http.StatusCreated, w.Code)
			assert.Equal(t, "seven", w.Body.String())
			assert.Equal(t, "/pay/7", w.Header().Get("Location"))

			c := testClaim("k", time.Hour)
			c.Fingerprint = idemserver.Fingerprint(fingerprintOf("b"))
			res, err := s.Claim(t.Context(), c)
			require.NoError(t, err)
			require.True(t, res.Record.Completed())
			assert.Equal(t, "seven", string(res.Record.Response.Body))
		})
	}
}

// fingerprintOf returns the fingerprint the middleware computes for a
// POST /pay with body.
func fingerprintOf(body string) []byte {
	var got idemserver.Fingerprint
	s := &recordingStore{fp: &got}
	h := idemserver.Middleware(s)(http.NotFoundHandler())
	r := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader(body))
	r.Header.Set("Idempotency-Key", "k")
	h.ServeHTTP(httptest.NewRecorder(), r)
	return got[:]
}

// recordingStore records the fingerprint of the claim it is asked for, and
// fails it.
type recordingStore struct {
	idemserver.Store
	fp *idemserver.Fingerprint
}

func (s *recordingStore) Claim(_ context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	*s.fp = c.Fingerprint
	return idemserver.ClaimResult{}, errors.New("recorded")
}

func TestStoreUnreachable(t *testing.T) {
	db := newTestDB(t, 4)
	s := db.newStore(t)
	pool := db.open(t, 1)
	down, err := New(pool, WithTable(s.table.name))
	require.NoError(t, err)
	require.NoError(t, pool.Close())
	_, err = down.Claim(t.Context(), testClaim("k", time.Hour))
	require.Error(t, err)
	h := idemserver.Middleware(down)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Error("the handler ran without a claim")
	}))
	w := httptest.NewRecorder()
	r := httptest.NewRequest(http.MethodPost, "/pay", strings.NewReader("b"))
	r.Header.Set("Idempotency-Key", "k")
	h.ServeHTTP(w, r)
	assert.Equal(t, http.StatusServiceUnavailable, w.Code)
	assert.NotEmpty(t, w.Header().Get("Retry-After"))
}

// paymentsHandler records one payment per execution in the payments table
// and answers with its id.
func paymentsHandler(db *sql.DB) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var id int64
		err := db.QueryRowContext(r.Context(), "INSERT INTO payments (key) VALUES ($1) RETURNING id",
			r.Header.Get("Idempotency-Key")).Scan(&id)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment":%d}`, id)
	})
}

const createPayments = "CREATE TABLE payments (id bigserial PRIMARY KEY, key text NOT NULL)"

func countPayments(t *testing.T, db *sql.DB, key string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT count(*) FROM payments WHERE key = $1", key).Scan(&n))
	return n
}

func TestTwoInstancesExecuteOnce(t *testing.T) {
	// Two servers, each with its own pool and store over one table, get 200
	// concurrent duplicates between them: one execution, and every client
	// gets its response.
	db := newTestDB(t, 10)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	table := db.newStore(t).table.name
	var servers []*httptest.Server
	for range 2 {
		pool := db.open(t, 10)
		s, err := New(pool, WithTable(table))
		require.NoError(t, err)
		srv := httptest.NewServer(idemserver.Middleware(s, idemserver.WithWaitInFlight(time.Minute))(paymentsHandler(pool)))
		t.Cleanup(srv.Close)
		servers = append(servers, srv)
	}
	const n = 200
	bodies := make([]string, n)
	statuses := make([]int, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			srv := servers[i%2]
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/pay", strings.NewReader(`{"amount":1}`))
			req.Header.Set("Idempotency-Key", "dup")
			resp, err := srv.Client().Do(req)
			if !assert.NoError(t, err) {
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			statuses[i], bodies[i] = resp.StatusCode, string(b)
		})
	}
	close(start)
	wg.Wait()
	assert.Equal(t, 1, countPayments(t, db.DB, "dup"), "executions")
	for i := range n {
		assert.Equal(t, http.StatusCreated, statuses[i], "request %d: %s", i, bodies[i])
		assert.Equal(t, bodies[0], bodies[i], "request %d", i)
	}
}

func TestMiddlewareClockNotTheStoresNeverRunsTwice(t *testing.T) {
	// A middleware whose clock (idemserver.WithClock) is far from the one
	// the store turns Complete's and Extend's times into durations with
	// must not have its records kept for no time: a retry would run the
	// handler again. Without the store's WithClock its claims are refused
	// (503); with it, the record is kept and replayed.
	past := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
	clock := func() time.Time { return past }
	for _, mode := range []struct {
		name string
		opts []Option
	}{{"lease", nil}, {"transactional", []Option{WithTransactional()}}} {
		for _, tt := range []struct {
			name       string
			storeClock bool
			status     int
			runs       int64
		}{
			{"store without the clock", false, http.StatusServiceUnavailable, 0},
			{"store with the clock", true, http.StatusCreated, 1},
		} {
			t.Run(mode.name+"/"+tt.name, func(t *testing.T) {
				db := newTestDB(t, 4)
				opts := mode.opts
				if tt.storeClock {
					opts = append([]Option{WithClock(clock)}, opts...)
				}
				s := db.newStore(t, opts...)
				var runs atomic.Int64
				var errs []error
				h := idemserver.Middleware(s, idemserver.WithClock(clock),
					idemserver.WithObserver(func(e idemserver.Event) { errs = append(errs, e.Err) }))(
					http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						runs.Add(1)
						w.WriteHeader(http.StatusCreated)
					}))
				status, body, _ := post(h, "k")
				assert.Equal(t, tt.status, status, body)
				status, body, replayed := post(h, "k")
				assert.Equal(t, tt.status, status, body)
				assert.Equal(t, tt.storeClock, replayed, "the retry is replayed")
				assert.Equal(t, tt.runs, runs.Load(), "handler runs for one key")
				if !tt.storeClock {
					require.NotEmpty(t, errs)
					assert.ErrorIs(t, errs[0], ErrClockSkew)
				}
			})
		}
	}
}

func TestExtendWithTheStoresClock(t *testing.T) {
	// An extension is measured on the store's clock: with the middleware's
	// clock given to it, a lease extended for an hour from a time long past
	// lasts an hour.
	past := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
	db := newTestDB(t, 4)
	s := db.newStore(t, WithClock(func() time.Time { return past }))
	c := idemserver.Claim{Key: idemserver.Key{Key: "k"}, Token: "t", Now: past, LeaseExpires: past.Add(time.Second)}
	res, err := s.Claim(t.Context(), c)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.NoError(t, s.Extend(t.Context(), c.Key, c.Token, past.Add(time.Hour)))
	res, err = s.Claim(t.Context(), idemserver.Claim{Key: c.Key, Token: "u", Now: past, LeaseExpires: past.Add(time.Second)})
	require.NoError(t, err)
	require.False(t, res.Claimed)
	left := res.Record.LeaseExpires.Sub(past)
	assert.True(t, left > 50*time.Minute && left <= time.Hour, "lease left: %v", left)
}
