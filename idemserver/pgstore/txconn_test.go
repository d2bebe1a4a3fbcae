package pgstore

import (
	"context"
	"database/sql"
	"fmt"
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
)

func TestTransactionalClaimWaitsForAConnectionOnlyWhileItsRequestLasts(t *testing.T) {
	// A claim's transaction outlives its request's context, but the wait
	// for the pool connection to begin it on must not: with every
	// connection taken (by other claims' open transactions), a request
	// whose client left, or whose deadline passed, while it waited would
	// never return. It gets 503, reported as canceled (the store did not
	// fail), and its handler does not run.
	for _, tt := range []struct {
		name string
		ctx  func(context.Context) (context.Context, context.CancelFunc)
		// end ends the request's context once its claim waits for a
		// connection.
		end  func(cancel context.CancelFunc)
		want error
	}{
		{"client gone", context.WithCancel, func(cancel context.CancelFunc) { cancel() }, context.Canceled},
		{"deadline passed", func(ctx context.Context) (context.Context, context.CancelFunc) {
			return context.WithTimeout(ctx, 3*time.Second) // long enough for the claim to read its row first, under load
		}, func(context.CancelFunc) {}, context.DeadlineExceeded},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 1)
			// The store's own bound is far away: the request's context
			// ends the wait.
			s := db.newStore(t, WithTransactional(), WithPoolWait(time.Hour))
			// After the claim has read the key's row, and before it takes
			// a connection for its transaction, the pool's one connection
			// is taken, as by another claim's transaction.
			held := make(chan *sql.Conn, 1)
			var once sync.Once
			s.testHookBegin = func() {
				once.Do(func() {
					conn, err := db.Conn(context.Background())
					assert.NoError(t, err)
					held <- conn
				})
			}
			var runs atomic.Int64
			var events []idemserver.Event
			h := idemserver.Middleware(s, idemserver.WithObserver(func(e idemserver.Event) { events = append(events, e) }))(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					w.WriteHeader(http.StatusCreated)
				}))

			ctx, cancel := tt.ctx(t.Context())
			defer cancel()
			waits := db.Stats().WaitCount
			w := httptest.NewRecorder()
			r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/pay", strings.NewReader("b"))
			r.Header.Set("Idempotency-Key", "k")
			done := make(chan struct{})
			go func() {
				defer close(done)
				h.ServeHTTP(w, r)
			}()
			var conn *sql.Conn
			select {
			case conn = <-held:
			case <-done:
				t.Fatalf("the request ended before its claim began a transaction: %d %s", w.Code, w.Body)
			}
			// The held connection goes back to the pool once the request
			// has ended, or when the test fails, so that it ends.
			var giveBack sync.Once
			defer func() {
				giveBack.Do(func() { _ = conn.Close() })
				<-done
			}()

			require.Eventually(t, func() bool { return db.Stats().WaitCount > waits }, 10*time.Second, time.Millisecond,
				"the claim waits for a connection")
			tt.end(cancel)
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				t.Fatal("the claim still waits for a connection after its request's context ended")
			}
			assert.Equal(t, http.StatusServiceUnavailable, w.Code, w.Body.String())
			assert.Contains(t, w.Body.String(), idemserver.ProblemRequestCanceled)
			assert.NotEmpty(t, w.Header().Get("Retry-After"))
			assert.Zero(t, runs.Load(), "the handler did not run")
			require.Len(t, events, 1)
			assert.Equal(t, idemserver.OutcomeCanceled, events[0].Outcome)
			assert.ErrorIs(t, events[0].Err, tt.want)
			assert.NotErrorIs(t, events[0].Err, ErrPoolTimeout)

			giveBack.Do(func() { require.NoError(t, conn.Close()) })
			assert.Zero(t, db.Stats().InUse, "the claim kept no connection")
			// Nothing of the claim is left: the retry runs.
			status, body, replayed := post(h, "k")
			assert.Equal(t, http.StatusCreated, status, body)
			assert.False(t, replayed)
			assert.Equal(t, int64(1), runs.Load(), "handler runs")
			assert.Zero(t, db.Stats().InUse, "the claim kept no connection")
		})
	}
}

// postWithin is post with a request whose context ends after a while, so
// that a claim that waits for a connection that was never given back gets
// 503 rather than waiting for the rest of the test.
func postWithin(t *testing.T, h http.Handler, key string) (int, string, bool) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	w := httptest.NewRecorder()
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/pay", strings.NewReader("b"))
	r.Header.Set("Idempotency-Key", key)
	h.ServeHTTP(w, r)
	return w.Code, w.Body.String(), w.Header().Get(idemserver.ReplayedHeader) == "true"
}

