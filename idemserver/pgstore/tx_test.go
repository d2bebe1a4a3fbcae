package pgstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// txPaymentsHandler records one payment per execution in the claim's
// transaction and answers with its id.
func txPaymentsHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var id int64
		err := Tx(r.Context()).QueryRowContext(r.Context(), "INSERT INTO payments (key) VALUES ($1) RETURNING id",
			r.Header.Get("Idempotency-Key")).Scan(&id)
		if err != nil {
			Rerun(r.Context(), err)
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment":%d}`, id)
	})
}

func countKeys(t *testing.T, db *testDB, s *Store) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT count(*) FROM "+s.table.quoted()).Scan(&n))
	return n
}

func TestTransactionalAllOrNothing(t *testing.T) {
	for _, tt := range []struct {
		name     string
		after    func(w http.ResponseWriter, r *http.Request) // after the payment was recorded
		payments int
		kept     bool
		status   int // the client's; 0 for a panic
	}{
		{"stored", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusCreated) }, 1, true, http.StatusCreated},
		{"client error stored", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusConflict) }, 1, true, http.StatusConflict},
		{"server error rolls back", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusBadGateway) }, 0, false, http.StatusBadGateway},
		{"429 rolls back", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusTooManyRequests) }, 0, false, http.StatusTooManyRequests},
		{"panic rolls back", func(http.ResponseWriter, *http.Request) { panic(http.ErrAbortHandler) }, 0, false, 0},
		// A statement that failed aborted the transaction: a success
		// answered after it is not stored, and the client learns that
		// nothing was kept.
		{"success after a failed statement rolls back", func(w http.ResponseWriter, r *http.Request) {
			_, err := Tx(r.Context()).ExecContext(r.Context(), "SELECT 1/0")
			assert.Error(t, err)
			w.WriteHeader(http.StatusCreated)
		}, 0, false, http.StatusServiceUnavailable},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			s := db.newStore(t, WithTransactional())
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, err := Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO payments (key) VALUES ('k')")
				require.NoError(t, err)
				tt.after(w, r)
			}))
			status := 0
			func() {
				defer func() { _ = recover() }()
				status, _, _ = post(h, "k")
			}()
			assert.Equal(t, tt.status, status)
			assert.Equal(t, tt.payments, countPayments(t, db.DB, "k"))
			want := 0
			if tt.kept {
				want = 1
			}
			assert.Equal(t, want, countKeys(t, db, s), "records")
			assert.Zero(t, db.Stats().InUse, "no transaction left open")
		})
	}
}

func TestTxOutsideTransactionalMode(t *testing.T) {
	assert.Nil(t, Tx(context.Background()))
	db := newTestDB(t, 4)
	s := db.newStore(t)
	assert.False(t, s.HoldResponses())
	var tx any = "unset"
	h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx = Tx(r.Context())
	}))
	post(h, "k")
	assert.Nil(t, tx)
	assert.True(t, db.newStore(t, WithTransactional()).HoldResponses())
}

func TestTransactionalDuplicateNeitherBlocksNorHoldsAConnection(t *testing.T) {
	// The pool has two connections; the first request's transaction holds
	// one. A duplicate is told 409 at once, and one that waits
	// (WithWaitInFlight) leaves the other connection free for other work
	// while it does, then replays.
	db := newTestDB(t, 2)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t, WithTransactional())
	entered, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int64
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Idempotency-Key") == "slow" && runs.Add(1) == 1 {
			close(entered)
			<-release
		}
		txPaymentsHandler().ServeHTTP(w, r)
	})
	refuse := idemserver.Middleware(s)(handler)
	wait := idemserver.Middleware(s, idemserver.WithWaitInFlight(time.Minute))(handler)

	first := make(chan string, 1)
	go func() {
		_, body, _ := post(refuse, "slow")
		first <- body
	}()
	<-entered

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	w := httptest.NewRecorder()
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/pay", strings.NewReader("b"))
	r.Header.Set("Idempotency-Key", "slow")
	refuse.ServeHTTP(w, r)
	assert.Equal(t, http.StatusConflict, w.Code, "a duplicate of an uncommitted claim: 409 at once")
	assert.NotEmpty(t, w.Header().Get("Retry-After"))

	waited := make(chan string, 1)
	go func() {
		_, body, _ := post(wait, "slow")
		waited <- body
	}()
	// While the duplicate waits, the pool's other connection serves
	// another key from start to commit.
	for i := range 3 {
		status, body, _ := post(refuse, fmt.Sprintf("other-%d", i))
		require.Equal(t, http.StatusCreated, status, body)
	}
	close(release)
	body := <-first
	assert.Equal(t, body, <-waited, "the waiting duplicate replays the first response")
	assert.Equal(t, 1, countPayments(t, db.DB, "slow"))
}

