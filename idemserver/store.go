package idemserver

import (
	"context"
	"errors"
	"net/http"
	"time"
)

// A Store remembers idempotency keys for the middleware: which keys are in
// progress, under which lease, and the responses of those that completed.
//
// # Life of a record
//
// The middleware calls [Store.Claim] once per keyed request. If no record
// exists for the key (or the one there has outlived its expiry), Claim
// inserts an in-progress record holding the caller's lease token and
// fingerprint and reports Claimed; otherwise it inserts nothing and reports
// the record it found. Exactly one of any number of concurrent Claims of a
// key may succeed. The holder of the lease then runs the handler and ends
// the claim with exactly one of [Store.Complete], which turns the record
// into a completed one that keeps the response until its expiry, or
// [Store.Release], which deletes it so that a retry can run the handler
// again. Both act only while the record still holds the caller's lease
// token; otherwise they change nothing and return [ErrLeaseLost].
//
// A lease ends at the LeaseExpires time of its [Claim], which the
// middleware moves on with [Store.Extend] while the handler runs. A record
// still in progress after that belonged to a handler that crashed, or that
// held its key past the middleware's maximum hold, and the middleware takes
// it over with [Store.TakeOver], a compare-and-set on the expired lease
// token and on the lease's end: of several requests trying to take over the
// same lease, only one succeeds, and none does once the lease has been
// extended.
//
// # One round trip
//
// Each method is one statement in a SQL database. Claim reads the key's
// row, inserts one only if it found none, and reports which of the two
// happened, for example in PostgreSQL
//
//	WITH cur AS (
//	    SELECT fingerprint, token, expires_at, response FROM idempotency
//	    WHERE scope = $1 AND key = $2
//	), ins AS (
//	    INSERT INTO idempotency (scope, key, fingerprint, token, expires_at)
//	    SELECT $1, $2, $3, $4, now() + $5
//	    WHERE NOT EXISTS (SELECT FROM cur)
//	    ON CONFLICT (scope, key) DO NOTHING
//	    RETURNING true AS claimed)
//	SELECT true, NULL, NULL, NULL, NULL FROM ins
//	UNION ALL
//	SELECT false, * FROM cur
//
// so that a replay only reads: ON CONFLICT DO UPDATE would lock and write
// the existing row even when its WHERE clause is false. If a concurrent
// claim committed after the statement took its snapshot, the read misses
// the row and the insert meets it, so no row comes back and the store runs
// the statement again. Only a row found expired takes a second statement,
// an UPDATE that replaces it provided it still holds the token that was
// read. TakeOver is that UPDATE, which also requires the lease to have
// ended ("expires_at <= now()"); Complete, Release and Extend are an
// UPDATE, a DELETE and an UPDATE whose WHERE clause names the lease token.
// Package idemserver/pgstore is such a store; docs/pgstore.md gives its
// statements.
//
// # Transactions
//
// A store may run the handler inside its claim. Claim receives the request's
// context; a store that begins a transaction there returns a context that
// carries it in [ClaimResult.Context]. The middleware then serves the
// handler with that context, so the handler can do its own writes in the
// transaction, and passes the same context (without its cancellation) to
// Complete or Release, which commit or roll back. Such a store sets
// [ClaimResult.Hold] on each claim it wins, so that no response reaches
// the client before the commit, and may implement [ResponseHolder] too;
// the flag is what holds the response behind a wrapper that forwards the
// Store methods and their results but hides the store's optional
// interfaces. A concurrent claim of a key whose claim is not committed yet must
// not wait for it without bound: the store reports the key in progress (a
// record whose fingerprint is the claimant's own and whose lease has not
// ended, since the uncommitted one cannot be read). When the commit in
// Complete fails, the store returns an error wrapping [ErrRolledBack], and
// the middleware replaces the handler's response with 503, since nothing
// the handler did was kept; when the store cannot tell whether the commit
// succeeded, an error wrapping [ErrOutcomeUnknown], which the middleware
// answers with 503 too, without releasing the claim. An error that also
// wraps [ErrRetryRequest], from Complete or Release, asks the middleware to
// run the request again from the claim on.
//
// # Contract
//
// Implementations must be safe for concurrent use by multiple goroutines.
// Times passed in are the middleware's clock readings; a store may use a
// clock of its own (a database's now()) instead, as long as it uses that
// clock for every record. A store may keep and return the [Response] given
// to Complete; no one may modify it afterwards. An error from Claim or
// TakeOver means the store could not be asked, or refused the claim (it is
// full, [ErrStoreFull], or refuses claims until its configuration is
// fixed, [ErrStoreMisconfigured]): the middleware answers 503 with
// Retry-After and does not run the handler. The evictions a ClaimResult
// lists stay the store's; the middleware does not modify them.
//
// The context of a call ends when the call must have been answered (see
// [WithStoreTimeout]); it is the call's, and the store must not keep it,
// or a context it derived from it, to read after the call returns (but
// for [ClaimResult.Context]): the middleware uses it again for later
// calls, which may be another request's, so that a value read from it
// then may be another request's. A goroutine that watches the call's
// Done may end after the call, as a standard context allows.
type Store interface {
	// Claim inserts an in-progress record for c.Key holding c's lease token
	// and fingerprint, unless a record that has not expired exists, and
	// reports which of the two happened. A completed record whose Expires
	// is not after c.Now counts as absent.
	Claim(ctx context.Context, c Claim) (ClaimResult, error)

	// TakeOver is Claim, except that an in-progress record whose lease token
	// is expiredToken, and whose lease has ended at c.Now, is replaced as if
	// it were absent. The middleware calls it only for a lease it saw
	// expired and a record with c's fingerprint; the store checks the lease
	// again, since an extension may have landed in between, and then the
	// record stays with its holder.
	TakeOver(ctx context.Context, c Claim, expiredToken string) (ClaimResult, error)

	// Complete stores resp as the outcome of the in-progress record of key,
	// to be kept until expires, provided the record still holds token.
	// Otherwise it returns an error wrapping [ErrLeaseLost], except that a
	// Complete sent again with the token and response of the one that
	// completed the record returns nil, as that one did: the middleware
	// sends it again when the first one's answer did not come in time
	// (see [WithStoreTimeout]). A nil resp is no outcome: Complete
	// returns an error wrapping none of the errors above and leaves the
	// record as it was, still held by token, for its holder to Complete
	// with a response or Release (a transactional store keeps the claim's
	// transaction open).
	Complete(ctx context.Context, key Key, token string, resp *Response, expires time.Time) error

	// Release deletes the in-progress record of key, provided it still
	// holds token. Otherwise it returns an error wrapping [ErrLeaseLost].
	Release(ctx context.Context, key Key, token string) error

	// Extend moves the lease of key's in-progress record to end at
	// leaseExpires, provided the record still holds token. Otherwise it
	// changes nothing and returns an error wrapping [ErrLeaseLost]. The
	// middleware calls it while the handler runs, well before the lease
	// ends, so that a live handler is never taken over.
	Extend(ctx context.Context, key Key, token string, leaseExpires time.Time) error
}

