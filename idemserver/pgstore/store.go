// Package pgstore is an [idemserver.Store] in PostgreSQL, shared by every
// instance of a service that uses one database.
//
// It works over database/sql with any PostgreSQL driver (such as
// github.com/jackc/pgx/v5/stdlib) and imports none. Each record is a row
// of one table (see [Store.Migrate] and [WithTable]) keyed by scope and
// key.
//
// # Lease mode
//
// By default a claim is a committed row holding a lease, as [idemserver.Store]
// describes, and every method is one statement:
//
//   - Claim reads the row that is there, and inserts one only if it found
//     none, in one round trip; when a row is there it writes nothing: a replay takes
//     no row lock, writes no WAL and waits for no commit. Only when the row
//     found has expired does a second statement take it over, a
//     compare-and-set on its token.
//   - Complete, Release, Extend and TakeOver are compare-and-set statements
//     on the lease token, and report [idemserver.ErrLeaseLost] when the row
//     no longer holds it.
//
// A new key costs two round trips (claim and complete) besides the
// handler's own; a replay costs one.
//
// # Transactional mode
//
// With [WithTransactional], the claim, the handler's own writes and the
// stored response commit in one transaction, so a crash anywhere leaves all
// of them or none, and no lease is needed: a dead process's transaction
// dies with its connection.
//
//   - Claim first reads the key's row outside any transaction, so a replay
//     costs that one round trip and writes nothing. A key without a live
//     record is claimed in a new transaction, by one statement that takes
//     a transaction-scoped advisory lock on the key without waiting
//     (pg_try_advisory_xact_lock) and, holding it, inserts the claim.
//   - The handler writes through [Tx](r.Context()). Complete stores the
//     response in the transaction and commits: one synced commit per
//     request. Release (a 5xx, a panic, a client gone) rolls back.
//   - The transaction is begun under a context that the client's
//     disconnect does not cancel: a handler that finished after its client
//     left still commits, and the client's retry gets the replay.
//   - A claim's waits for a pool connection, for its read and for its
//     transaction, are bounded: each ends at [WithPoolWait]'s bound
//     ([DefaultPoolWait], a second, unless set), or when the request's
//     context ends, if that comes first. A claim that found no free
//     connection in time fails with an error wrapping [ErrPoolTimeout]
//     (or the context's), and the client gets 503 with Retry-After
//     without its handler. Every claim holds a connection while its
//     handler runs, so without the bound a duplicate, or a new key, could
//     wait as long as the slowest handler, under a server without
//     timeouts for good.
//   - A duplicate that arrives while the first is uncommitted does not get
//     the lock: its store ends its own transaction at once and reports the
//     key in progress, so the middleware answers 409 or, with
//     [idemserver.WithWaitInFlight], polls. It never waits on the first
//     claim's row, and holds no connection between polls; its wait for a
//     free pool connection is bounded, as every claim's is.
//   - A claim holds while its transaction is open, however long. The
//     claim's statement also takes, without waiting, an advisory lock on
//     the claim's token, which no other transaction ever takes (tokens
//     are random and new to each claim), and the claim fails if it does
//     not get it. Extend asks, on another pool connection, whether any
//     session holds that lock: which names no pid, transaction id or
//     time, all of which a server gives again or steps after a crash or
//     a restart (or, asked after that, whether the claim's row was
//     committed, by a handler that committed Tx itself): once the server ended the
//     session (idle_in_transaction_session_timeout,
//     pg_terminate_backend, a restart), the claim is gone and a duplicate
//     may run, so Extend reports the claim lost and the middleware ends
//     the handler's context, at the handler's next extension. A check
//     that cannot be made (no free connection) reports nothing.
//   - No part of a response reaches the client before the commit: the
//     store implements [idemserver.ResponseHolder], and sets
//     [idemserver.ClaimResult.Hold] on every claim it wins, so that a
//     store wrapping this one (for metrics or tracing) keeps responses
//     held as long as it returns the ClaimResult whole.
//   - A serialization failure or deadlock (SQLSTATE 40001, 40P01) in
//     Complete's write or the COMMIT makes the store ask the middleware to
//     run the request again, in a new transaction, up to
//     [idemserver.MaxReruns] times; a handler whose own statement fails so
//     asks with [Rerun].
//   - A COMMIT whose outcome is unknown (the connection died during it,
//     it was not answered before the context of the Complete ended, as
//     bounded by [idemserver.WithStoreTimeout], or an error other than the
//     server's refusal answered it, such as a pooler's) is reported with
//     [idemserver.ErrOutcomeUnknown] and never followed by a release: the
//     client gets 503 with Retry-After, and its retry finds in the table
//     what committed. A COMMIT not answered in time is left to finish,
//     not cancelled: one that waits for a synchronous standby goes on
//     waiting, and the key stays in progress (409 to a retry) until the
//     standby confirms it, since a cancelled wait would report the commit
//     made without the standby. Set the store timeout above the longest
//     wait for the standby that should not fail a request. Until the
//     server answers it, such a COMMIT keeps its pool connection, and a
//     goroutine of the store waits for the answer, to return the
//     connection to the pool. Neither ends with the request, nor with
//     the DB's Close, which closes only idle connections: both end when
//     the server answers or the connection fails (the operating system
//     gives up on it, or pg_terminate_backend ends its session).
//
// A new key costs five round trips (read, BEGIN, claim, complete, COMMIT)
// besides the handler's own, a replay one, and a duplicate in flight four
// (read, BEGIN, claim, ROLLBACK). Each claimed request holds a pool
// connection while its handler runs, so size the pool for the requests in
// flight: a claim that waits longer than [WithPoolWait]'s bound for a free
// connection is answered 503.
//
// Set PostgreSQL's idle_in_transaction_session_timeout (it is off by
// default) to bound a transaction whose process hung. A statement of the
// handler's that fails aborts the whole transaction, so that Complete
// cannot store anything and the client gets 503: a handler that answers a
// refusal after a failed statement (a 409 for a unique violation, say)
// runs that statement inside a SAVEPOINT and rolls back to it first. The
// handler must not commit or roll back Tx itself; one that commits it and
// then answers 5xx or panics has its committed claim deleted by the
// release, so that a retry runs again. Nor does it send COMMIT, ROLLBACK
// or END as SQL through Tx, which the store cannot see: its later
// statements would each commit on their own, outside the claim's
// transaction, and a claim rolled back so is run again by every retry,
// with those statements. The handler's SET and set_config also outlive
// the request on its pool connection once the transaction commits: use
// SET LOCAL (or set_config's is_local), or reset the connection in the
// driver's hook for a connection returned to the pool (pgx's
// stdlib.OptionResetSession). The handler may set the search_path
// (SET LOCAL search_path): the store's statements name the schema of
// their table (see [WithTable]). The transaction has the database's
// default isolation level. The advisory locks are 64-bit hashes of the
// table (its oid, whatever schema it is found in) and the scope and key,
// or the token, in the database's one advisory lock space, where a
// collision, at odds of 2^-64 a pair, is accepted. A table
// serves one mode: lease-mode and transactional stores must not share it.
//
// # The clock
//
// The database's clock is the only clock for leases and expiry: statements
// set and compare expires_at with the server's clock (now(), or for the
// retention Complete sets, the time of its own statement, since in
// transactional mode now() is the claim's), so instances whose clocks
// disagree still agree on every lease. The times the middleware passes are
// read as durations: a claim's lease is Claim.LeaseExpires minus
// Claim.Now, and the expiry given to Complete or Extend is measured from
// the moment of the call on the store's clock, which must be the
// middleware's: time.Now, unless [WithClock] gives the store the clock
// given to [idemserver.WithClock]. A claim stamped by a clock far from the
// store's fails (see [ErrClockSkew]) rather than have its record kept for
// the wrong time. The times the store reports (a record's LeaseExpires and
// Expires) are Claim.Now plus what remains by the database's clock, so the
// middleware compares them with Claim.Now as it would a time of its own,
// and a faked clock, given to both, does not move the database's.
//
// So the database server's clock must be slewed, not stepped: a step
// forward ends every lease and retention it passes at once, so that a
// retry takes over a handler that is still running, or runs again a key
// whose outcome was stored, and the handler runs twice.
//
// # Stored responses
//
// A response is kept in a bytea column in a compact binary form whose
// first byte is its format version (see internal/respcodec), so a later
// release reads what an earlier one wrote. The store implements
// [idemserver.PackedStore]: it translates between that form and the
// middleware's packed form of a response directly, so that neither a
// claim nor a replay makes a Response (a header map, its slices and
// strings) on the way. A response written by a release with a newer format, or damaged,
// is not guessed at: Claim fails with an error that says so, and the
// middleware answers 503 until the record expires or a release that reads
// it is deployed.
//
// # Expired rows
//
// Expired rows are replaced by the next claim of their key, and otherwise
// stay until [Store.Sweep] deletes them, which it does once their sweep_at
// passes: a time never before they expire, set a guessed retention past a
// claim's lease so that the complete is a HOT update (see docs/pgstore.md).
package pgstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/internal/respcodec"
)