func TestTransactionalCommitsAfterTheClientLeft(t *testing.T) {
	// The handler finished its work and its response, then the client went
	// away: the transaction still commits, and the retry replays.
	db := newTestDB(t, 4)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t, WithTransactional())
	ctx, cancel := context.WithCancel(t.Context())
	h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		txPaymentsHandler().ServeHTTP(w, r)
		cancel()
	}))
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/pay", strings.NewReader("b"))
	r.Header.Set("Idempotency-Key", "k")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	require.Equal(t, http.StatusCreated, w.Code, w.Body.String())
	assert.Equal(t, 1, countPayments(t, db.DB, "k"))
	status, body, replayed := post(h, "k")
	assert.Equal(t, http.StatusCreated, status)
	assert.True(t, replayed)
	assert.Equal(t, w.Body.String(), body)
}

func TestTransactionalRoundTrips(t *testing.T) {
	db := newTestDB(t, 4)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t, WithTransactional())
	h := idemserver.Middleware(s)(txPaymentsHandler())
	calls := func(key string) int64 {
		before := db.calls.Load()
		status, body, _ := post(h, key)
		require.Equal(t, http.StatusCreated, status, body)
		return db.calls.Load() - before
	}
	assert.Equal(t, int64(6), calls("new"), "new key: read, begin, claim, the handler's insert, complete, commit")
	assert.Equal(t, int64(1), calls("new"), "replay: the read")
	assert.Equal(t, int64(1), calls("new"), "replay: the read")
}

func TestTransactionalExtendRoundTrips(t *testing.T) {
	// An extension of an open claim is one statement; one whose lock is
	// gone reads the claim's row too.
	db := newTestDB(t, 2)
	s := db.newStore(t, WithTransactional())
	c, ctx := openClaim(t, s, "k")
	extend := func() (int64, error) {
		before := db.calls.Load()
		err := s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute))
		return db.calls.Load() - before, err
	}
	for range 3 {
		n, err := extend()
		require.NoError(t, err)
		assert.Equal(t, int64(1), n, "open claim: the check of its lock")
	}
	require.NoError(t, Tx(ctx).Commit()) // the handler commits itself: the lock is gone, the row is there
	n, err := extend()
	require.NoError(t, err)
	assert.Equal(t, int64(2), n, "committed claim: the check of its lock, the read of its row")
	require.NoError(t, s.Release(context.WithoutCancel(ctx), c.Key, c.Token))
}

func TestTransactionalDuplicateInFlightRoundTrips(t *testing.T) {
	// A duplicate of a claim whose transaction is still open costs four
	// round trips (read, begin, the claim that does not get the lock,
	// rollback) and gets 409 at once.
	db := newTestDB(t, 4)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t, WithTransactional())
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		once.Do(func() {
			close(entered)
			<-release
		})
		txPaymentsHandler().ServeHTTP(w, r)
	}))
	first := make(chan int, 1)
	go func() {
		status, _, _ := post(h, "k")
		first <- status
	}()
	// However the test ends, the first request ends before the test's
	// database is dropped.
	finish := sync.OnceValue(func() int {
		close(release)
		return <-first
	})
	defer finish()
	<-entered

	before := db.calls.Load()
	status, body, _ := post(h, "k")
	assert.Equal(t, http.StatusConflict, status, body)
	assert.Equal(t, int64(4), db.calls.Load()-before, "duplicate in flight: read, begin, claim, rollback")

	assert.Equal(t, http.StatusCreated, finish())
	assert.Equal(t, 1, countPayments(t, db.DB, "k"))
}