// expect posts a payment with key to h and checks its status, and whether
// it was a replay.
func expect(t *testing.T, h http.Handler, key string, status int, replayed bool) {
	t.Helper()
	got, body, gotReplayed := postWithin(t, h, key)
	require.Equal(t, status, got, body)
	require.Equal(t, replayed, gotReplayed, "replayed")
}

// endTxThen returns a handler that records a payment in Tx, ends Tx itself
// with end, and answers status.
func endTxThen(t *testing.T, end func(*sql.Tx) error, status int) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := Tx(r.Context())
		_, err := tx.ExecContext(r.Context(), "INSERT INTO payments (key) VALUES ($1)", r.Header.Get("Idempotency-Key"))
		require.NoError(t, err)
		require.NoError(t, end(tx))
		w.WriteHeader(status)
	})
}

func TestTransactionalReturnsEveryConnection(t *testing.T) {
	// Each claim's transaction runs on a pool connection of its own, which
	// must go back to the pool however the transaction ends: one kept by
	// a claim that ended is lost to the pool for good, and once all of
	// them are lost every claim waits for one. Pools of one connection
	// also show that no claim needs a second.
	statusOf := func(status int) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, err := Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO payments (key) VALUES ('k')")
			require.NoError(t, err)
			w.WriteHeader(status)
		})
	}
	// failing returns a run that posts a payment while the first n
	// statements on names ({table} is the store's table) fail with
	// SQLSTATE state, and expects status.
	failing := func(on, state string, n, status int) func(*testing.T, *testDB, *Store) {
		return func(t *testing.T, db *testDB, s *Store) {
			failFirst(t, db, strings.ReplaceAll(on, "{table}", s.table.quoted()), state, n)
			expect(t, idemserver.Middleware(s)(txPaymentsHandler()), "k", status, false)
		}
	}
	// endingTx returns a run whose handler ends Tx itself with end and
	// answers status, and expects the answers in turn: the first is the
	// handler's, and a later one below 500 is the replay of the first.
	endingTx := func(end func(*sql.Tx) error, status int, answers ...int) func(*testing.T, *testDB, *Store) {
		return func(t *testing.T, db *testDB, s *Store) {
			h := idemserver.Middleware(s)(endTxThen(t, end, status))
			for i, want := range answers {
				expect(t, h, "k", want, i > 0 && want < http.StatusInternalServerError)
			}
		}
	}
	for _, tt := range []struct {
		name  string
		conns int
		// run serves requests through store s, with failures injected
		// into db, and checks their answers.
		run func(t *testing.T, db *testDB, s *Store)
	}{
		{"stored, then replayed", 1, func(t *testing.T, db *testDB, s *Store) {
			h := idemserver.Middleware(s)(txPaymentsHandler())
			expect(t, h, "k", http.StatusCreated, false)
			expect(t, h, "k", http.StatusCreated, true)
		}},
		{"released for a 5xx", 1, func(t *testing.T, db *testDB, s *Store) {
			h := idemserver.Middleware(s)(statusOf(http.StatusBadGateway))
			expect(t, h, "k", http.StatusBadGateway, false)
			expect(t, h, "k", http.StatusBadGateway, false)
		}},
		{"released for a panic", 1, func(t *testing.T, db *testDB, s *Store) {
			h := idemserver.Middleware(s)(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic(http.ErrAbortHandler) }))
			require.PanicsWithValue(t, http.ErrAbortHandler, func() { postWithin(t, h, "k") })
		}},
		{"released when the client left", 1, func(t *testing.T, db *testDB, s *Store) {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			h := idemserver.Middleware(s)(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { cancel() }))
			w := httptest.NewRecorder()
			r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/pay", strings.NewReader("b"))
			r.Header.Set("Idempotency-Key", "k")
			h.ServeHTTP(w, r)
			require.Equal(t, http.StatusServiceUnavailable, w.Code, w.Body.String())
			require.Contains(t, w.Body.String(), idemserver.ProblemRequestCanceled)
		}},
		{"rerun the handler asked for", 1, failing("BEFORE INSERT ON payments", "40001", 2, http.StatusCreated)},
		{"rerun after Complete's write failed", 1, failing("BEFORE UPDATE ON {table}", "40P01", 1, http.StatusCreated)},
		{"rolled back when Complete's write failed", 1, failing("BEFORE UPDATE ON {table}", "23505", 1, http.StatusServiceUnavailable)},
		{"refused at commit", 1, failing("AFTER INSERT ON payments DEFERRABLE INITIALLY DEFERRED", "23505", 1, http.StatusServiceUnavailable)},
		{"claim statement failed", 1, failing("BEFORE INSERT ON {table}", "23514", 1, http.StatusServiceUnavailable)},
		{"claim statement run again", 1, failing("BEFORE INSERT ON {table}", "40001", 2, http.StatusCreated)},
		{"expired record replaced", 1, func(t *testing.T, db *testDB, s *Store) {
			h := idemserver.Middleware(s)(txPaymentsHandler())
			expect(t, h, "k", http.StatusCreated, false)
			_, err := db.ExecContext(t.Context(), "UPDATE "+s.table.quoted()+" SET expires_at = now() - interval '1 second'")
			require.NoError(t, err)
			expect(t, h, "k", http.StatusCreated, false)
			require.Equal(t, 2, countPayments(t, db.DB, "k"))
		}},
		{"expired record's replacement failed", 1, func(t *testing.T, db *testDB, s *Store) {
			h := idemserver.Middleware(s)(txPaymentsHandler())
			expect(t, h, "k", http.StatusCreated, false)
			_, err := db.ExecContext(t.Context(), "UPDATE "+s.table.quoted()+" SET expires_at = now() - interval '1 second'")
			require.NoError(t, err)
			failFirst(t, db, "BEFORE UPDATE ON "+s.table.quoted(), "23514", 1)
			expect(t, h, "k", http.StatusServiceUnavailable, false)
			expect(t, h, "k", http.StatusCreated, false)
		}},
		{"BEGIN on connections found bad", 1, func(t *testing.T, db *testDB, s *Store) {
			db.badBegins.Store(2)
			expect(t, idemserver.Middleware(s)(txPaymentsHandler()), "k", http.StatusCreated, false)
			require.Zero(t, db.badBegins.Load(), "both bad connections were met")
		}},
		{"handler committed Tx itself", 1, endingTx((*sql.Tx).Commit, http.StatusCreated, http.StatusCreated, http.StatusCreated)},
		{"handler rolled Tx back itself", 1, endingTx((*sql.Tx).Rollback, http.StatusCreated, http.StatusServiceUnavailable)},
		{"handler committed Tx itself, then failed", 1, endingTx((*sql.Tx).Commit, http.StatusInternalServerError,
			http.StatusInternalServerError, http.StatusInternalServerError)},
		{"handler rolled Tx back itself, then failed", 1, endingTx((*sql.Tx).Rollback, http.StatusInternalServerError,
			http.StatusInternalServerError)},
		{"duplicate in flight", 2, func(t *testing.T, db *testDB, s *Store) {
			entered, release := make(chan struct{}), make(chan struct{})
			var runs atomic.Int64
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if runs.Add(1) == 1 {
					close(entered)
					<-release
				}
				txPaymentsHandler().ServeHTTP(w, r)
			}))
			first := make(chan int, 1)
			go func() {
				status, _, _ := postWithin(t, h, "k")
				first <- status
			}()
			<-entered
			expect(t, h, "k", http.StatusConflict, false)
			close(release)
			require.Equal(t, http.StatusCreated, <-first)
			expect(t, h, "k", http.StatusCreated, true)
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, tt.conns)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			s := db.newStore(t, WithTransactional())
			tt.run(t, db, s)
			require.Zero(t, db.Stats().InUse, "every connection is back in the pool")
			// The pool still serves claims.
			expect(t, idemserver.Middleware(s)(txPaymentsHandler()), "after", http.StatusCreated, false)
			assert.Zero(t, db.Stats().InUse, "every connection is back in the pool")
		})
	}
}

