package pgstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

func TestTransactionalHandlerLearnsItsSessionEnded(t *testing.T) {
	// The server ends the session of a claim while its handler runs
	// (pg_terminate_backend here; idle_in_transaction_session_timeout or a
	// failover do the same): the claim's transaction, and with it the
	// claim, is gone, and a duplicate may run at once. The handler's
	// context must end, as it does when a lease is lost, rather than let
	// it go on acting beside the duplicate.
	db := newTestDB(t, 1)
	store, err := New(db.open(t, 2), WithTable(db.newStore(t).table.name), WithTransactional())
	require.NoError(t, err)

	claimed := make(chan struct{})
	ended := make(chan error, 1)
	h := idemserver.Middleware(store, idemserver.WithLease(300*time.Millisecond))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var pid int
		if !assert.NoError(t, Tx(r.Context()).QueryRowContext(r.Context(), "SELECT pg_backend_pid()").Scan(&pid)) {
			return
		}
		var ok bool
		if !assert.NoError(t, db.QueryRowContext(t.Context(), "SELECT pg_terminate_backend($1)", pid).Scan(&ok)) || !assert.True(t, ok) {
			return
		}
		close(claimed)
		select {
		case <-r.Context().Done():
			ended <- context.Cause(r.Context())
		case <-time.After(10 * time.Second):
			ended <- errors.New("the handler's context did not end")
		}
		w.WriteHeader(http.StatusCreated)
	}))
	done := make(chan int)
	go func() {
		status, _, _ := post(h, "k")
		done <- status
	}()
	<-claimed
	err = <-ended
	require.ErrorIs(t, err, idemserver.ErrLeaseLost)
	assert.Equal(t, http.StatusServiceUnavailable, <-done)
}

func TestTransactionalExtendHoldsWhileTheTransactionIsOpen(t *testing.T) {
	// Extend reports a claim lost only when its transaction is known to
	// have ended: not while it is open, however long, and not when the
	// check cannot be made because the claims hold every pool connection.
	db := newTestDB(t, 1)
	s := db.newStore(t, WithTransactional(), WithPoolWait(50*time.Millisecond))
	c, ctx := openClaim(t, s, "k")

	// The claim holds the pool's one connection: the check finds none.
	require.NoError(t, s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)))

	db.SetMaxOpenConns(2)
	for range 3 {
		require.NoError(t, s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)))
	}
	// Another key's claim holds another lock.
	other := testClaim("other", time.Minute)
	res2, err := s.Claim(t.Context(), other)
	require.NoError(t, err)
	require.True(t, res2.Claimed)
	require.NoError(t, s.Release(res2.Context, other.Key, other.Token))
	require.NoError(t, s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)))

	pid := backendPid(t, ctx)
	_, err = db.ExecContext(t.Context(), "SELECT pg_terminate_backend($1)", pid)
	require.NoError(t, err)
	assert.Eventually(t, func() bool {
		return errors.Is(s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)), idemserver.ErrLeaseLost)
	}, 10*time.Second, time.Millisecond, "the claim's session ended")
}

// openClaim claims key in transactional store s, and releases the claim
// when the test ends. It returns the claim and the claimed request's
// context.
func openClaim(t *testing.T, s *Store, key string) (idemserver.Claim, context.Context) {
	t.Helper()
	c := testClaim(key, time.Minute)
	res, err := s.Claim(t.Context(), c)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	t.Cleanup(func() { _ = s.Release(context.WithoutCancel(res.Context), c.Key, c.Token) })
	return c, res.Context
}

// backendPid returns the pid of the server process of the transaction of
// the claimed request whose context is ctx.
func backendPid(t *testing.T, ctx context.Context) int {
	t.Helper()
	var pid int
	require.NoError(t, Tx(ctx).QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid))
	return pid
}

// txid returns the id of the transaction of the claimed request whose
// context is ctx, counting the times the server's 32-bit ids wrapped
// around.
func txid(t *testing.T, ctx context.Context) int64 {
	t.Helper()
	var xid int64
	require.NoError(t, Tx(ctx).QueryRowContext(ctx, "SELECT txid_current()").Scan(&xid))
	return xid
}

// extendsSeen is a Store that sends the error of each Extend to extends.
type extendsSeen struct {
	*Store
	extends chan error
}

func (s extendsSeen) Extend(ctx context.Context, key idemserver.Key, token string, leaseExpires time.Time) error {
	err := s.Store.Extend(ctx, key, token, leaseExpires)
	select {
	case s.extends <- err:
	default:
	}
	return err
}