// Key identifies a record: the client's idempotency key within a scope.
// Records of different scopes never meet, whatever their keys.
type Key struct {
	// Scope is the value of the middleware's scope function, such as a
	// tenant or principal; empty without one.
	Scope string
	// Key is the idempotency key the client sent, unquoted.
	Key string
}

// A Claim asks a [Store] for the lease on a key.
type Claim struct {
	// Key is the record to claim.
	Key Key
	// Fingerprint identifies the request's content.
	Fingerprint Fingerprint
	// Token is the new lease token, unique to this attempt.
	Token string
	// Now is the time of the claim.
	Now time.Time
	// LeaseExpires is when the lease ends and the record, if still in
	// progress, may be taken over.
	LeaseExpires time.Time
	// ReportEvictions says that the caller reports the result's Evictions
	// (the middleware does so to its observer). Without it, a store that
	// reports evictions nowhere else drops no live record for the claim:
	// the drop would go unreported. A Store that wraps another passes it on
	// with the claim; one that drops it makes the store refuse to evict,
	// which fails closed ([ErrStoreFull]) rather than forgetting a key in
	// silence.
	ReportEvictions bool
}

// ClaimResult is what [Store.Claim] and [Store.TakeOver] report.
type ClaimResult struct {
	// Claimed reports that the caller now holds the lease: the record was
	// inserted (or taken over) with the claim's token.
	Claimed bool
	// Hold, when Claimed is true, says that the store keeps nothing of
	// this claim's outcome until Complete returns, as a store that commits
	// the claim, the handler's writes and the response in one transaction
	// does: the middleware then lets no part of the response reach the
	// client before Complete returns, as for a [ResponseHolder]. Such a
	// store sets it on every claim it wins. It travels with the result, so
	// a store that wraps another (for metrics, tracing, logging) keeps it
	// by returning the wrapped store's ClaimResult whole, as it must.
	Hold bool
	// Record is the record found instead, when Claimed is false.
	Record Record
	// Context, when not nil and Claimed is true, replaces the request's
	// context for the handler and is the context of the Complete or Release
	// that ends the claim. A store sets it to hand the handler a
	// transaction; see [Store]. A store that began a transaction and did
	// not claim the key ends that transaction itself before returning.
	Context context.Context
	// Evictions lists the completed records, not yet expired, that the
	// store dropped early to make room for this claim; any store may fill
	// it. A store drops such a record only if its operator allowed it (see
	// [WithEvictOldest]): a retry of its key would run the handler again.
	// The middleware reports them to its observer, in [Event.Evictions].
	Evictions []Eviction
}