// failFirst installs a trigger that fails with SQLSTATE state the first n
// times it fires (a sequence counts them across transactions); on says
// when it fires, such as "BEFORE INSERT ON payments".
func failFirst(t *testing.T, db *testDB, on, state string, n int) {
	t.Helper()
	constraint := ""
	if strings.Contains(on, "DEFERRED") {
		constraint = "CONSTRAINT "
	}
	for _, q := range []string{
		"CREATE SEQUENCE fails",
		fmt.Sprintf(`CREATE FUNCTION fail() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF nextval('fails') <= %d THEN
		RAISE EXCEPTION 'injected' USING ERRCODE = '%s';
	END IF;
	RETURN NEW;
END $$`, n, state),
		"CREATE " + constraint + "TRIGGER fail " + on + " FOR EACH ROW EXECUTE FUNCTION fail()",
	} {
		_, err := db.ExecContext(t.Context(), q)
		require.NoError(t, err, q)
	}
}

func TestTransactionalRerunsOnConflicts(t *testing.T) {
	for _, tt := range []struct {
		name string
		// on says where the first attempts fail with SQLSTATE state:
		// the handler's insert, Complete's update ({table}), or the
		// commit (a deferred constraint trigger).
		on       string
		state    string
		fails    int
		status   int
		payments int
	}{
		{"serialization failure in the handler", "BEFORE INSERT ON payments", "40001", 1, http.StatusCreated, 1},
		{"deadlock in the handler", "BEFORE INSERT ON payments", "40P01", 2, http.StatusCreated, 1},
		{"serialization failure in Complete", "BEFORE UPDATE ON {table}", "40001", 1, http.StatusCreated, 1},
		{"serialization failure at commit", "AFTER INSERT ON payments DEFERRABLE INITIALLY DEFERRED", "40001", 1, http.StatusCreated, 1},
		{"bounded", "BEFORE UPDATE ON {table}", "40001", 100, http.StatusServiceUnavailable, 0},
		{"other errors are not rerun", "BEFORE UPDATE ON {table}", "23505", 1, http.StatusServiceUnavailable, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			s := db.newStore(t, WithTransactional())
			failFirst(t, db, strings.ReplaceAll(tt.on, "{table}", s.table.quoted()), tt.state, tt.fails)
			var runs atomic.Int64
			var events []idemserver.Event
			h := idemserver.Middleware(s, idemserver.WithObserver(func(e idemserver.Event) { events = append(events, e) }))(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					txPaymentsHandler().ServeHTTP(w, r)
				}))
			status, body, _ := post(h, "k")
			assert.Equal(t, tt.status, status, body)
			assert.Equal(t, tt.payments, countPayments(t, db.DB, "k"))
			if tt.status == http.StatusCreated {
				// The client, and a retry, get the kept run's answer
				// alone: nothing of the runs rolled back.
				var id int64
				require.NoError(t, db.QueryRowContext(t.Context(), "SELECT id FROM payments WHERE key = 'k'").Scan(&id))
				want := fmt.Sprintf(`{"payment":%d}`, id)
				assert.Equal(t, want, body)
				status, replay, replayed := post(h, "k")
				assert.True(t, replayed)
				assert.Equal(t, http.StatusCreated, status)
				assert.Equal(t, want, replay)
				events = events[:len(events)-1]
			}
			wantRuns := int64(min(tt.fails, idemserver.MaxReruns) + 1)
			if tt.state == "23505" {
				wantRuns = 1
			}
			assert.Equal(t, wantRuns, runs.Load(), "handler runs")
			require.Len(t, events, 1)
			if tt.status == http.StatusServiceUnavailable {
				assert.True(t, errors.Is(events[0].Err, idemserver.ErrRolledBack), "%v", events[0].Err)
			}
			assert.Zero(t, db.Stats().InUse, "no transaction left open")
		})
	}
}