func TestTransactionalHandlerThatEndsTxItselfKeepsRunning(t *testing.T) {
	// A handler that ends the transaction itself, against Tx's contract,
	// and runs on: one that committed still holds its key by the claim's
	// committed row, and its context must not end (a handler cut short
	// would answer 5xx, and the release would let a retry run its
	// committed work again); one that rolled back lost its claim, and its
	// context ends.
	for _, tt := range []struct {
		name   string
		end    func(*sql.Tx) error
		lost   bool
		status int
	}{
		{"committed", (*sql.Tx).Commit, false, http.StatusCreated},
		{"rolled back", (*sql.Tx).Rollback, true, http.StatusServiceUnavailable},
	} {
		t.Run(tt.name, func(t *testing.T) {
			db := newTestDB(t, 4)
			s := extendsSeen{Store: db.newStore(t, WithTransactional()), extends: make(chan error)}
			h := idemserver.Middleware(s, idemserver.WithLease(300*time.Millisecond))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if !assert.NoError(t, tt.end(Tx(r.Context()))) {
					return
				}
				if tt.lost {
					select {
					case <-r.Context().Done():
						assert.ErrorIs(t, context.Cause(r.Context()), idemserver.ErrLeaseLost)
					case <-time.After(10 * time.Second):
						t.Error("the handler's context did not end")
					}
				} else {
				extensions:
					for range 3 {
						select {
						case err := <-s.extends:
							assert.NoError(t, err)
						case <-r.Context().Done():
							t.Errorf("the handler's context ended: %v", context.Cause(r.Context()))
							break extensions
						}
					}
				}
				w.WriteHeader(http.StatusCreated)
			}))
			status, body, _ := post(h, "k")
			assert.Equal(t, tt.status, status, body)
		})
	}
}

// connectWithPid opens a pool of one connection, with open, whose server
// process has the pid that the ended process pid had, as a restarted server
// (whose processes, in a container, get the same pids again) or a busy one
// (whose pids wrap around) gives a new session. It sets the kernel's last
// pid, which takes privileges: without them the test skips. Another process
// of the machine may take the pid first; it tries again then.
func connectWithPid(t *testing.T, open func() *sql.DB, pid int) *sql.DB {
	t.Helper()
	const lastPid = "/proc/sys/kernel/ns_last_pid"
	for range 50 {
		pool := open()
		if err := os.WriteFile(lastPid, []byte(strconv.Itoa(pid-1)), 0); err != nil {
			t.Skipf("a session cannot be given a pid here: %v", err)
		}
		var got int
		require.NoError(t, pool.QueryRowContext(t.Context(), "SELECT pg_backend_pid()").Scan(&got))
		if got == pid {
			return pool
		}
		require.NoError(t, pool.Close())
	}
	t.Skip("the machine's other processes took the pid every time")
	return nil
}

// claimWithPid claims key "k", as a duplicate of an ended claim whose
// server process was pid, in a transactional store over a pool from open
// whose session has that pid again (see connectWithPid). It returns the
// store, the claim and the claimed request's context.
func claimWithPid(t *testing.T, open func() *sql.DB, pid int, opts ...Option) (*Store, idemserver.Claim, context.Context) {
	t.Helper()
	pool := connectWithPid(t, open, pid)
	pool.SetMaxOpenConns(2) // one for the duplicate's claim, one for its check
	dup, err := New(pool, append(opts, WithTransactional())...)
	require.NoError(t, err)
	d := testClaim("k", time.Minute)
	d.Token = "token-duplicate"
	res, err := dup.Claim(t.Context(), d)
	require.NoError(t, err)
	require.True(t, res.Claimed, "the first claim's session ended: the duplicate claims the key")
	t.Cleanup(func() { _ = dup.Release(context.WithoutCancel(res.Context), d.Key, d.Token) })
	require.Equal(t, pid, backendPid(t, res.Context))
	return dup, d, res.Context
}

func TestTransactionalExtendDoesNotTakeANewSessionForTheClaims(t *testing.T) {
	// The server ends the session of a claim while its handler runs, and
	// a duplicate claims the key at once, on a new session whose server
	// process happens to have the pid the claim's had: after a restart of
	// a server in a container the pids come again in the same order, and a
	// server's pids wrap around. The duplicate's transaction holds the
	// key's advisory lock under that pid. Extend must still report the
	// first claim lost: its handler would otherwise go on acting beside
	// the duplicate's.
	db := newTestDB(t, 2)
	s := db.newStore(t, WithTransactional())
	c, ctx := openClaim(t, s, "k")

	pid := backendPid(t, ctx)
	var ok bool
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT pg_terminate_backend($1, 10000)", pid).Scan(&ok))
	require.True(t, ok)

	dup, d, dctx := claimWithPid(t, func() *sql.DB { return db.open(t, 1) }, pid, WithTable(s.table.name))

	require.ErrorIs(t, s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)), idemserver.ErrLeaseLost,
		"the duplicate holds the key, in a session of the same pid")
	require.NoError(t, dup.Extend(dctx, d.Key, d.Token, time.Now().Add(time.Minute)))
}