// An Eviction is a completed record that a store dropped before it
// expired, to make room for another.
type Eviction struct {
	// Key is the record's key.
	Key Key
	// Age is how long the record had been completed when it was dropped.
	// A store that does not know when it completed counts from its claim.
	Age time.Duration
}

// A Record is the state of one key.
type Record struct {
	// Fingerprint is that of the request that claimed the key.
	Fingerprint Fingerprint
	// Token is the lease token of the in-progress claim.
	Token string
	// LeaseExpires is when the lease of an in-progress record ends.
	LeaseExpires time.Time
	// Response is the stored outcome; nil while the record is in progress.
	Response *Response
	// Expires is when a completed record may be forgotten.
	Expires time.Time
}

// Completed reports whether the record holds a response.
func (r *Record) Completed() bool { return r.Response != nil }

// A Response is a stored outcome, replayed to later requests with the key.
type Response struct {
	// Status is the HTTP status code.
	Status int
	// Header holds the replayable header fields: hop-by-hop fields and,
	// unless allowed, Set-Cookie are never stored.
	Header http.Header
	// Body is the response body.
	Body []byte
	// BodyOmitted reports that the body was not stored: it was larger
	// than the middleware's response limit, its stream to the first
	// client broke and it had no Content-Length, or it was shorter than
	// its Content-Length. A replay then carries Status and a problem
	// document of type [ProblemResponseNotStored] instead.
	BodyOmitted bool
}

// A ResponseHolder is a [Store] that may keep nothing of a claimed request
// until Complete returns, as a store that commits the claim, the handler's
// writes and the response in one transaction does. When HoldResponses
// reports true, the middleware lets no part of the response reach the
// client before Complete returns: a Flush sends nothing, a response
// larger than [WithMaxResponseBytes] is held in memory whole (and stored
// without its body) instead of being streamed, and an informational (1xx)
// response, such as 103 Early Hints, is dropped rather than sent ahead of
// the final one. Since such a store keeps nothing unless Complete
// succeeds, a Complete that fails with an error wrapping none of
// [ErrLeaseLost], [ErrRolledBack] and [ErrRetryRequest] is answered as
// one that reports [ErrOutcomeUnknown] is: 503, and the claim is not
// released. The middleware asks once, when it is created.
//
// A store that wraps another hides this interface unless it defines
// HoldResponses too, so a store whose claims must be held says so on each
// claim as well, with [ClaimResult.Hold], which a wrapper forwards with
// the result: the middleware holds a response when either says so.
type ResponseHolder interface {
	HoldResponses() bool
}

// MaxReruns is how many times the middleware runs a request again when
// the store asks it to with [ErrRetryRequest]. A rerun runs the handler
// again from the start: the store discarded what it wrote in the
// database, but whatever it did outside (a call to another service, a
// message sent) happens again, as it does when a client retries after a
// 5xx. A handler names such calls with a key derived from [KeyFrom], so
// that the services it calls deduplicate them.
const MaxReruns = 3