func TestTransactionalRetentionRunsFromTheCommit(t *testing.T) {
	// The record is kept for the TTL from when it is stored, however long
	// its handler ran: a record whose retention ran from the claim would
	// be committed short, or already expired when the handler took longer
	// than the TTL, and a retry would run the handler again.
	const ttl = time.Hour
	db := newTestDB(t, 4)
	s := db.newStore(t, WithTransactional())
	var handlerEnd time.Time // the database's clock as the handler ends
	h := idemserver.Middleware(s, idemserver.WithTTL(ttl))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The handler's work takes a while, by the database's clock.
		require.NoError(t, Tx(r.Context()).QueryRowContext(r.Context(),
			"SELECT clock_timestamp() FROM pg_sleep(0.2)").Scan(&handlerEnd))
		w.WriteHeader(http.StatusCreated)
	}))
	status, body, _ := post(h, "k")
	require.Equal(t, http.StatusCreated, status, body)

	var expires time.Time
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT expires_at FROM "+s.table.quoted()).Scan(&expires))
	// The retention was given after the handler ended and applied after
	// that; a millisecond covers the rounding to microseconds.
	assert.False(t, expires.Before(handlerEnd.Add(ttl-time.Millisecond)),
		"the record expires %v after the handler ended; want at least the TTL, %v", expires.Sub(handlerEnd), ttl)
}

func TestTransactionalHandlerThatEndsTxItself(t *testing.T) {
	// A handler that commits Tx itself, against its contract, has made its
	// writes and the claim durable: its response must be stored beside
	// them, not reported as rolled back (the client would be told nothing
	// was done, and every retry would get 409 until Sweep removed the claim
	// and the handler ran again). One that rolls back has done nothing.
	for _, tt := range []struct {
		name     string
		end      func(*sql.Tx) error
		status   int
		payments int
		records  int
	}{
		{"commit", (*sql.Tx).Commit, http.StatusCreated, 1, 1},
		{"rollback", (*sql.Tx).Rollback, http.StatusServiceUnavailable, 0, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			s := db.newStore(t, WithTransactional())
			var runs atomic.Int64
			h := idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				tx := Tx(r.Context())
				_, err := tx.ExecContext(r.Context(), "INSERT INTO payments (key) VALUES ('k')")
				require.NoError(t, err)
				require.NoError(t, tt.end(tx))
				w.WriteHeader(http.StatusCreated)
			}))
			status, body, _ := post(h, "k")
			assert.Equal(t, tt.status, status, body)
			assert.Equal(t, tt.payments, countPayments(t, db.DB, "k"))
			assert.Equal(t, tt.records, countKeys(t, db, s), "records")
			assert.Zero(t, db.Stats().InUse, "no transaction left open")

			// The retry gets what was kept: the stored response, or a run.
			status, body, replayed := post(h, "k")
			assert.Equal(t, tt.status, status, body)
			assert.Equal(t, tt.status == http.StatusCreated, replayed, "replayed")
			assert.Equal(t, int64(2-tt.records), runs.Load(), "handler runs")
		})
	}
}

