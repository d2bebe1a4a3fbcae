package pgstore

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"database/sql/driver"
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/idemhttp/idemhttp/idemserver"
)

// WithTransactional makes the store run each claimed request in one
// transaction: the claim, the handler's own writes (through [Tx]) and the
// stored response commit together, so a crash anywhere leaves all of them
// or none. See the package documentation.
func WithTransactional() Option {
	return func(c *config) { c.transactional = true }
}

// Tx returns the transaction of the claimed request whose context is ctx
// (the handler's r.Context()), in which the handler does its own writes. It
// returns nil outside transactional mode, and for a context without a claim.
//
// The handler must not commit or roll the transaction back: the store does,
// when the middleware completes or releases the claim. (If a handler
// commits it anyway, Complete stores the response after that commit, not
// atomically with it, and Release deletes the committed claim, so that a
// retry runs again; if it rolls back, Complete reports the rollback, and
// Release has nothing to do, and the claim is gone: a handler still
// running at its next extension has its context ended, see Extend.)
func Tx(ctx context.Context) *sql.Tx {
	if st, _ := ctx.Value(txKey{}).(*txState); st != nil {
		return st.tx
	}
	return nil
}

// Rerun asks for the request whose context is ctx to run again from the
// start, if err is a serialization failure or a deadlock (SQLSTATE 40001 or
// 40P01), and reports whether it did. A handler calls it when a statement
// in [Tx] fails, before it answers with an error: the store then rolls the
// transaction back and the middleware runs the request again, in a new
// transaction, up to [idemserver.MaxReruns] times, instead of sending the
// error. Failures the store meets itself, in its last write or the commit,
// are rerun without it. A rerun repeats whatever the handler did outside
// the database, as any retry after a 5xx does (see
// [idemserver.MaxReruns]).
func Rerun(ctx context.Context, err error) bool {
	st, _ := ctx.Value(txKey{}).(*txState)
	if st == nil || !retryable(err) {
		return false
	}
	st.rerun.Store(true)
	return true
}

// HoldResponses implements [idemserver.ResponseHolder]: in transactional
// mode no part of a response may reach the client before the commit. Each
// claim won in that mode says so too, in [idemserver.ClaimResult.Hold],
// which holds the response behind a wrapper of the store that does not
// define HoldResponses.
func (s *Store) HoldResponses() bool { return s.transactional }

type txKey struct{}

// txState is a claim in transactional mode: its open transaction, and the
// pool connection the transaction runs on, which is the claim's alone until
// the claim ends. Whoever ends the transaction, by commit, rollback or
// through the store after the handler ended it, returns the connection to
// the pool.
type txState struct {
	conn *sql.Conn
	tx   *sql.Tx
	// cancel ends the transaction's context, which the driver's COMMIT
	// and ROLLBACK run under (database/sql's take none): rollback ends it
	// with the context of the store call that ends the claim, so that a
	// connection gone silent fails that call at its deadline instead of
	// holding it until the kernel gives up. (A COMMIT is not cancelled;
	// see commit.)
	cancel context.CancelFunc
	key    idemserver.Key
	token  string
	held   int64       // the token's advisory lock, which only the transaction holds (see tokenLockID)
	at     string      // the ctid of the row the claim inserted, or "" (see completeAt)
	rerun  atomic.Bool // the handler asked for a rerun
	ended  atomic.Bool // committed or rolled back
}

// begin takes a connection from the pool and begins the transaction of
// claim c on it. The wait for a free connection ends with ctx, or at the
// store's bound (see WithPoolWait): a request whose client left, or whose
// deadline passed, or that waited too long, does not wait on a pool that
// every other claim's transaction holds. The transaction does not end with
// ctx (see claimTx).
func (s *Store) begin(ctx context.Context, c idemserver.Claim) (*txState, error) {
	var st *txState
	err := s.onConn(ctx, func(conn *sql.Conn) error {
		txCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		tx, err := conn.BeginTx(txCtx, nil)
		if err != nil {
			cancel()
			// Back to the pool; one the driver reported bad was closed
			// and discarded already.
			_ = conn.Close()
			return err
		}
		st = &txState{conn: conn, tx: tx, cancel: cancel, key: c.Key, token: c.Token}
		return nil
	})
	return st, err
}