// A Store keeps idempotency records in a PostgreSQL table. It is safe for
// concurrent use, and any number of Stores, in any number of processes, may
// share one table.
type Store struct {
	db            *sql.DB
	table         tableName  // as named, which the advisory locks hash (see lockID)
	named         statements // over the table as named (see Migrate)
	transactional bool
	now           func() time.Time
	poolWait      time.Duration // see WithPoolWait

	// q holds the statements over the table named with its schema, once
	// that is known (see resolve).
	q atomic.Pointer[statements]

	// retention is the retention the last Complete was given, and until
	// then idemserver.DefaultTTL: a claim sets its row's sweep_at that
	// far past the end of its lease, so that its complete need not move
	// sweep_at (see newStatements).
	retention atomic.Int64

	// testHookRerun, when set, is called each time a claim statement
	// is run again; see claim.
	testHookRerun func()
	// testHookBegin, when set, is called each time a transactional
	// claim is about to take the connection of its transaction; see
	// claimTx.
	testHookBegin func()
}

// An Option configures a [Store].
type Option func(*config)

type config struct {
	table         string
	transactional bool
	now           func() time.Time
	poolWait      time.Duration
}

// WithClock sets the clock the store reads to turn the times that Complete
// and Extend are given into durations: it must be the middleware's (see
// [idemserver.WithClock]). Nil means time.Now, the middleware's default.
//
// A claim stamped more than [MaxClockSkew] away from this clock fails with
// an error wrapping [ErrClockSkew], so that a middleware with a clock of its
// own and a store without it are refused (503) rather than keep records and
// leases for the wrong time.
func WithClock(now func() time.Time) Option {
	return func(c *config) { c.now = now }
}