func TestTransactionalPoolUnderContention(t *testing.T) {
	// Many requests over a few keys share a pool of two connections, and
	// wait for them: each key's handler either stores its response,
	// answers 500, or ends Tx itself and then does one or the other. Every
	// key of a stored response is executed once, no claim is left in
	// progress, and every connection goes back to the pool.
	const (
		workers  = 12
		requests = 8
		keys     = 8
	)
	db := newTestDB(t, 2)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t, WithTransactional())
	// A key's kind says what its handler does.
	kind := func(key string) int {
		var n int
		_, _ = fmt.Sscanf(key, "k%d", &n)
		return n % 4
	}
	h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		tx := Tx(r.Context())
		if _, err := tx.ExecContext(r.Context(), "INSERT INTO payments (key) VALUES ($1)", key); err != nil {
			Rerun(r.Context(), err)
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		switch kind(key) {
		case 0:
			w.WriteHeader(http.StatusCreated)
		case 1:
			w.WriteHeader(http.StatusInternalServerError)
		case 2:
			assert.NoError(t, tx.Commit())
			w.WriteHeader(http.StatusCreated)
		case 3:
			assert.NoError(t, tx.Commit())
			w.WriteHeader(http.StatusInternalServerError)
		}
	}))
	var wg sync.WaitGroup
	for i := range workers {
		wg.Go(func() {
			for j := range requests {
				key := fmt.Sprintf("k%d", (i+j)%keys)
				status, body, _ := postWithin(t, h, key)
				want := http.StatusCreated
				if kind(key)%2 == 1 {
					want = http.StatusInternalServerError
				}
				if status != http.StatusConflict {
					assert.Equal(t, want, status, "key %s: %s", key, body)
				}
			}
		})
	}
	wg.Wait()
	assert.Zero(t, db.Stats().InUse, "every connection is back in the pool")
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		switch kind(key) {
		case 0, 2:
			assert.Equal(t, 1, countPayments(t, db.DB, key), "key %s executed once", key)
		case 1:
			assert.Zero(t, countPayments(t, db.DB, key), "key %s rolled back", key)
		}
	}
	var inProgress int
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT count(*) FROM "+s.table.quoted()+" WHERE response IS NULL").Scan(&inProgress))
	assert.Zero(t, inProgress, "no claim left in progress")
}