func TestTransactionalExtendSeesACommitThatReleasedTheLock(t *testing.T) {
	// A handler commits Tx itself while extensions of its claim are
	// checked. The commit releases the key's lock and makes the claim's
	// row visible, in that order; a check that read both under one
	// statement's snapshot, taken before the commit, would see neither
	// and report the claim lost, and the handler, cut short, would
	// answer 5xx, whose release lets a retry run its committed work
	// again.
	db := newTestDB(t, 8)
	s := db.newStore(t, WithTransactional())
	for i := range 200 {
		c, ctx := openClaim(t, s, fmt.Sprintf("k%d", i))

		checked := make(chan error)
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for range 3 {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					case checked <- s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)):
					}
				}
			})
		}
		require.NoError(t, <-checked)
		require.NoError(t, Tx(ctx).Commit())
		for range 9 { // some checks span the commit, and some follow it
			require.NoError(t, <-checked, "a claim whose handler committed it, at try %d", i)
		}
		close(stop)
		wg.Wait()
		require.NoError(t, s.Release(context.WithoutCancel(ctx), c.Key, c.Token)) // frees its connection
	}
}

func TestTransactionalExtendPastTwoToTheThirtyTwoTransactions(t *testing.T) {
	// A claim's transaction id, from txid_current, counts the times the
	// server's 32-bit ids wrapped around; pg_locks shows the 32-bit id.
	// Past 2^32 transactions, and with an id whose top bit is set, the
	// check must still find an open claim held, and one whose session
	// ended lost.
	srv := startPrivateServer(t)
	srv.setNextXid(1, 1<<31+1<<20)
	db := srv.open(t, 2)
	s, err := New(db, WithTransactional())
	require.NoError(t, err)
	require.NoError(t, s.Migrate(t.Context()))
	c, ctx := openClaim(t, s, "k")
	require.Equal(t, int64(1)<<32+1<<31+1<<20+1, txid(t, ctx),
		"the claim's transaction is the second since the reset, Migrate's the first")

	requireHeldUntilSessionEnds(t, db, s, c, ctx)
}

// requireHeldUntilSessionEnds checks that the open claim c, whose request's
// context is ctx, holds at each of three extensions, and is lost once db
// ended its session.
func requireHeldUntilSessionEnds(t *testing.T, db *sql.DB, s *Store, c idemserver.Claim, ctx context.Context) {
	t.Helper()
	for range 3 {
		require.NoError(t, s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)))
	}
	var ok bool
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT pg_terminate_backend($1, 10000)", backendPid(t, ctx)).Scan(&ok))
	require.True(t, ok)
	require.ErrorIs(t, s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)), idemserver.ErrLeaseLost)
}

func TestTransactionalExtendDoesNotTakeASessionOfACrashedServerForTheClaims(t *testing.T) {
	// The server, or one of its processes, crashes while a claim's
	// handler runs; the server comes back at once, restarted or only
	// recovered, and a duplicate claims the key. The duplicate's
	// transaction may get the claim's id: the claim's never committed,
	// and when nothing wrote its WAL before the crash, the server hands
	// out its id again. Its session's process may get the claim's pid: a
	// restarted container's processes get the same pids again, in the
	// same order, and a machine's pids wrap around. The duplicate's
	// transaction then holds the key's lock under the claim's pid and
	// transaction id. Extend must still report the first claim lost: its
	// handler would otherwise go on acting beside the duplicate's.
	for _, tt := range []struct {
		name  string
		crash func(*privateServer)
	}{
		{"restarted", (*privateServer).crash},        // power lost, container killed
		{"recovered", (*privateServer).crashProcess}, // a process killed by the OOM killer
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := startPrivateServer(t)
			s, err := New(srv.open(t, 2), WithTransactional())
			require.NoError(t, err)
			require.NoError(t, s.Migrate(t.Context()))
			c, ctx := openClaim(t, s, "k")
			pid, xid := backendPid(t, ctx), txid(t, ctx)

			tt.crash(srv)
			dup, d, dctx := claimWithPid(t, func() *sql.DB { return srv.open(t, 1) }, pid)
			require.Equal(t, xid, txid(t, dctx), "the server gave the duplicate's transaction the claim's id")

			// The first check may meet a connection the crash broke, and
			// report nothing.
			assert.Eventually(t, func() bool {
				return errors.Is(s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)), idemserver.ErrLeaseLost)
			}, 5*time.Second, 10*time.Millisecond, "the duplicate holds the key, in a session of the same pid and a transaction of the same id")
			require.NoError(t, dup.Extend(dctx, d.Key, d.Token, time.Now().Add(time.Minute)))
		})
	}
}