// MaxClockSkew is how far a claim's time (Claim.Now) may be from the
// store's clock (see [WithClock]).
const MaxClockSkew = 5 * time.Second

// ErrClockSkew is returned, wrapped, by Claim and TakeOver for a claim
// whose time is more than [MaxClockSkew] from the store's clock.
var ErrClockSkew = errors.New("pgstore: the middleware's clock is not the store's; see pgstore.WithClock")

// WithTable sets the table that holds the records: a name, or a schema and
// a name joined by a dot, each an ASCII letter or underscore followed by up
// to 62 ASCII letters, digits or underscores (the table's name at most
// 52, so that its index's name fits). Names are used quoted, so they are
// case-sensitive. The default is [DefaultTable].
//
// A name without a schema is looked up in the search_path once: by
// [Store.Migrate], or else by the store's first statement. From then on
// every statement names the schema it was found in, so that a handler
// that sets the search_path in its transaction (SET LOCAL search_path, as
// an app with a schema per tenant does) moves none of the store's
// statements to another table, such as a tenant's table of the same
// name.
func WithTable(name string) Option {
	return func(c *config) { c.table = name }
}

// New returns a Store over db configured by opts. It does not touch the
// database; call [Store.Migrate] to create the table, or create it
// yourself (a name without a schema is looked up when the store is first
// used, see [WithTable]). New fails only for a nil db or a table name that [WithTable]
// does not accept.
func New(db *sql.DB, opts ...Option) (*Store, error) {
	if db == nil {
		return nil, errors.New("pgstore: nil *sql.DB")
	}
	cfg := config{table: DefaultTable}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.now == nil {
		cfg.now = time.Now
	}
	if cfg.poolWait <= 0 {
		cfg.poolWait = DefaultPoolWait
	}
	t, err := parseTable(cfg.table)
	if err != nil {
		return nil, err
	}
	s := &Store{db: db, table: t, named: newStatements(t), transactional: cfg.transactional, now: cfg.now, poolWait: cfg.poolWait}
	if t.schema != "" {
		s.q.Store(&s.named)
	}
	s.retention.Store(int64(idemserver.DefaultTTL))
	return s, nil
}