func TestTransactionalClaimWaitsForAConnectionNoLongerThanTheBound(t *testing.T) {
	// Every claim in transactional mode holds a pool connection while its
	// handler runs. With the pool's one connection held by a handler that
	// has not returned, a duplicate's read and a new key's claim wait for
	// a connection; under a server without timeouts their requests'
	// contexts never end, so only the store's bound ends the wait. Each
	// gets 503 with Retry-After, and no handler runs for it.
	db := newTestDB(t, 1)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t, WithTransactional())
	entered, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int64
	var mu sync.Mutex
	var events []idemserver.Event
	h := idemserver.Middleware(s, idemserver.WithObserver(func(e idemserver.Event) {
		mu.Lock()
		defer mu.Unlock()
		events = append(events, e)
	}))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			close(entered)
			<-release
		}
		txPaymentsHandler().ServeHTTP(w, r)
	}))

	var requests sync.WaitGroup
	var releaseOnce sync.Once
	defer func() {
		// However the test ends, the first handler returns, and every
		// request ends before the test's database is dropped.
		releaseOnce.Do(func() { close(release) })
		requests.Wait()
	}()
	first := make(chan int, 1)
	requests.Go(func() {
		status, _, _ := post(h, "k")
		first <- status
	})
	<-entered

	waits := db.Stats().WaitCount
	type answer struct {
		key string
		w   *httptest.ResponseRecorder
	}
	answers := make(chan answer, 2)
	for _, key := range []string{"k", "other"} {
		requests.Go(func() { answers <- answer{key, serveOnce(h, key)} }) // no deadline
	}
	for range 2 {
		select {
		case a := <-answers:
			assert.Equal(t, http.StatusServiceUnavailable, a.w.Code, "%s: %s", a.key, a.w.Body)
			assert.Contains(t, a.w.Body.String(), idemserver.ProblemStoreUnavailable, a.key)
			assert.NotEmpty(t, a.w.Header().Get("Retry-After"), a.key)
		case <-time.After(20 * DefaultPoolWait):
			t.Fatal("a claim still waits for a pool connection that a running handler holds")
		}
	}
	assert.GreaterOrEqual(t, db.Stats().WaitCount-waits, int64(2), "both claims waited for the connection")
	assert.Equal(t, int64(1), runs.Load(), "no handler ran but the first")
	mu.Lock()
	require.Len(t, events, 2)
	for _, e := range events {
		assert.Equal(t, idemserver.OutcomeUnavailable, e.Outcome)
		assert.ErrorIs(t, e.Err, ErrPoolTimeout)
		assert.ErrorIs(t, e.Err, context.DeadlineExceeded)
	}
	mu.Unlock()

	releaseOnce.Do(func() { close(release) })
	require.Equal(t, http.StatusCreated, <-first)
	// Nothing of the refused claims was kept: the duplicate's retry gets
	// the replay, and the new key runs.
	expect(t, h, "k", http.StatusCreated, true)
	expect(t, h, "other", http.StatusCreated, false)
	assert.Equal(t, 1, countPayments(t, db.DB, "k"))
	assert.Equal(t, 1, countPayments(t, db.DB, "other"))
	assert.Zero(t, db.Stats().InUse, "every connection is back in the pool")
}