func TestTransactionalLocksOfTablesOfOneNameInTwoSchemas(t *testing.T) {
	// Two services keep their records in tables of the default name, each
	// in its own schema (its search_path), of one database. A key in
	// flight in one must not hold up the same key in the other: a gateway
	// that passes its key on to a service behind it would otherwise be
	// refused with 409 for as long as its own claim is open.
	a, b := newTestDB(t, 4), newTestDB(t, 4)
	sa, sb := a.newStore(t, WithTransactional()), b.newStore(t, WithTransactional())
	require.Equal(t, sa.table, sb.table, "one table name, unqualified")

	entered, release := make(chan struct{}), make(chan struct{})
	first := make(chan int, 1)
	go func() {
		status, _, _ := post(idemserver.Middleware(sa)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(entered)
			<-release
			w.WriteHeader(http.StatusCreated)
		})), "k")
		first <- status
	}()
	<-entered
	status, body, _ := post(idemserver.Middleware(sb)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})), "k")
	close(release)
	assert.Equal(t, http.StatusCreated, status, body)
	assert.Equal(t, http.StatusCreated, <-first)
}

func TestTransactionalHandlerThatEndsTxItselfThenFails(t *testing.T) {
	// A handler that ends Tx itself, against its contract, and then
	// answers 5xx or panics has its claim released, as any other: the
	// retry runs at once. One that committed has made its claim's row
	// durable, in progress: the release deletes it (a release that failed
	// for it would leave every retry 409 while the row is there). One that
	// rolled back left no row, and its release has nothing to do.
	const failedDeletes = 1
	for _, tt := range []struct {
		name     string
		end      func(*sql.Tx) error
		fail     func(http.ResponseWriter)
		deletes  int // how many of the first deletes of a row fail
		releases int
		payments int // the first run's insert, if kept, and the retry's
	}{
		{"commit, 500", (*sql.Tx).Commit, func(w http.ResponseWriter) { w.WriteHeader(http.StatusInternalServerError) }, 0, 1, 2},
		{"commit, panic", (*sql.Tx).Commit, func(http.ResponseWriter) { panic(http.ErrAbortHandler) }, 0, 1, 2},
		{"rollback, 500", (*sql.Tx).Rollback, func(w http.ResponseWriter) { w.WriteHeader(http.StatusInternalServerError) }, 0, 1, 1},
		{"commit, 503, the first delete fails", (*sql.Tx).Commit, func(w http.ResponseWriter) { w.WriteHeader(http.StatusServiceUnavailable) }, failedDeletes, 1 + failedDeletes, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// One connection: the release must not need a second one.
			db := newTestDB(t, 1)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			s := db.newStore(t, WithTransactional())
			for _, q := range []string{
				"CREATE SEQUENCE deletes",
				fmt.Sprintf(`CREATE FUNCTION fail_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF nextval('deletes') <= %d THEN
		RAISE EXCEPTION 'injected';
	END IF;
	RETURN OLD;
END $$`, tt.deletes),
				"CREATE TRIGGER fail_delete BEFORE DELETE ON " + s.table.quoted() + " FOR EACH ROW EXECUTE FUNCTION fail_delete()",
			} {
				_, err := db.ExecContext(t.Context(), q)
				require.NoError(t, err, q)
			}
			store := &releaseCounter{Store: s}
			var runs atomic.Int64
			h := idemserver.Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				tx := Tx(r.Context())
				_, err := tx.ExecContext(r.Context(), "INSERT INTO payments (key) VALUES ('k')")
				require.NoError(t, err)
				if runs.Add(1) == 1 {
					require.NoError(t, tt.end(tx))
					tt.fail(w)
					return
				}
				w.WriteHeader(http.StatusCreated)
			}))
			func() {
				defer func() { _ = recover() }()
				status, body, _ := post(h, "k")
				assert.GreaterOrEqual(t, status, http.StatusInternalServerError, body)
			}()
			errs := store.releaseErrs()
			assert.Len(t, errs, tt.releases, "releases")
			if assert.NotEmpty(t, errs) {
				assert.NoError(t, errs[len(errs)-1], "the claim was released")
			}
			assert.Zero(t, countKeys(t, db, s), "no claim left in progress")
			assert.Zero(t, db.Stats().InUse, "the connection is back in the pool")

			status, body, replayed := post(h, "k")
			assert.Equal(t, http.StatusCreated, status, "the retry runs at once: %s", body)
			assert.False(t, replayed)
			assert.Equal(t, int64(2), runs.Load(), "handler runs")
			status, body, replayed = post(h, "k")
			assert.Equal(t, http.StatusCreated, status, body)
			assert.True(t, replayed, "the retry's outcome is the key's")
			assert.Equal(t, int64(2), runs.Load(), "handler runs")
			assert.Equal(t, tt.payments, countPayments(t, db.DB, "k"))
			assert.Zero(t, db.Stats().InUse, "the connection is back in the pool")
		})
	}
}