// checkClock returns an error wrapping ErrClockSkew when c was stamped too
// far from the store's clock.
func (s *Store) checkClock(c idemserver.Claim) error {
	if d := c.Now.Sub(s.now()); d > MaxClockSkew || d < -MaxClockSkew {
		return fmt.Errorf("%w: claim of %q stamped %v from it", ErrClockSkew, c.Key.Key, d)
	}
	return nil
}

// maxClaimRuns bounds how many times one claim runs its statement: each
// run after the first follows a concurrent change to the same key (a claim
// committed after the statement's snapshot, a takeover, a sweep), so a
// claim that has not settled after this many is reported as an error.
const maxClaimRuns = 8

// Claim implements [idemserver.Store] in one round trip, or two when the
// row found has expired and is replaced.
func (s *Store) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	res, stored, err := s.claimAny(ctx, c, false, "")
	return s.decoded(c.Key, res, stored, err)
}

// TakeOver implements [idemserver.Store]: it replaces the row if it still
// holds expiredToken and its lease has ended by the database's clock, and
// otherwise claims the key as Claim does.
func (s *Store) TakeOver(ctx context.Context, c idemserver.Claim, expiredToken string) (idemserver.ClaimResult, error) {
	res, stored, err := s.claimAny(ctx, c, true, expiredToken)
	return s.decoded(c.Key, res, stored, err)
}

// ClaimPacked implements [idemserver.PackedStore]: it is Claim, or
// TakeOver when c.TakeOver is set, and returns the response of a completed
// record packed, translated from the stored form without a Response in
// between. It makes the lease token with c.NewToken, when set,
// before it sends the claim, which carries the token.
func (s *Store) ClaimPacked(ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error) {
	claim := c.Claim
	if c.NewToken != nil {
		claim.Token = c.NewToken()
	}
	res, stored, err := s.claimAny(ctx, claim, c.TakeOver, c.ExpiredToken)
	if err != nil {
		return idemserver.PackedClaimResult{}, err
	}
	out := idemserver.PackedClaimResult{ClaimResult: res}
	switch {
	case res.Claimed:
		out.Token = claim.Token
	case stored.Valid:
		if out.Response, err = respcodec.Packed(stored.String); err != nil {
			return idemserver.PackedClaimResult{}, s.unreadable(c.Key, err)
		}
	}
	return out, nil
}

// claimAny claims c.Key, or takes over expiredToken's lease when takeOver
// is set, and returns the response of a completed record found as stored.
func (s *Store) claimAny(ctx context.Context, c idemserver.Claim, takeOver bool, expiredToken string) (idemserver.ClaimResult, sql.NullString, error) {
	if err := s.checkClock(c); err != nil {
		return idemserver.ClaimResult{}, sql.NullString{}, err
	}
	if _, err := s.statements(ctx); err != nil {
		return idemserver.ClaimResult{}, sql.NullString{}, err
	}
	if s.transactional {
		// A claim in transactional mode has no lease to take over: it
		// ends with its transaction.
		return s.claimTx(ctx, c)
	}
	if takeOver {
		ok, err := s.replace(ctx, s.db, c, expiredToken)
		if err != nil || ok {
			return idemserver.ClaimResult{Claimed: ok}, sql.NullString{}, err
		}
	}
	return s.claim(ctx, s.db, c)
}

// decoded returns res with the stored response, if any, decoded into its
// record.
func (s *Store) decoded(key idemserver.Key, res idemserver.ClaimResult, stored sql.NullString, err error) (idemserver.ClaimResult, error) {
	if err != nil || !stored.Valid {
		return res, err
	}
	if res.Record.Response, err = respcodec.Decode([]byte(stored.String)); err != nil {
		return idemserver.ClaimResult{}, s.unreadable(key, err)
	}
	return res, nil
}