// Errors a Store reports. Use errors.Is to test for them.
var (
	// ErrLeaseLost means the record no longer holds the caller's lease
	// token: it expired and another request took it over, or it is gone.
	ErrLeaseLost = errors.New("idemserver: lease lost")
	// ErrRolledBack means a transactional store could not commit: the
	// claim, the handler's writes and the response were all discarded.
	ErrRolledBack = errors.New("idemserver: transaction rolled back")
	// ErrOutcomeUnknown means a transactional store could not learn
	// whether its commit succeeded (the connection was lost during it):
	// the claim, the handler's writes and the response were either all
	// kept or all discarded. The middleware answers 503 and does not
	// release the claim; the client's retry finds out from the store.
	ErrOutcomeUnknown = errors.New("idemserver: outcome of the commit unknown")
	// ErrRetryRequest, wrapped in an error from Complete or Release, asks
	// the middleware to run the request again from the claim on: the
	// store discarded everything the attempt did, because it lost a
	// conflict (a serialization failure or a deadlock) that another
	// attempt may not. The middleware does so at most [MaxReruns] times,
	// and only while nothing of the response has reached the client;
	// after that it answers 503.
	ErrRetryRequest = errors.New("idemserver: run the request again")
	// ErrStoreFull means a bounded store has no room for a new record,
	// because every record it holds is live: in progress, or completed and
	// not expired, and the store does not drop those early. The
	// middleware answers 503 with Retry-After and does not run the handler.
	ErrStoreFull = errors.New("idemserver: store full")
	// ErrStoreMisconfigured means a store refuses claims because of how
	// its backend is configured, until an operator changes it: a Redis
	// that may evict records before they expire, say. The store can be
	// reached; retrying helps only once the configuration is fixed. The
	// middleware answers 503 with Retry-After, saying so, and does not run
	// the handler.
	ErrStoreMisconfigured = errors.New("idemserver: store misconfigured")
	// ErrClosed means the store was closed.
	ErrClosed = errors.New("idemserver: store closed")
)

// A PackedStore is a [Store] that also takes and returns responses in
// packed form ([PackedResponse]), the form in which the middleware records
// a response and writes a replay, so that neither side converts to and
// from a [Response]. The middleware treats every store alike: when its
// store implements PackedStore it calls ClaimPacked in place of Claim and
// TakeOver, and CompletePacked in place of Complete, as [io.Copy] calls an
// [io.WriterTo]'s WriteTo; Release and Extend are the same for every store.
// A store implements it only to save that work. [MemoryStore] does.
//
// A store that wraps another by embedding it also gets the embedded
// store's PackedStore methods, which would bypass the wrapper's own Claim
// and Complete; such a wrapper must define them too, or hold the store in
// a named field instead.
type PackedStore interface {
	Store

	// ClaimPacked is [Store.Claim], or [Store.TakeOver] when c.TakeOver is
	// set, except that a completed record's response is returned packed,
	// in the result's Response, and Record.Response is nil.
	ClaimPacked(ctx context.Context, c PackedClaim) (PackedClaimResult, error)

	// CompletePacked is [Store.Complete] with the response packed. The
	// response may share the caller's memory, which the caller reuses once
	// CompletePacked returns: a store that keeps it copies its bytes (with
	// [PackedResponse.AppendBinary]).
	CompletePacked(ctx context.Context, c PackedCompletion) error
}

// A PackedClaim asks a [PackedStore] for the lease on a key.
type PackedClaim struct {
	Claim
	// TakeOver makes the claim a [Store.TakeOver] of the lease whose token
	// is ExpiredToken.
	TakeOver     bool
	ExpiredToken string
	// NewToken, when not nil, makes the lease token in place of
	// Claim.Token. The store calls it at most once, and reports the token
	// in [PackedClaimResult.Token]. A store that can tell before it writes
	// calls it only when the claim succeeds, so that a claim that finds a
	// record costs no token; one that sends the token with the claim, not
	// knowing what it will find, calls it first.
	NewToken func() string
}

// PackedClaimResult is what [PackedStore.ClaimPacked] reports.
type PackedClaimResult struct {
	// ClaimResult is as [Store.Claim] reports it, except that
	// Record.Response is nil.
	ClaimResult
	// Response is the response of the completed record found, when Claimed
	// is false; zero otherwise.
	Response PackedResponse
	// Token is the lease token of a successful claim: Claim.Token, or the
	// one NewToken made.
	Token string
	// Ref is the store's own reference to the record of a successful
	// claim, such as where it keeps it, which the middleware hands back in
	// [PackedCompletion.Ref]; zero means none. The store must not trust it
	// further than it can check it.
	Ref uint64
}

// A PackedCompletion asks a [PackedStore] to complete a claim.
type PackedCompletion struct {
	// Key and Token name the claim, as for [Store.Complete].
	Key   Key
	Token string
	// Ref is the claim's [PackedClaimResult.Ref].
	Ref uint64
	// Response is the outcome to store.
	Response PackedResponse
	// Now is the time of the completion.
	Now time.Time
	// Expires is when the record may be forgotten.
	Expires time.Time
}