func TestTransactionalExtendUnderARoleThatCannotSeeTheSession(t *testing.T) {
	// A connection whose role may not see other sessions' activity (a
	// handler left a SET ROLE on it, against the package's advice) must
	// still find a live claim held, and one whose session ended lost.
	db := newTestDB(t, 2)
	s := db.newStore(t, WithTransactional())
	role := "idemtest_role_" + db.schema
	_, err := db.ExecContext(t.Context(), "CREATE ROLE "+role)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP ROLE "+role) })
	_, err = db.ExecContext(t.Context(), fmt.Sprintf("GRANT USAGE ON SCHEMA %s TO %s; GRANT SELECT ON %s TO %[2]s", db.schema, role, s.table.quoted()))
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP OWNED BY "+role) })
	c, ctx := openClaim(t, s, "k")

	// The pool's other connection, the check's, takes the role.
	_, err = db.ExecContext(t.Context(), "SET ROLE "+role)
	require.NoError(t, err)
	var seen sql.NullTime
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT backend_start FROM pg_stat_get_activity($1)", backendPid(t, ctx)).Scan(&seen))
	require.False(t, seen.Valid, "the role does not see when the claim's session began")
	for range 3 {
		require.NoError(t, s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)))
	}

	_, err = db.ExecContext(t.Context(), "RESET ROLE")
	require.NoError(t, err)
	var ok bool
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT pg_terminate_backend($1, 10000)", backendPid(t, ctx)).Scan(&ok))
	require.True(t, ok)
	_, err = db.ExecContext(t.Context(), "SET ROLE "+role)
	require.NoError(t, err)
	require.ErrorIs(t, s.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Minute)), idemserver.ErrLeaseLost)
	_, err = db.ExecContext(t.Context(), "RESET ROLE")
	require.NoError(t, err)
}

func TestTransactionalExtendHoldsWhenTheClockSeemsSteppedBack(t *testing.T) {
	// The database server's clock is stepped back between the start of a
	// claim's session and the start of its transaction: by that clock, the
	// session began after the transaction. The real clock cannot be
	// stepped here, so the check's connection is shown that reckoning
	// instead: a pg_stat_get_activity of the test's schema, found before
	// pg_catalog's, reports every session as begun an hour from now. A
	// live claim must hold whatever the clock says.
	db := newTestDB(t, 2)
	s := db.newStore(t, WithTransactional())
	_, err := db.ExecContext(t.Context(), `CREATE FUNCTION pg_stat_get_activity(pid int, OUT backend_start timestamptz)
	RETURNS SETOF timestamptz LANGUAGE sql AS $$ SELECT now() + interval '1 hour' $$`)
	require.NoError(t, err)
	c, ctx := openClaim(t, s, "k")

	// The pool's other connection, the check's, searches the test's
	// schema first.
	_, err = db.ExecContext(t.Context(), "SET search_path = "+db.schema+", pg_catalog")
	require.NoError(t, err)
	var start time.Time
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT backend_start FROM pg_stat_get_activity($1)", backendPid(t, ctx)).Scan(&start))
	require.True(t, start.After(time.Now()), "the check's connection sees the claim's session begin after its transaction")
	requireHeldUntilSessionEnds(t, db.DB, s, c, ctx)
}

func TestTransactionalClaimFailsWhenItsTokensLockIsHeld(t *testing.T) {
	// Only a claim's own transaction takes its token's lock, which is
	// what tells its check the transaction is open. A claim that finds
	// the lock held elsewhere (a token reused, or a collision of two
	// 64-bit hashes) could be taken for alive after its transaction
	// ended: it must fail, writing nothing and holding nothing.
	db := newTestDB(t, 2)
	s := db.newStore(t, WithTransactional())
	c := testClaim("k", time.Minute)
	conn, err := db.Conn(t.Context())
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(t.Context(), "SELECT pg_advisory_lock($1 # $2::regclass::oid::int8)", s.tokenLockID(c.Token), s.table.quoted())
	require.NoError(t, err)

	res, err := s.Claim(t.Context(), c)
	if err == nil && res.Claimed {
		t.Cleanup(func() { _ = s.Release(context.WithoutCancel(res.Context), c.Key, c.Token) })
	}
	require.ErrorContains(t, err, "another session holds the advisory lock of the claim's token")
	require.NotErrorIs(t, err, idemserver.ErrLeaseLost)
	var n int
	require.NoError(t, db.QueryRowContext(t.Context(), "SELECT count(*) FROM "+s.table.quoted()).Scan(&n))
	assert.Zero(t, n, "the failed claim wrote nothing")

	// It holds neither the key nor a connection: a claim with a new
	// token gets the key.
	_, err = conn.ExecContext(t.Context(), "SELECT pg_advisory_unlock_all()")
	require.NoError(t, err)
	require.NoError(t, conn.Close())
	c.Token = "token-new"
	res, err = s.Claim(t.Context(), c)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.NoError(t, s.Release(res.Context, c.Key, c.Token))
}