// commit commits the claim's transaction and returns its connection to
// the pool. When ctx ends before the server answers the COMMIT, commit
// returns, with an error that says nothing of whether the server
// committed, and leaves the COMMIT to finish: it is not cancelled. A
// server that waits for a synchronous standby to confirm a commit before
// it reports it, and is cancelled meanwhile, reports the commit made
// without the standby (a WARNING, not an error), and a driver cancels
// that way when its context ends, even as it drops the connection: the
// retry would then replay a transaction that a failover to the standby
// loses. Left to finish, the COMMIT holds the claim's locks until the
// standby confirms it, so that a retry finds the key in progress until
// then. Its connection returns to the pool when the server answers, or
// when the operating system gives up on it. The goroutine that waits for
// the answer is the connection's: it ends then, and nothing else ends it
// (sql.DB.Close closes idle connections only; see the package
// documentation).
func (st *txState) commit(ctx context.Context) error {
	done := make(chan error, 1)
	go func() { done <- st.end(context.Background(), st.tx.Commit) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// rollback rolls the claim's transaction back and returns its connection
// to the pool. A ROLLBACK still out when ctx ends is abandoned: the
// driver closes the connection, and the server rolls back a transaction
// whose connection closed.
func (st *txState) rollback(ctx context.Context) error {
	return st.end(ctx, st.tx.Rollback)
}

func (st *txState) end(ctx context.Context, f func() error) error {
	err := within(ctx, st, f)
	st.closeConn()
	return err
}

// within runs f, which commits or rolls back the claim's transaction,
// ending the transaction's context when ctx ends first.
func within(ctx context.Context, st *txState, f func() error) error {
	stop := context.AfterFunc(ctx, st.cancel)
	defer stop()
	return f()
}

// closeConn returns the claim's connection to the pool, once its
// transaction has ended: sql.Conn.Close waits for an open one. A
// connection that went bad is closed already, and discarded.
func (st *txState) closeConn() {
	st.cancel()
	_ = st.conn.Close()
}

// stateOf returns the open claim that ctx carries for key and token, or
// nil.
func stateOf(ctx context.Context, key idemserver.Key, token string) *txState {
	st, _ := ctx.Value(txKey{}).(*txState)
	if st == nil || st.key != key || st.token != token || st.ended.Load() {
		return nil
	}
	return st
}

// claimTx claims c.Key in transactional mode.
//
// It first reads the key's row outside any transaction: a completed record
// is replayed in that one round trip. Otherwise it begins a transaction and
// runs one statement that takes, without waiting
// (pg_try_advisory_xact_lock), a transaction-scoped advisory lock on the
// key and another on the claim's token (see tokenLockID) and, with both,
// inserts the claim. A claimant that does not get the lock knows another
// holds an uncommitted claim of the key and reports it in progress at once:
// it neither waits on the other's row nor holds a connection afterwards.
// A won claim's transaction keeps its connection (see txState). The insert
// still settles races with claims that committed after the statement's
// snapshot, as in lease mode.
func (s *Store) claimTx(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, sql.NullString, error) {
	scope, lease := []byte(c.Key.Scope), c.LeaseExpires.Sub(c.Now)
	claimed := func(st *txState) (idemserver.ClaimResult, sql.NullString, error) {
		// Hold: nothing may reach the client before the commit, also
		// when a wrapper hides HoldResponses.
		return idemserver.ClaimResult{Claimed: true, Hold: true, Context: context.WithValue(ctx, txKey{}, st)}, sql.NullString{}, nil
	}
	for run := 0; run < maxClaimRuns; run++ {
		if run > 0 && s.testHookRerun != nil {
			s.testHookRerun()
		}
		res, stored, found, err := s.read(ctx, c)
		if err != nil || found {
			return res, stored, err
		}

		// The transaction outlives the request's context: a handler that
		// finished after its client left still commits, so the client's
		// retry gets the replay. The middleware ends it. Only the wait
		// for its connection ends with the request.
		if s.testHookBegin != nil {
			s.testHookBegin()
		}
		st, err := s.begin(ctx, c)
		if err != nil {
			return idemserver.ClaimResult{}, sql.NullString{}, fmt.Errorf("pgstore: begin: %w", err)
		}
		var (
			locked, tokenLocked bool
			at                  sql.NullString
			r                   row
		)
		err = st.tx.QueryRowContext(ctx, s.stmt().claimTx, scope, c.Key.Key, c.Fingerprint[:], c.Token, seconds(lease), s.lockID(c.Key), s.sweepAfter(lease), s.tokenLockID(c.Token)).
			Scan(append([]any{&locked, &tokenLocked, &at, &st.held}, r.dest()...)...)
		won := at.Valid
		st.at = at.String
		switch {
		case err == nil && locked && !tokenLocked:
			// Another session holds the token's lock: a token reused, or
			// a collision of two 64-bit hashes. The check of this claim
			// could not tell its transaction from the other's, so the
			// claim fails closed.
			_ = st.rollback(context.Background())
			return idemserver.ClaimResult{}, sql.NullString{}, errors.New("pgstore: claim: another session holds the advisory lock of the claim's token; each claim needs a new token")
		case err == nil && won:
			return claimed(st)
		case err == nil && locked && r.token.Valid && r.expired():
			// A completed record that expired: replace it in the
			// transaction, unless someone else did first.
			ok, err := s.replace(ctx, st.tx, c, r.token.String)
			if err == nil && ok {
				return claimed(st)
			}
			_ = st.rollback(context.Background())
			if err != nil && !retryable(err) {
				return idemserver.ClaimResult{}, sql.NullString{}, err
			}
			continue
		}
		_ = st.rollback(context.Background())
		switch {
		case retryable(err):
			continue
		case err != nil:
			return idemserver.ClaimResult{}, sql.NullString{}, fmt.Errorf("pgstore: claim: %w", err)
		case !locked:
			// Another transaction holds an uncommitted claim of the key,
			// whose fingerprint cannot be read: report it in progress as
			// if it were this request's, so that a duplicate is told to
			// retry (409) or waits, and never takes it over.
			return idemserver.ClaimResult{Record: idemserver.Record{
				Fingerprint:  c.Fingerprint,
				LeaseExpires: c.LeaseExpires,
			}}, sql.NullString{}, nil
		case !r.token.Valid:
			// The row was committed after the statement's snapshot.
			continue
		}
		rec, err := s.record(c, &r)
		if err != nil {
			return idemserver.ClaimResult{}, sql.NullString{}, err
		}
		return idemserver.ClaimResult{Record: rec}, r.response, nil
	}
	return idemserver.ClaimResult{}, sql.NullString{}, s.unsettled(c)
}

// read reads the row of c.Key outside any transaction, and reports whether
// it settles the claim: a live record (a completed one to replay, whose
// response it returns as stored, or one in progress in lease mode). An
// absent or expired row does not.
//
// It takes its connection as begin does, so that its wait is bounded too.
func (s *Store) read(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, sql.NullString, bool, error) {
	var r row
	err := s.onConn(ctx, func(conn *sql.Conn) error {
		r = row{}
		err := conn.QueryRowContext(ctx, s.stmt().read, []byte(c.Key.Scope), c.Key.Key).Scan(r.dest()...)
		_ = conn.Close()
		return err
	})
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return idemserver.ClaimResult{}, sql.NullString{}, false, nil
	case err != nil:
		return idemserver.ClaimResult{}, sql.NullString{}, false, fmt.Errorf("pgstore: claim: %w", err)
	case r.expired():
		return idemserver.ClaimResult{}, sql.NullString{}, false, nil
	}
	rec, err := s.record(c, &r)
	if err != nil {
		return idemserver.ClaimResult{}, sql.NullString{}, false, err
	}
	return idemserver.ClaimResult{Record: rec}, r.response, true, nil
}

// lockID returns the advisory lock of a key: 64 bits of a SHA-256 of the
// table and the key, so that no tenant can pick keys whose locks collide
// with another's. The claim mixes the table's oid into it, since the
// table's name may lack a schema. The name hashed is the one given to
// WithTable, not the one with the schema the store found (see resolve),
// so that every instance of a table takes the same lock for a key,
// whichever build it runs.
func (s *Store) lockID(k idemserver.Key) int64 {
	return lockHash(s.table.quoted(), k.Scope, k.Key)
}

// tokenLockID returns the advisory lock of a claim's token in
// transactional mode: 64 bits of a SHA-256 of a prefix of its own, the
// table and the token, which the claim mixes with the table's oid as it
// does the key's. The claim's transaction takes it, and nothing else
// does: tokens are random and new to each claim, so that some session
// holds the lock exactly while the claim's transaction is open (see
// extendTx). Its first part, unlike a key lock's, is no quoted name, so
// the two never hash the same input; they share the database's one lock
// space, where a collision of two 64-bit hashes, at odds of 2^-64 a pair,
// is accepted.
func (s *Store) tokenLockID(token string) int64 {
	return lockHash("pgstore token", s.table.quoted(), token)
}

// lockHash returns 64 bits of a SHA-256 of parts, each prefixed with its
// length, so that no two lists of parts hash the same input.
func lockHash(parts ...string) int64 {
	h := sha256.New()
	var n [binary.MaxVarintLen64]byte
	for _, part := range parts {
		h.Write(n[:binary.PutUvarint(n[:], uint64(len(part)))])
		h.Write([]byte(part))
	}
	var sum [sha256.Size]byte
	return int64(binary.BigEndian.Uint64(h.Sum(sum[:0])))
}

// extendTx reports whether the claim's transaction is still open, as
// Extend does for a lease: it is not once the server ended its session
// (idle_in_transaction_session_timeout, pg_terminate_backend, a restart or
// failover), which ended the transaction, and with it the claim, so that a
// duplicate may run at once. The claim's own connection is not asked: the
// handler may be using it, and a statement there would count as activity
// against idle_in_transaction_session_timeout. Another connection asks
// whether any session holds the advisory lock of the claim's token (see
// tokenLockID), which only the claim's transaction ever takes and which it
// holds until it ends; whatever pids, transaction ids or clocks do after a
// crash or a restart, no other session holds that lock. Only if none does,
// it asks whether the claim's row was committed, by a handler that
// committed the transaction itself (against Tx's contract; its claim still
// holds the key). The row is read by a statement of its own, whose
// snapshot is taken after the lock was seen gone: a transaction releases
// its locks only once its commit is visible, but a statement's snapshot
// is taken when it starts, and one statement that read both could see the
// lock released by a commit it did not see. Only that answer reports the
// claim lost: a check that cannot be made (no free pool connection within
// the store's bound, a failure) reports nothing, since a claim, unlike a
// lease, does not end with time.
func (s *Store) extendTx(ctx context.Context, st *txState) error {
	var held bool
	err := s.onConn(ctx, func(conn *sql.Conn) error {
		defer conn.Close()
		if err := conn.QueryRowContext(ctx, s.stmt().held, st.held).Scan(&held); err != nil || held {
			return err
		}
		var r row
		err := conn.QueryRowContext(ctx, s.stmt().read, []byte(st.key.Scope), st.key.Key).Scan(r.dest()...)
		held = err == nil && r.token.Valid && r.token.String == st.token
		if errors.Is(err, sql.ErrNoRows) {
			err = nil
		}
		return err
	})
	if err == nil && !held {
		return fmt.Errorf("pgstore: the claim's transaction ended: %w", idemserver.ErrLeaseLost)
	}
	return nil
}

// completeTx stores resp in the claim's transaction and commits it.
func (s *Store) completeTx(ctx context.Context, st *txState, ttl float64, encoded []byte) error {
	st.ended.Store(true)
	var n int64
	var err error
	if st.at != "" {
		n, err = execRows(ctx, st.tx, s.stmt().completeAt, []byte(st.key.Scope), st.key.Key, st.token, encoded, ttl, st.at)
	}
	if err == nil && n == 0 {
		// A claim that replaced an expired row read it through the
		// index already. A row the claim inserted is no longer at its
		// ctid once the transaction updated it (the handler, through
		// Tx, or a trigger): its latest version is found by key.
		n, err = execRows(ctx, st.tx, s.stmt().complete, []byte(st.key.Scope), st.key.Key, st.token, encoded, ttl)
	}
	if errors.Is(err, sql.ErrTxDone) {
		return s.completeEndedTx(ctx, st, ttl, encoded)
	}
	if err == nil && n == 0 {
		err = errors.New("the claim's row is gone from its transaction")
	}
	if err != nil {
		_ = st.rollback(ctx)
		return s.rolledBack(st, err)
	}
	err = st.commit(ctx)
	switch {
	case err == nil:
		return nil
	case commitRefused(err):
		// The server refused the COMMIT: it rolled back.
		return s.rolledBack(st, err)
	}
	// The connection failed during the COMMIT, or something other than
	// the server's refusal answered it: it may or may not have committed.
	// Nothing may be released; the client's retry reads what the table
	// holds.
	return fmt.Errorf("pgstore: commit: %w: %w", idemserver.ErrOutcomeUnknown, err)
}

// completeEndedTx stores resp for a claim whose transaction the handler
// ended itself, against Tx's contract. If the handler committed, its writes
// and the claim are kept: the response is stored beside them, in a
// statement of its own, since reporting a rollback that did not happen
// would tell the client nothing was done and leave the claim in progress
// for good (every retry 409, until Sweep removed it and the handler ran
// again). If the handler rolled back, no claim is there and nothing was
// kept.
func (s *Store) completeEndedTx(ctx context.Context, st *txState, ttl float64, encoded []byte) error {
	n, err := s.execEnded(ctx, st, s.stmt().complete, []byte(st.key.Scope), st.key.Key, st.token, encoded, ttl)
	switch {
	case err != nil:
		// Whether the handler committed cannot be told: nothing may be
		// released, and the retry reads what the table holds.
		return fmt.Errorf("pgstore: complete after the handler ended its transaction: %w: %w", idemserver.ErrOutcomeUnknown, err)
	case n == 0:
		return s.rolledBack(st, errors.New("the handler rolled back its transaction itself"))
	}
	return nil
}

// commitRefused reports whether err, from a COMMIT, is the server's answer
// that it rolled the transaction back: a serialization failure or deadlock
// found at commit (SQLSTATE class 40, but for 40003, "statement completion
// unknown", which some PostgreSQL-compatible servers send for a commit
// they cannot vouch for) or a deferred constraint violated (class 23). Any
// other answer may come after the commit was made durable:
// a pooler that lost its server connection answers with one of its own
// (PgBouncer's 08P01), a server being shut down or terminating the session
// with 57P01, and errors past the commit record with whatever they have.
// Reporting those as unknown costs the client nothing, since its retry
// learns from the table what committed.
func commitRefused(err error) bool {
	state := sqlState(err)
	return len(state) == 5 && (state[:2] == "40" && state != "40003" || state[:2] == "23")
}

// rolledBack returns the error of a transaction that was rolled back
// because of err: one that asks for a rerun when err was a serialization
// failure or deadlock, or the handler asked for one.
func (s *Store) rolledBack(st *txState, err error) error {
	if retryable(err) || st.rerun.Load() {
		return fmt.Errorf("pgstore: %w: %w: %w", idemserver.ErrRolledBack, idemserver.ErrRetryRequest, err)
	}
	return fmt.Errorf("pgstore: %w: %w", idemserver.ErrRolledBack, err)
}

// releaseTx rolls the claim's transaction back and returns its connection
// to the pool, or, if the handler ended the transaction itself, releases
// what it left (see releaseEndedTx).
func (s *Store) releaseTx(ctx context.Context, st *txState) error {
	st.ended.Store(true)
	err := within(ctx, st, st.tx.Rollback)
	switch {
	case errors.Is(err, sql.ErrTxDone):
		err = s.releaseEndedTx(ctx, st)
	case errors.Is(err, driver.ErrBadConn):
		st.closeConn()
		err = nil // the server rolls back a transaction whose connection died
	default:
		st.closeConn()
	}
	if st.rerun.Load() {
		return fmt.Errorf("pgstore: release: %w", errors.Join(idemserver.ErrRetryRequest, err))
	}
	if err != nil {
		return fmt.Errorf("pgstore: release: %w", err)
	}
	return nil
}

// releaseEndedTx releases a claim whose transaction the handler ended
// itself, against Tx's contract. If the handler committed, the claim is a
// committed row in progress: it is deleted, by Release's statement of lease
// mode, so that the retry runs at once instead of being told the key is in
// progress for as long as the row is there. If the handler rolled back, no
// row is there, and nothing is left to release.
func (s *Store) releaseEndedTx(ctx context.Context, st *txState) error {
	if _, err := s.execEnded(ctx, st, s.stmt().release, []byte(st.key.Scope), st.key.Key, st.token); err != nil {
		// The claim may still be there, held: the middleware may try
		// the release again.
		st.ended.Store(false)
		return fmt.Errorf("after the handler ended its transaction: %w", err)
	}
	return nil
}

// execEnded runs a statement for a claim whose transaction the handler
// ended, on the claim's own connection, and then returns that connection to
// the pool. On the pool, the statement would need a second connection,
// which could be a wait behind every other claim. If the claim's
// connection went bad, the statement, which was not sent, runs on the pool.
func (s *Store) execEnded(ctx context.Context, st *txState, query string, args ...any) (int64, error) {
	n, err := execRows(ctx, st.conn, query, args...)
	st.closeConn()
	if errors.Is(err, sql.ErrConnDone) || errors.Is(err, driver.ErrBadConn) {
		return execRows(ctx, s.db, query, args...)
	}
	return n, err
}

// sqlState returns the SQLSTATE of an error the server sent, or "" for
// any other error. Drivers expose it through a method of their error type.
func sqlState(err error) string {
	if err == nil {
		return ""
	}
	var e interface{ SQLState() string }
	if errors.As(err, &e) {
		return e.SQLState()
	}
	return ""
}