// unreadable returns the error of a stored response of key that cannot be
// read.
func (s *Store) unreadable(key idemserver.Key, err error) error {
	return fmt.Errorf("pgstore: the stored response of key %q in %s cannot be read: %w", key.Key, s.table.quoted(), err)
}

// querier is what the store's statements run on: a pool or a transaction.
type querier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// claim runs the claim statement on q until it settles, and returns the
// response of a completed record found as stored.
func (s *Store) claim(ctx context.Context, q querier, c idemserver.Claim) (idemserver.ClaimResult, sql.NullString, error) {
	fp := c.Fingerprint
	lease := c.LeaseExpires.Sub(c.Now)
	args := []any{[]byte(c.Key.Scope), c.Key.Key, fp[:], c.Token, seconds(lease), s.sweepAfter(lease)}
	var r row
	// readCommitted is set once the statement failed with a serialization
	// failure: the runs after it are at read committed (see execRows).
	readCommitted := false
	for run := 0; run < maxClaimRuns; run++ {
		if run > 0 && s.testHookRerun != nil {
			s.testHookRerun()
		}
		r = row{}
		var err error
		if db, pool := q.(*sql.DB); pool && readCommitted {
			err = inReadCommitted(ctx, db, func(tx *sql.Tx) error {
				return tx.QueryRowContext(ctx, s.stmt().claim, args...).Scan(r.dest()...)
			})
		} else {
			err = q.QueryRowContext(ctx, s.stmt().claim, args...).Scan(r.dest()...)
		}
		switch {
		case err == nil:
		case errors.Is(err, sql.ErrNoRows):
			// A concurrent claim committed the row after this statement's
			// snapshot: the insert saw it, the read did not.
			continue
		case retryable(err):
			readCommitted = true
			continue
		default:
			return idemserver.ClaimResult{}, sql.NullString{}, fmt.Errorf("pgstore: claim: %w", err)
		}
		switch {
		case !r.token.Valid:
			// The row of NULLs of a claim that inserted.
			return idemserver.ClaimResult{Claimed: true}, sql.NullString{}, nil
		case !r.response.Valid && r.token.String == c.Token:
			// This claim's own row: an insert or takeover of this claim
			// whose answer was lost with its connection, after which
			// database/sql sent the statement again on another (or, here,
			// a run of the claim after a takeover that did the same).
			// Tokens are new to each claim, so no other claim wrote it;
			// taken for another's, it would hold the key, in progress,
			// until its lease ended.
			return idemserver.ClaimResult{Claimed: true}, sql.NullString{}, nil
		case r.expired():
			// A completed record that expired counts as absent: replace
			// it, unless someone else did first.
			ok, err := s.replace(ctx, q, c, r.token.String)
			if err != nil || ok {
				return idemserver.ClaimResult{Claimed: ok}, sql.NullString{}, err
			}
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

// row is a record's row as the claim statements return it (see
// rowColumns); its token is NULL when there is none.
type row struct {
	fingerprint []byte
	token       sql.NullString
	remaining   sql.NullFloat64 // seconds from the database's now() to expires_at
	response    sql.NullString  // as stored; NULL while in progress
}

// dest returns the scan destinations of rowColumns.
func (r *row) dest() []any {
	return []any{&r.fingerprint, &r.token, &r.remaining, &r.response}
}

// expired reports whether r is a completed record whose retention ended,
// which counts as absent.
func (r *row) expired() bool {
	return r.response.Valid && r.remaining.Float64 <= 0
}

// sweepAfter returns, in seconds, how long after a claim with the given
// lease its row may be swept, unless its complete or an extension moves
// that later: the lease and the retention guessed for it.
func (s *Store) sweepAfter(lease time.Duration) float64 {
	// Added as floats: the sum of two durations can overflow, and a
	// sweep_at before the lease's end would break its invariant.
	return seconds(lease) + seconds(time.Duration(s.retention.Load()))
}

// unsettled returns the error of a claim that ran its statement
// maxClaimRuns times without settling.
func (s *Store) unsettled(c idemserver.Claim) error {
	return fmt.Errorf("pgstore: claim of %q did not settle after %d runs under concurrent changes", c.Key.Key, maxClaimRuns)
}

// record builds the Record, without its response, of the row r found by
// a claim c.
func (s *Store) record(c idemserver.Claim, r *row) (idemserver.Record, error) {
	var rec idemserver.Record
	if len(r.fingerprint) != len(rec.Fingerprint) {
		return rec, fmt.Errorf("pgstore: %s holds a fingerprint of %d bytes for key %q; want %d",
			s.table.quoted(), len(r.fingerprint), c.Key.Key, len(rec.Fingerprint))
	}
	copy(rec.Fingerprint[:], r.fingerprint)
	rec.Token = r.token.String
	at := c.Now.Add(time.Duration(math.Round(r.remaining.Float64*1e6)) * time.Microsecond)
	if r.response.Valid {
		rec.Expires = at
	} else {
		rec.LeaseExpires = at
	}
	return rec, nil
}

// replace takes over the row of c.Key for c, provided it still holds
// token and has expired, and reports whether it did.
func (s *Store) replace(ctx context.Context, q querier, c idemserver.Claim, token string) (bool, error) {
	lease := c.LeaseExpires.Sub(c.Now)
	n, err := execRows(ctx, q, s.stmt().replace, []byte(c.Key.Scope), c.Key.Key, c.Fingerprint[:], c.Token,
		seconds(lease), token, s.sweepAfter(lease))
	if err != nil {
		return false, fmt.Errorf("pgstore: take over: %w", err)
	}
	return n == 1, nil
}

// Complete implements [idemserver.Store]: it stores resp, to be kept until
// expires (measured from now on the store's clock, see [WithClock], and
// applied to the database's).
func (s *Store) Complete(ctx context.Context, key idemserver.Key, token string, resp *idemserver.Response, expires time.Time) error {
	// Encode writes the fields in the order of their names, not in the
	// header map's, which differs from one walk to the next: a completion
	// sent again with the same response must carry the same bytes, by
	// which the complete statement knows it stored them already.
	if resp == nil {
		// Not an outcome: the claim stays as it was, its transaction
		// open, for its holder to complete or release.
		return errNoResponse
	}
	return s.complete(ctx, key, token, respcodec.Encode(resp), nil, time.Time{}, expires)
}

// errNoResponse is the error of a Complete with a nil response, which
// changes nothing (see [idemserver.Store.Complete]).
var errNoResponse = errors.New("pgstore: complete: no response")

// CompletePacked implements [idemserver.PackedStore]: it is Complete, with
// the response given packed and the retention measured from c.Now, the
// middleware's time, when it is set.
func (s *Store) CompletePacked(ctx context.Context, c idemserver.PackedCompletion) error {
	encoded, err := respcodec.AppendPacked(make([]byte, 0, c.Response.Len()+8), c.Response)
	return s.complete(ctx, c.Key, c.Token, encoded, err, c.Now, c.Expires)
}

// complete stores the encoded response, as Complete describes, to be kept
// for expires less now (the store's clock when now is zero) from the
// statement that stores it; encodeErr, when not nil, is why there is no
// encoded response, and the claim ends without one.
func (s *Store) complete(ctx context.Context, key idemserver.Key, token string, encoded []byte, encodeErr error, now, expires time.Time) error {
	if encodeErr != nil {
		// Not a response: nothing to store. A claim's transaction must
		// not be left open.
		err := fmt.Errorf("pgstore: complete: %w", encodeErr)
		if st := stateOf(ctx, key, token); s.transactional && st != nil {
			st.ended.Store(true)
			_ = st.rollback(ctx)
			return s.rolledBack(st, err)
		}
		return err
	}
	if now.IsZero() {
		now = s.now()
	}
	retention := expires.Sub(now)
	if retention > 0 && time.Duration(s.retention.Load()) != retention {
		s.retention.Store(int64(retention))
	}
	ttl := seconds(retention)
	if s.transactional {
		st := stateOf(ctx, key, token)
		if st == nil {
			return idemserver.ErrLeaseLost
		}
		return s.completeTx(ctx, st, ttl, encoded)
	}
	q, err := s.statements(ctx)
	if err != nil {
		return fmt.Errorf("pgstore: complete: %w", err)
	}
	n, err := execRows(ctx, s.db, q.complete, []byte(key.Scope), key.Key, token, encoded, ttl)
	if err != nil {
		return fmt.Errorf("pgstore: complete: %w", err)
	}
	return leaseHeld(n)
}

// Release implements [idemserver.Store].
func (s *Store) Release(ctx context.Context, key idemserver.Key, token string) error {
	if s.transactional {
		st := stateOf(ctx, key, token)
		if st == nil {
			return idemserver.ErrLeaseLost
		}
		return s.releaseTx(ctx, st)
	}
	q, err := s.statements(ctx)
	if err != nil {
		return fmt.Errorf("pgstore: release: %w", err)
	}
	n, err := execRows(ctx, s.db, q.release, []byte(key.Scope), key.Key, token)
	if err != nil {
		return fmt.Errorf("pgstore: release: %w", err)
	}
	return leaseHeld(n)
}

// Extend implements [idemserver.Store]: the lease ends at leaseExpires,
// measured from now on the store's clock (see [WithClock]) and applied to
// the database's.
func (s *Store) Extend(ctx context.Context, key idemserver.Key, token string, leaseExpires time.Time) error {
	if s.transactional {
		// The claim holds while its transaction is open, however long.
		st := stateOf(ctx, key, token)
		if st == nil {
			return idemserver.ErrLeaseLost
		}
		return s.extendTx(ctx, st)
	}
	q, err := s.statements(ctx)
	if err != nil {
		return fmt.Errorf("pgstore: extend: %w", err)
	}
	n, err := execRows(ctx, s.db, q.extend, []byte(key.Scope), key.Key, token, seconds(leaseExpires.Sub(s.now())))
	if err != nil {
		return fmt.Errorf("pgstore: extend: %w", err)
	}
	return leaseHeld(n)
}

// execRows runs a statement on q and returns the number of rows it changed.
//
// A statement on the pool, as each of lease mode is, runs in a transaction
// of its own, at the database's default isolation level. Under read
// committed, one that meets a row changed since its snapshot (taken over,
// completed, swept) re-checks the row's latest version. Under repeatable
// read or serializable it fails instead with a serialization failure
// (SQLSTATE 40001), having changed nothing. Under serializable it may fail
// so too without any change to its row: the database tracks what
// concurrent transactions read coarsely (by index page, and by table once
// it runs short of memory for finer locks), and a busy table gives such
// false conflicts to statement after statement, however often each is run
// again. So the statement is run again in a transaction begun at read
// committed (three round trips: the BEGIN, the statement, the COMMIT),
// which takes part in no such tracking and re-checks a changed row, so
// that the answer is the one read committed gives (a lease lost, say), not
// an error. Only a deadlock (40P01) makes it run yet again, at most
// maxClaimRuns times in all. In a transaction, such a failure has aborted
// the transaction, and is returned.
func execRows(ctx context.Context, q querier, query string, args ...any) (int64, error) {
	res, err := q.ExecContext(ctx, query, args...)
	if err == nil {
		return res.RowsAffected()
	}
	db, pool := q.(*sql.DB)
	if !pool || !retryable(err) {
		return 0, err
	}
	for run := 2; ; run++ {
		var n int64
		err := inReadCommitted(ctx, db, func(tx *sql.Tx) error {
			res, err := tx.ExecContext(ctx, query, args...)
			if err == nil {
				n, err = res.RowsAffected()
			}
			return err
		})
		if err == nil || !retryable(err) || run == maxClaimRuns {
			return n, err
		}
	}
}

// inReadCommitted runs f in a transaction on db begun at read committed,
// and commits it unless f fails.
func inReadCommitted(ctx context.Context, db *sql.DB, f func(*sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return err
	}
	if err := f(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

// leaseHeld returns nil if a compare-and-set on a lease token changed a
// row, and ErrLeaseLost otherwise.
func leaseHeld(rows int64) error {
	if rows == 0 {
		return idemserver.ErrLeaseLost
	}
	return nil
}

// seconds returns d in seconds, and zero for a negative d.
func seconds(d time.Duration) float64 {
	return max(d, 0).Seconds()
}

// retryable reports whether err is a serialization failure or a deadlock
// (SQLSTATE 40001 or 40P01), after which the same statement may succeed.
// Drivers expose the SQLSTATE through a method of their error type.
func retryable(err error) bool {
	switch sqlState(err) {
	case "40001", "40P01":
		return true
	}
	return false
}