func TestTransactionalSendsNoInformationalResponseBeforeTheCommit(t *testing.T) {
	// A 103 the handler writes would reach the client while its
	// transaction is still open, and the commit may yet fail: it is
	// dropped, and the client gets the final response only.
	db := newTestDB(t, 2)
	_, err := db.ExecContext(t.Context(), createPayments)
	require.NoError(t, err)
	s := db.newStore(t, WithTransactional())
	srv := httptest.NewServer(idemserver.Middleware(s)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		txPaymentsHandler().ServeHTTP(w, r)
	})))
	defer srv.Close()
	for _, replayed := range []string{"", "true"} {
		var informational []int
		ctx := httptrace.WithClientTrace(t.Context(), &httptrace.ClientTrace{
			Got1xxResponse: func(code int, _ textproto.MIMEHeader) error {
				informational = append(informational, code)
				return nil
			},
		})
		r, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/pay", strings.NewReader("b"))
		require.NoError(t, err)
		r.Header.Set("Idempotency-Key", "k")
		resp, err := srv.Client().Do(r)
		require.NoError(t, err)
		_ = resp.Body.Close()
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, replayed, resp.Header.Get(idemserver.ReplayedHeader))
		assert.Empty(t, informational, "no informational response reached the client")
	}
	assert.Equal(t, 1, countPayments(t, db.DB, "k"))
	srv.CloseClientConnections()
}

func TestTransactionalHoldsResponsesBehindAWrapper(t *testing.T) {
	// A store wrapped by one that forwards only the Store methods still
	// has every response held until its commit: a response that reached
	// the client before a COMMIT that then failed would tell the client
	// of a payment that was rolled back.
	for _, tt := range []struct {
		name  string
		write func(w http.ResponseWriter) // after the payment was recorded
		state string                      // with which the first COMMIT fails
		// status is the client's; payments, how many were kept.
		status   int
		payments int
	}{
		{"flush, then the commit is refused", func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("paid"))
			require.NoError(t, http.NewResponseController(w).Flush())
		}, "23505", http.StatusServiceUnavailable, 0},
		{"larger than the limit, then the commit is refused", func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(strings.Repeat("x", 64)))
		}, "23505", http.StatusServiceUnavailable, 0},
		{"serialization failure at the commit is rerun", func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("paid"))
		}, "40001", http.StatusCreated, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			_, err := db.ExecContext(t.Context(), createPayments)
			require.NoError(t, err)
			// Wrapped as metrics and tracing wrappers do: the store's
			// ResponseHolder method is hidden behind it.
			s := namedStore{db.newStore(t, WithTransactional())}
			failFirst(t, db, "AFTER INSERT ON payments DEFERRABLE INITIALLY DEFERRED", tt.state, 1)
			h := idemserver.Middleware(s, idemserver.WithMaxResponseBytes(16))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, err := Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO payments (key) VALUES ('k')")
				if err != nil {
					Rerun(r.Context(), err)
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				tt.write(w)
			}))
			status, body, _ := post(h, "k")
			assert.Equal(t, tt.status, status, "the client's status; body %q", body)
			assert.Equal(t, tt.payments, countPayments(t, db.DB, "k"))
			assert.Zero(t, db.Stats().InUse, "no transaction left open")
		})
	}
}
