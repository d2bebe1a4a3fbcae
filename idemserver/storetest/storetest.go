// Package storetest is a conformance suite for implementations of
// [idemserver.Store]. Every store in this module passes it, and a
// third-party store can run it from its own tests:
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) idemserver.Store {
//			s := mystore.New(...)
//			t.Cleanup(func() { s.Close() })
//			return s
//		})
//	}
//
// [Run] calls the store's methods directly and checks the contract of
// [idemserver.Store]; [RunHTTP] puts the store behind the middleware and
// checks what clients see.
//
// # Clocks
//
// A store may judge leases and expiry by the times in each [idemserver.Claim]
// or by a clock of its own, such as a database's now(). The suite works with
// either, because it never fakes time: every Claim it makes has Now set to
// time.Now() and LeaseExpires to Now plus a duration, and every expiry it
// passes to Complete or Extend is time.Now() plus a duration. The
// exceptions check the boundary: a claim and a takeover stamped at exactly
// the instant a record expired or a lease ended, which the suite makes only
// once the store reports that instant passed, so that a store on either
// clock must find the record absent and the lease ended. A live lease
// or record lasts an hour, far longer than any test, so nothing the suite
// expects to be live can expire while it runs. A lease or record meant to
// expire lasts a millisecond, and the suite then polls the store, for up to
// ten seconds, until the store reports it expired; it never sleeps for a
// fixed time and assumes the store agrees. A store that runs on its own
// clock must still report times that the middleware can compare with
// Claim.Now: [idemserver.Record.LeaseExpires] is not after Claim.Now exactly
// when the store takes the lease to have ended.
//
// # Stores that claim inside a transaction
//
// Run checks the contract of a store whose claims are committed records
// holding a lease. A store that instead holds each claim in an open
// transaction (see [idemserver.Store]) has no leases to expire or take over,
// and cannot show a concurrent claim the record of an uncommitted one; such
// a store runs [RunTransactional] and [RunHTTP].
//
// # Keys
//
// The suite's keys are keys the middleware accepts (see
// [idemserver.ParseKey]): printable ASCII, at most [idemserver.MaxKeyLen]
// characters. Its scopes are any strings, NUL bytes and invalid UTF-8
// included, since a scope is whatever the middleware's scope function
// returns.
package storetest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// Durations the suite uses; see the package documentation.
const (
	// live is the lease or retention of a record that must not expire
	// while a test runs.
	live = time.Hour
	// short is the lease or retention of a record meant to expire.
	short = time.Millisecond
	// pollLimit bounds the wait for a store to report a short lease or
	// record expired.
	pollLimit = 10 * time.Second
	// pollEvery is the interval between two polls.
	pollEvery = 2 * time.Millisecond
)

// Run runs the conformance suite for stores whose claims are leases: each
// subtest calls newStore once for an empty store of its own. newStore
// should register the store's cleanup with t.Cleanup.
//
// The suite covers what each answer of Claim reports, the life of a record
// from claim to completion or release, expiry of records and leases,
// Extend, takeovers, ErrLeaseLost for stale lease tokens, concurrent
// claims and takeovers (exactly one winner), a completion racing takeovers
// (the one or a takeover wins), responses kept byte for byte, a Complete
// without a response (refused, the claim kept), scopes kept apart, and
// cancelled contexts. A store that holds responses (an
// [idemserver.ResponseHolder] whose HoldResponses reports true) must say
// so on every claim it wins too, in [idemserver.ClaimResult.Hold], which
// a wrapper of the store cannot hide.
//
// A store that implements [idemserver.PackedStore] is checked twice: once
// through Claim, TakeOver and Complete, and once, in the subtests under
// "Packed", through ClaimPacked and CompletePacked, which the middleware
// calls in their place. The second pass also checks what PackedStore adds:
// that a claim's token is the one NewToken made, made at most once, and that
// a completion is judged by its key and token whatever its Ref.
func Run(t *testing.T, newStore func(t *testing.T) idemserver.Store) {
	t.Helper()
	run(t, newStore, false, []subtest{
		{"ClaimOutcomes", testClaimOutcomes},
		{"Lifecycle", testLifecycle},
		{"ConcurrentClaims", testConcurrentClaims},
		{"ConcurrentClaimsOfExpiredRecord", testConcurrentClaimsOfExpiredRecord},
		{"Expiry", testExpiry},
		{"LeaseExpiry", testLeaseExpiry},
		{"CompleteAfterLeaseEnded", testCompleteAfterLeaseEnded},
		{"CompleteSentAgain", testCompleteSentAgain},
		{"StaleCompleteOfSameResponse", testStaleCompleteOfSameResponse},
		{"CompleteWithoutResponse", testCompleteWithoutResponse},
		{"ConcurrentTakeOvers", testConcurrentTakeOvers},
		{"CompleteRacesTakeOvers", testCompleteRacesTakeOvers},
		{"Extend", testExtend},
		{"StaleTokens", testStaleTokens},
		{"Responses", testResponses},
		{"Scopes", testScopes},
		{"CancelledContext", testCancelledContext},
	})
}

// RunTransactional runs the conformance suite for stores that hold each
// claim in an open transaction, carried by [idemserver.ClaimResult.Context]
// and ended by Complete (commit) or Release (roll back), as
// [idemserver.Store] describes. It checks what [Run] does, except what
// needs a lease: such a claim holds until its transaction ends, so it
// neither expires nor is taken over, Extend succeeds while it is open, and
// a concurrent claim of it is reported in progress with the claimant's own
// fingerprint and a lease that has not ended (the uncommitted record cannot
// be read). Every claim won must say that its response is to be held
// until the commit ([idemserver.ClaimResult.Hold]). Each claim the suite
// wins is ended before its subtest does. A PackedStore is checked through both sets of methods, as [Run] does.
func RunTransactional(t *testing.T, newStore func(t *testing.T) idemserver.Store) {
	t.Helper()
	run(t, newStore, true, []subtest{
		{"ClaimOutcomes", testClaimOutcomes},
		{"Lifecycle", testLifecycle},
		{"ConcurrentClaims", testConcurrentClaims},
		{"ConcurrentClaimsOfExpiredRecord", testConcurrentClaimsOfExpiredRecord},
		{"Expiry", testExpiry},
		{"CompleteWithoutResponse", testCompleteWithoutResponse},
		{"Extend", testExtendTransactional},
		{"StaleTokens", testStaleTokens},
		{"Responses", testResponses},
		{"Scopes", testScopes},
		{"CancelledContext", testCancelledContext},
	})
}

type subtest struct {
	name string
	run  func(*testing.T, *harness)
}

func run(t *testing.T, newStore func(t *testing.T) idemserver.Store, tx bool, tests []subtest) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.run(t, newHarness(t, newStore(t), tx, false))
		})
	}
	t.Run("Packed", func(t *testing.T) {
		if _, ok := newStore(t).(idemserver.PackedStore); !ok {
			t.Skip("the store is not an idemserver.PackedStore")
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				tt.run(t, newHarness(t, newStore(t), tx, true))
			})
		}
	})
}

// harness makes claims on one store and checks the answers.
type harness struct {
	t      *testing.T
	s      idemserver.Store
	tokens *atomic.Int64
	tx     bool // the store holds claims in transactions; see RunTransactional
	// hold is set when every claim the store wins must say to hold its
	// response: it holds claims in transactions, or holds responses.
	hold bool
	// packed, when not nil, is s, whose PackedStore methods the harness
	// calls in place of Claim, TakeOver and Complete.
	packed idemserver.PackedStore
	// refs maps the token of each packed claim won to its Ref.
	refs *sync.Map
	// packs maps each response the harness completed with to its packed
	// form, made once: a header map is walked in another order each time,
	// and a completion sent again carries the same bytes, as the
	// middleware's does.
	packs *sync.Map
}

// newHarness returns a harness on s; with packed, s is a PackedStore and
// the harness calls its packed methods.
func newHarness(t *testing.T, s idemserver.Store, tx, packed bool) *harness {
	holder, ok := s.(idemserver.ResponseHolder)
	hold := tx || ok && holder.HoldResponses()
	h := &harness{t: t, s: s, tokens: new(atomic.Int64), tx: tx, hold: hold, refs: new(sync.Map), packs: new(sync.Map)}
	if packed {
		h.packed = s.(idemserver.PackedStore)
	}
	return h
}

// sub returns a harness for the subtest t on the same store.
func (h *harness) sub(t *testing.T) *harness {
	c := *h
	c.t = t
	return &c
}

// claimOf is s.Claim, or s.TakeOver of expiredToken's lease when takeOver
// is set, or ClaimPacked in their place.
func (h *harness) claimOf(ctx context.Context, c idemserver.Claim, takeOver bool, expiredToken string) (idemserver.ClaimResult, error) {
	res, err := h.claimEither(ctx, c, takeOver, expiredToken)
	if err == nil && res.Claimed && h.hold {
		// Behind a wrapper that forwards the Store methods alone, only the
		// claim can say so; see idemserver.ClaimResult.Hold.
		assert.True(h.t, res.Hold, "a claim won of a store that holds responses says so in ClaimResult.Hold")
	}
	return res, err
}

// claimEither is claimOf without the check of the result's Hold.
func (h *harness) claimEither(ctx context.Context, c idemserver.Claim, takeOver bool, expiredToken string) (idemserver.ClaimResult, error) {
	if h.packed == nil {
		if takeOver {
			return h.s.TakeOver(ctx, c, expiredToken)
		}
		return h.s.Claim(ctx, c)
	}
	// The middleware has the store make the token with NewToken; half the
	// claims give it in the claim instead.
	pc := idemserver.PackedClaim{Claim: c, TakeOver: takeOver, ExpiredToken: expiredToken}
	made := 0
	if n, _ := strconv.ParseInt(strings.TrimPrefix(c.Token, "token-"), 10, 64); n%2 == 0 {
		pc.Claim.Token = ""
		pc.NewToken = func() string { made++; return c.Token }
	}
	res, err := h.packed.ClaimPacked(ctx, pc)
	if err != nil {
		return res.ClaimResult, err
	}
	assert.LessOrEqual(h.t, made, 1, "ClaimPacked calls NewToken at most once")
	assert.Nil(h.t, res.Record.Response, "ClaimPacked returns a response packed, not in the record")
	out := res.ClaimResult
	if res.Claimed {
		assert.Equal(h.t, c.Token, res.Token, "the token of a packed claim: Claim.Token, or the one NewToken made")
		if pc.NewToken != nil {
			assert.Equal(h.t, 1, made, "a claim won with NewToken set is made with its token")
		}
		assert.True(h.t, res.Response.IsZero(), "a claim won has no response")
		h.refs.Store(c.Token, res.Ref)
	} else if !res.Response.IsZero() {
		out.Record.Response = res.Response.Response()
	}
	return out, nil
}

// completeOf is s.Complete of l, or CompletePacked with l's Ref.
func (h *harness) completeOf(ctx context.Context, l lease, resp *idemserver.Response, expires time.Time) error {
	if h.packed == nil {
		return h.s.Complete(ctx, l.c.Key, l.c.Token, resp, expires)
	}
	return h.packed.CompletePacked(ctx, idemserver.PackedCompletion{
		Key: l.c.Key, Token: l.c.Token, Ref: l.ref,
		Response: h.pack(resp), Now: time.Now(), Expires: expires,
	})
}

// pack returns resp packed, the same bytes each time it is asked for the
// same response.
func (h *harness) pack(resp *idemserver.Response) idemserver.PackedResponse {
	if p, ok := h.packs.Load(resp); ok {
		return p.(idemserver.PackedResponse)
	}
	p, _ := h.packs.LoadOrStore(resp, idemserver.PackResponse(resp))
	return p.(idemserver.PackedResponse)
}

// fp returns a fingerprint named by s.
func fp(s string) idemserver.Fingerprint { return sha256.Sum256([]byte(s)) }

// A lease is a claim a test holds, with the context that ends it.
type lease struct {
	c   idemserver.Claim
	ctx context.Context
	// ref is the claim's PackedClaimResult.Ref, when the harness claimed
	// it packed. A stale lease made from another keeps that one's Ref, so
	// that the store is seen to check a completion's key and token.
	ref uint64
}

// newClaim returns a claim of key with a new token, stamped now, whose
// lease lasts d.
func (h *harness) newClaim(key idemserver.Key, f idemserver.Fingerprint, d time.Duration) idemserver.Claim {
	now := time.Now()
	return idemserver.Claim{
		Key:          key,
		Fingerprint:  f,
		Token:        "token-" + strconv.FormatInt(h.tokens.Add(1), 10),
		Now:          now,
		LeaseExpires: now.Add(d),
	}
}

// newClaims returns n claims of key, as newClaim makes them with a live
// lease, and room for their answers.
func (h *harness) newClaims(key idemserver.Key, f idemserver.Fingerprint, n int) ([]idemserver.Claim, []idemserver.ClaimResult, []error) {
	claims := make([]idemserver.Claim, n)
	for i := range claims {
		claims[i] = h.newClaim(key, f, live)
	}
	return claims, make([]idemserver.ClaimResult, n), make([]error, n)
}

// claim claims key and returns the claim and the store's answer.
func (h *harness) claim(key idemserver.Key, f idemserver.Fingerprint, d time.Duration) (lease, idemserver.ClaimResult) {
	h.t.Helper()
	c := h.newClaim(key, f, d)
	res, err := h.claimOf(h.t.Context(), c, false, "")
	require.NoError(h.t, err, "Claim(%v)", key)
	return h.leaseOf(c, res), res
}

// leaseOf returns the lease of a successful claim.
// A claim still held when the test ends is released then, so that a
// transactional store's transaction ends with it.
func (h *harness) leaseOf(c idemserver.Claim, res idemserver.ClaimResult) lease {
	l := lease{c: c, ctx: h.t.Context()}
	if ref, ok := h.refs.Load(c.Token); ok {
		l.ref = ref.(uint64)
	}
	if res.Claimed && res.Context != nil {
		l.ctx = res.Context
	}
	if res.Claimed {
		h.t.Cleanup(func() { _ = h.release(l) })
	}
	return l
}

// mustClaim claims key and fails the test unless the claim succeeds.
func (h *harness) mustClaim(key idemserver.Key, f idemserver.Fingerprint, d time.Duration) lease {
	h.t.Helper()
	l, res := h.claim(key, f, d)
	require.True(h.t, res.Claimed, "Claim(%v) should succeed; found %+v", key, res.Record)
	return l
}

// complete completes l with resp, kept for d.
func (h *harness) complete(l lease, resp *idemserver.Response, d time.Duration) error {
	return h.completeOf(context.WithoutCancel(l.ctx), l, resp, time.Now().Add(d))
}

func (h *harness) release(l lease) error {
	return h.s.Release(context.WithoutCancel(l.ctx), l.c.Key, l.c.Token)
}

func (h *harness) extend(l lease, d time.Duration) error {
	return h.s.Extend(context.WithoutCancel(l.ctx), l.c.Key, l.c.Token, time.Now().Add(d))
}

// expectInProgress checks that claiming key now finds l's claim in
// progress with a live lease.
func (h *harness) expectInProgress(key idemserver.Key, l lease) {
	h.t.Helper()
	c := h.newClaim(key, fp("other request"), live)
	res, err := h.claimOf(h.t.Context(), c, false, "")
	require.NoError(h.t, err)
	if res.Claimed {
		// Ended with the test: a transactional store's claim left open
		// would hold its connection and lock past it.
		h.leaseOf(c, res)
	}
	require.False(h.t, res.Claimed, "the key should be in progress")
	h.assertInProgress(c, l.c, res.Record)
}

// assertInProgress checks the record that claim c found in progress,
// holder's claim.
func (h *harness) assertInProgress(c, holder idemserver.Claim, rec idemserver.Record) {
	h.t.Helper()
	assert.False(h.t, rec.Completed(), "the record should be in progress")
	if h.tx {
		// The holder's record is not committed: the claimant is told it
		// is in progress as if it were its own.
		assert.Equal(h.t, c.Fingerprint, rec.Fingerprint, "fingerprint of an uncommitted claim: the claimant's own")
	} else {
		assert.Equal(h.t, holder.Token, rec.Token, "lease token")
		assert.Equal(h.t, holder.Fingerprint, rec.Fingerprint, "fingerprint")
	}
	assert.True(h.t, c.Now.Before(rec.LeaseExpires), "lease should be live: ends %v, now %v", rec.LeaseExpires, c.Now)
}

// expectReplay checks that claiming key now finds it completed with resp.
func (h *harness) expectReplay(key idemserver.Key, f idemserver.Fingerprint, resp *idemserver.Response) {
	h.t.Helper()
	c := h.newClaim(key, f, live)
	res, err := h.claimOf(h.t.Context(), c, false, "")
	require.NoError(h.t, err)
	require.False(h.t, res.Claimed, "the key should be completed")
	require.True(h.t, res.Record.Completed(), "the record should hold a response")
	assert.Equal(h.t, f, res.Record.Fingerprint, "fingerprint")
	assert.True(h.t, c.Now.Before(res.Record.Expires), "record should be live: expires %v, now %v", res.Record.Expires, c.Now)
	assertSameResponse(h.t, resp, res.Record.Response)
}

// expectFree checks that key can be claimed now, and releases the claim.
func (h *harness) expectFree(key idemserver.Key) {
	h.t.Helper()
	l := h.mustClaim(key, fp("probe"), live)
	require.NoError(h.t, h.release(l))
}

// waitLeaseExpired polls until claiming key finds l's claim in progress
// with its lease ended, and returns that answer's record.
func (h *harness) waitLeaseExpired(key idemserver.Key, l lease) idemserver.Record {
	h.t.Helper()
	deadline := time.Now().Add(pollLimit)
	for {
		c := h.newClaim(key, l.c.Fingerprint, live)
		res, err := h.claimOf(h.t.Context(), c, false, "")
		require.NoError(h.t, err)
		require.False(h.t, res.Claimed, "Claim must not take over an in-progress record, even one whose lease ended")
		require.False(h.t, res.Record.Completed())
		require.Equal(h.t, l.c.Token, res.Record.Token)
		if !c.Now.Before(res.Record.LeaseExpires) {
			return res.Record
		}
		require.True(h.t, time.Now().Before(deadline), "lease of %v not expired %v after it ended", key, pollLimit)
		time.Sleep(pollEvery)
	}
}

// waitClaimed polls until a claim of key succeeds, and returns it.
func (h *harness) waitClaimed(key idemserver.Key, f idemserver.Fingerprint) lease {
	h.t.Helper()
	deadline := time.Now().Add(pollLimit)
	for {
		l, res := h.claim(key, f, live)
		if res.Claimed {
			return l
		}
		require.True(h.t, time.Now().Before(deadline), "%v not free %v after its record expired", key, pollLimit)
		time.Sleep(pollEvery)
	}
}

// assertSameResponse checks that got is want, byte for byte. A nil and an
// empty header or body are the same.
func assertSameResponse(t *testing.T, want, got *idemserver.Response) {
	t.Helper()
	require.NotNil(t, got)
	assert.Equal(t, want.Status, got.Status, "status")
	assert.Equal(t, want.BodyOmitted, got.BodyOmitted, "body omitted")
	assert.True(t, bytes.Equal(want.Body, got.Body), "body: want %d bytes, got %d bytes%s", len(want.Body), len(got.Body), bodyDiff(want.Body, got.Body))
	wantH, gotH := want.Header, got.Header
	if len(wantH) == 0 {
		wantH = nil
	}
	if len(gotH) == 0 {
		gotH = nil
	}
	assert.Equal(t, wantH, gotH, "header")
}

// bodyDiff says where two bodies first differ.
func bodyDiff(a, b []byte) string {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return fmt.Sprintf(", first difference at byte %d", i)
		}
	}
	return ""
}

// concurrently runs f(i) for i in [0, n) on n goroutines started
// together, and waits for them.
func concurrently(n int, f func(i int)) {
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			f(i)
		})
	}
	close(start)
	wg.Wait()
}

var created = &idemserver.Response{
	Status: http.StatusCreated,
	Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/payments/1"}},
	Body:   []byte(`{"id":1}`),
}

func testClaimOutcomes(t *testing.T, h *harness) {
	key := idemserver.Key{Key: "k"}
	a, b := fp("request a"), fp("request b")

	// Absent: claimed.
	first, res := h.claim(key, a, live)
	require.True(t, res.Claimed, "a key without a record is claimed")
	assert.Nil(t, res.Record.Response)

	// In progress, with the same fingerprint and with another: the record
	// is reported with its own fingerprint, token and lease.
	for _, f := range []idemserver.Fingerprint{a, b} {
		c := h.newClaim(key, f, live)
		res, err := h.claimOf(t.Context(), c, false, "")
		require.NoError(t, err)
		assert.False(t, res.Claimed)
		h.assertInProgress(c, first.c, res.Record)
		assert.True(t, c.Now.Add(live/2).Before(res.Record.LeaseExpires), "lease ends at %v, about an hour after %v", res.Record.LeaseExpires, c.Now)
		assert.True(t, res.Record.LeaseExpires.Before(c.Now.Add(2*live)), "lease ends at %v, about an hour after %v", res.Record.LeaseExpires, c.Now)
	}

	// Completed: the response is reported, with the fingerprint and expiry,
	// whichever fingerprint the claimant has.
	require.NoError(t, h.complete(first, created, live))
	for _, f := range []idemserver.Fingerprint{a, b} {
		c := h.newClaim(key, f, live)
		res, err := h.claimOf(t.Context(), c, false, "")
		require.NoError(t, err)
		assert.False(t, res.Claimed)
		require.True(t, res.Record.Completed())
		assert.Equal(t, a, res.Record.Fingerprint)
		assertSameResponse(t, created, res.Record.Response)
		assert.True(t, c.Now.Add(live/2).Before(res.Record.Expires), "record expires at %v, about an hour after %v", res.Record.Expires, c.Now)
		assert.True(t, res.Record.Expires.Before(c.Now.Add(2*live)), "record expires at %v, about an hour after %v", res.Record.Expires, c.Now)
	}

	// Released: absent again.
	other := idemserver.Key{Key: "released"}
	l := h.mustClaim(other, a, live)
	require.NoError(t, h.release(l))
	_, res = h.claim(other, b, live)
	assert.True(t, res.Claimed, "a released key is claimed again, by any request")
}

func testLifecycle(t *testing.T, h *harness) {
	key := idemserver.Key{Key: "k"}
	f := fp("request")

	l1 := h.mustClaim(key, f, live)
	h.expectInProgress(key, l1)
	require.NoError(t, h.release(l1))
	h.expectFree(key)

	l2 := h.mustClaim(key, f, live)
	assert.ErrorIs(t, h.complete(l1, created, live), idemserver.ErrLeaseLost, "the released claim's token cannot complete the new one")
	h.expectInProgress(key, l2)
	require.NoError(t, h.complete(l2, created, live))
	h.expectReplay(key, f, created)

	other := &idemserver.Response{Status: http.StatusOK, Body: []byte("other")}
	assert.ErrorIs(t, h.complete(l2, other, live), idemserver.ErrLeaseLost, "completing twice")
	assert.ErrorIs(t, h.release(l2), idemserver.ErrLeaseLost, "releasing a completed record")
	assert.ErrorIs(t, h.extend(l2, live), idemserver.ErrLeaseLost, "extending a completed record")
	h.expectReplay(key, f, created)
}

func testConcurrentClaims(t *testing.T, h *harness) {
	const n = 200
	key := idemserver.Key{Key: "contended"}
	f := fp("request")
	claims, results, errs := h.newClaims(key, f, n)
	concurrently(n, func(i int) { results[i], errs[i] = h.claimOf(t.Context(), claims[i], false, "") })
	winner := h.assertOneWinner(claims, results, errs)
	if winner < 0 {
		return
	}
	l := h.leaseOf(claims[winner], results[winner])
	h.expectInProgress(key, l)
	require.NoError(t, h.complete(l, created, live))
	h.expectReplay(key, f, created)
}

// assertOneWinner checks that exactly one of the concurrent claims
// succeeded, and that every other found the winner's claim in progress. It
// returns the winner's index, or -1.
func (h *harness) assertOneWinner(claims []idemserver.Claim, results []idemserver.ClaimResult, errs []error) int {
	t := h.t
	t.Helper()
	winner, winners := -1, 0
	for i, res := range results {
		require.NoError(t, errs[i], "claim %d", i)
		if res.Claimed {
			winner = i
			winners++
		}
	}
	require.Equal(t, 1, winners, "exactly one of %d concurrent claims wins", len(claims))
	for i, res := range results {
		if i == winner {
			continue
		}
		h.assertInProgress(claims[i], claims[winner], res.Record)
	}
	h.leaseOf(claims[winner], results[winner]) // ended when the test ends
	return winner
}

func testConcurrentClaimsOfExpiredRecord(t *testing.T, h *harness) {
	// A completed record that expired is reclaimed by exactly one claim.
	key, marker := idemserver.Key{Key: "expired"}, idemserver.Key{Key: "marker"}
	f := fp("request")
	require.NoError(t, h.complete(h.mustClaim(key, f, live), created, short))
	// The marker expires after the key, whatever the store's clock; once it
	// has, so has the key.
	require.NoError(t, h.complete(h.mustClaim(marker, f, live), created, short+100*time.Millisecond))
	h.waitClaimed(marker, f)

	const n = 200
	claims, results, errs := h.newClaims(key, fp("new request"), n)
	concurrently(n, func(i int) { results[i], errs[i] = h.claimOf(t.Context(), claims[i], false, "") })
	winner := h.assertOneWinner(claims, results, errs)
	if winner < 0 {
		return
	}
	h.expectInProgress(key, h.leaseOf(claims[winner], results[winner]))
}

func testExpiry(t *testing.T, h *harness) {
	f := fp("request")
	kept, expiring := idemserver.Key{Key: "kept"}, idemserver.Key{Key: "expiring"}
	require.NoError(t, h.complete(h.mustClaim(kept, f, live), created, live))
	require.NoError(t, h.complete(h.mustClaim(expiring, f, live), created, short))

	// An expired record counts as absent, even for a different request.
	l := h.waitClaimed(expiring, fp("a different request"))
	h.expectInProgress(expiring, l)
	h.expectReplay(kept, f, created)

	// A record is absent from the instant it expires: a claim stamped at
	// exactly that instant finds it absent. The claim is made before any
	// stamped later, for which a store may drop the expired record, and
	// would then pass whatever its comparison.
	atExpiry, marker := idemserver.Key{Key: "at expiry"}, idemserver.Key{Key: "at expiry marker"}
	expires := time.Now().Add(short)
	done := h.mustClaim(atExpiry, f, live)
	require.NoError(t, h.completeOf(context.WithoutCancel(done.ctx), done, created, expires))
	claimed, err := h.claimStamped(atExpiry, expires)
	require.NoError(t, err)
	if claimed {
		return
	}
	// Kept at its expiry, or judged by a clock of the store's own, which
	// may not have reached it. A claim stamped an hour later tells them
	// apart: a store that judges by the claim's time finds the record
	// absent then.
	claimed, err = h.claimStamped(atExpiry, expires.Add(live))
	require.False(t, claimed && err == nil, "a claim stamped at the record's expiry found it live, one stamped later found it absent")
	// On a clock of its own: the marker expires after the key, whatever
	// the store's clock, and a claim made after it finds the key absent.
	require.NoError(t, h.complete(h.mustClaim(marker, f, live), created, short+100*time.Millisecond))
	h.waitClaimed(marker, f)
	claimed, err = h.claimStamped(atExpiry, expires)
	require.NoError(t, err)
	require.True(t, claimed, "a claim made after the record expired on the store's clock finds it absent")
}

// claimStamped claims key for a different request, stamped at now, and
// reports whether the claim won.
func (h *harness) claimStamped(key idemserver.Key, now time.Time) (bool, error) {
	c := h.newClaim(key, fp("a different request"), live)
	c.Now, c.LeaseExpires = now, now.Add(live)
	res, err := h.claimOf(h.t.Context(), c, false, "")
	if err == nil {
		h.leaseOf(c, res)
	}
	return res.Claimed, err
}

func testLeaseExpiry(t *testing.T, h *harness) {
	key := idemserver.Key{Key: "k"}
	f := fp("request")
	dead := h.mustClaim(key, f, short)
	rec := h.waitLeaseExpired(key, dead)
	assert.Equal(t, f, rec.Fingerprint)

	// A lease that has not ended is never taken over, even with its token:
	// its holder may have extended it after the caller saw it end.
	holder := h.mustClaim(idemserver.Key{Key: "live"}, f, live)
	res, err := h.claimOf(t.Context(), h.newClaim(holder.c.Key, f, live), true, holder.c.Token)
	require.NoError(t, err)
	assert.False(t, res.Claimed, "TakeOver of a live lease")
	h.expectInProgress(holder.c.Key, holder)

	// A lease has ended from the instant it ends: a TakeOver stamped at
	// exactly that instant takes it over.
	endKey := idemserver.Key{Key: "lease end"}
	ending := h.mustClaim(endKey, f, short)
	h.waitLeaseExpired(endKey, ending)
	atEnd := h.newClaim(endKey, f, live)
	atEnd.Now, atEnd.LeaseExpires = ending.c.LeaseExpires, ending.c.LeaseExpires.Add(live)
	res, err = h.claimOf(t.Context(), atEnd, true, ending.c.Token)
	require.NoError(t, err)
	require.True(t, res.Claimed, "a TakeOver stamped at the lease's end; found %+v", res.Record)
	h.expectInProgress(endKey, h.leaseOf(atEnd, res))

	// TakeOver names the expired token: a wrong one takes nothing.
	c := h.newClaim(key, f, live)
	res, err = h.claimOf(t.Context(), c, true, "not-the-token")
	require.NoError(t, err)
	assert.False(t, res.Claimed, "TakeOver with a token the record does not hold")
	assert.Equal(t, dead.c.Token, res.Record.Token)

	c = h.newClaim(key, f, live)
	res, err = h.claimOf(t.Context(), c, true, dead.c.Token)
	require.NoError(t, err)
	require.True(t, res.Claimed, "TakeOver of an expired lease")
	taken := h.leaseOf(c, res)
	h.expectInProgress(key, taken)

	// The dead handler's token no longer holds.
	assert.ErrorIs(t, h.complete(dead, created, live), idemserver.ErrLeaseLost)
	assert.ErrorIs(t, h.extend(dead, live), idemserver.ErrLeaseLost)
	assert.ErrorIs(t, h.release(dead), idemserver.ErrLeaseLost)
	h.expectInProgress(key, taken)
	require.NoError(t, h.complete(taken, created, live))
	h.expectReplay(key, f, created)

	// TakeOver of a key that is absent claims it, as Claim does.
	absent := idemserver.Key{Key: "absent"}
	c = h.newClaim(absent, f, live)
	res, err = h.claimOf(t.Context(), c, true, "gone")
	require.NoError(t, err)
	assert.True(t, res.Claimed, "TakeOver of an absent key claims it")

	// TakeOver of a completed key reports it.
	c = h.newClaim(key, f, live)
	res, err = h.claimOf(t.Context(), c, true, taken.c.Token)
	require.NoError(t, err)
	assert.False(t, res.Claimed, "TakeOver of a completed key")
	require.True(t, res.Record.Completed())
	assertSameResponse(t, created, res.Record.Response)
}

func testCompleteAfterLeaseEnded(t *testing.T, h *harness) {
	// A lease that ended but was not taken over still holds: its handler
	// may have acted, so Complete keeps the response, and keeps it until
	// its own expiry, not the lease's end. A store that refused it, or
	// forgot it when the lease would have ended, would let a retry run the
	// handler again.
	key := idemserver.Key{Key: "k"}
	f := fp("request")
	l := h.mustClaim(key, f, short)
	h.waitLeaseExpired(key, l)
	require.NoError(t, h.complete(l, created, live), "Complete of an ended lease that no one took over")
	h.expectReplay(key, f, created)
}

// testCompleteSentAgain sends a Complete again, as the middleware does
// when the first one's answer did not come back within its timeout (see
// idemserver.WithStoreTimeout): with the same token, response and expiry,
// and through CompletePacked with the same packed response. The store must
// answer it as it answered the first, or the client would be told its
// request lost the key while every retry replays the response it was
// denied. A different response is still refused.
func testCompleteSentAgain(t *testing.T, h *harness) {
	key := idemserver.Key{Key: "k"}
	f := fp("request")
	l := h.mustClaim(key, f, live)
	ctx, now, expires := context.WithoutCancel(l.ctx), time.Now(), time.Now().Add(live)
	packed := idemserver.PackResponse(created)
	complete := func(resp *idemserver.Response) error {
		if h.packed == nil || resp != created {
			return h.completeOf(ctx, l, resp, expires)
		}
		return h.packed.CompletePacked(ctx, idemserver.PackedCompletion{
			Key: l.c.Key, Token: l.c.Token, Ref: l.ref, Response: packed, Now: now, Expires: expires,
		})
	}
	require.NoError(t, complete(created))
	for range 3 {
		require.NoError(t, complete(created), "the same completion sent again")
		if h.packed == nil {
			// A copy, whose header map may be walked in another order.
			require.NoError(t, complete(cloneResponse(created)), "the same completion sent again")
		}
	}
	for _, change := range []struct {
		name string
		edit func(*idemserver.Response)
	}{
		{"body", func(r *idemserver.Response) { r.Body = []byte(`{"id":2}`) }},
		{"status", func(r *idemserver.Response) { r.Status = http.StatusAccepted }},
		{"header field", func(r *idemserver.Response) { r.Header.Set("Location", "/payments/2") }},
		{"header field added", func(r *idemserver.Response) { r.Header.Set("Retry-After", "1") }},
	} {
		other := cloneResponse(created)
		change.edit(other)
		assert.ErrorIs(t, complete(other), idemserver.ErrLeaseLost, "another %s under the same token", change.name)
	}
	h.expectReplay(key, f, created)
}

// testStaleCompleteOfSameResponse completes a record with the response of
// the claim that took it over, and then sends the completion of the claim
// whose lease ended, with the same response: a handler that returns the
// same bytes whichever run it was (204, {"status":"ok"}). Only the token
// tells the two apart, and the stale one must still be refused: the
// middleware reports the lost lease, the one sign that the handler ran
// twice, and a client told ErrLeaseLost learns the outcome from a retry.
func testStaleCompleteOfSameResponse(t *testing.T, h *harness) {
	key := idemserver.Key{Key: "k"}
	f := fp("request")
	dead := h.mustClaim(key, f, short)
	h.waitLeaseExpired(key, dead)

	c := h.newClaim(key, f, live)
	res, err := h.claimOf(t.Context(), c, true, dead.c.Token)
	require.NoError(t, err)
	require.True(t, res.Claimed, "the takeover of an expired lease")
	l := h.leaseOf(c, res)
	require.NoError(t, h.complete(l, created, live))

	assert.ErrorIs(t, h.complete(dead, created, live), idemserver.ErrLeaseLost,
		"the completion of the lease that ended, with the same response")
	require.NoError(t, h.complete(l, created, live), "the takeover's completion sent again")
	h.expectReplay(key, f, created)
}

// testCompleteWithoutResponse calls Complete with a nil response, which
// the middleware never sends but another caller of the store may: the
// store must refuse it with an error, neither panic nor store a record
// that cannot be replayed, and leave the claim as it was, for its holder
// to complete or release. The error reports no lost lease, rollback or
// unknown outcome, since none happened. (A PackedCompletion has no nil
// response to give; the packed pass skips this.)
func testCompleteWithoutResponse(t *testing.T, h *harness) {
	if h.packed != nil {
		t.Skip("checked through Complete in the unpacked pass")
	}
	f := fp("request")
	for _, then := range []string{"Complete", "Release"} {
		t.Run("then "+then, func(t *testing.T) {
			h := h.sub(t)
			key := idemserver.Key{Key: "no-response/" + then}
			l := h.mustClaim(key, f, live)
			var err error
			require.NotPanics(t, func() {
				err = h.s.Complete(context.WithoutCancel(l.ctx), l.c.Key, l.c.Token, nil, time.Now().Add(live))
			}, "Complete with a nil response")
			require.Error(t, err, "Complete with a nil response")
			for _, sentinel := range []error{idemserver.ErrLeaseLost, idemserver.ErrRolledBack,
				idemserver.ErrOutcomeUnknown, idemserver.ErrRetryRequest} {
				assert.NotErrorIs(t, err, sentinel, "Complete with a nil response")
			}
			h.expectInProgress(key, l)
			if then == "Release" {
				require.NoError(t, h.release(l), "Release after a Complete with a nil response")
				h.expectFree(key)
				return
			}
			require.NoError(t, h.complete(l, created, live), "Complete after a Complete with a nil response")
			h.expectReplay(key, f, created)
		})
	}
}

func testConcurrentTakeOvers(t *testing.T, h *harness) {
	const n = 100
	key := idemserver.Key{Key: "k"}
	f := fp("request")
	dead := h.mustClaim(key, f, short)
	h.waitLeaseExpired(key, dead)

	claims, results, errs := h.newClaims(key, f, n)
	concurrently(n, func(i int) { results[i], errs[i] = h.claimOf(t.Context(), claims[i], true, dead.c.Token) })
	winner := h.assertOneWinner(claims, results, errs)
	if winner < 0 {
		return
	}
	l := h.leaseOf(claims[winner], results[winner])
	h.expectInProgress(key, l)
	assert.ErrorIs(t, h.complete(dead, created, live), idemserver.ErrLeaseLost)
	require.NoError(t, h.complete(l, created, live))
	h.expectReplay(key, f, created)
}

func testCompleteRacesTakeOvers(t *testing.T, h *harness) {
	// The holder of a lease that ended completes it while others take it
	// over: either the completion or one takeover wins, never both. A store
	// that checks the token and then writes, in two steps, would let a
	// takeover in between, and store the old handler's response on the
	// new claim's record while its handler runs again.
	const rounds, n = 20, 8
	f := fp("request")
	for round := range rounds {
		key := idemserver.Key{Key: "race/" + strconv.Itoa(round)}
		dead := h.mustClaim(key, f, short)
		h.waitLeaseExpired(key, dead)
		claims, results, errs := h.newClaims(key, f, n)
		var completeErr error
		concurrently(n+1, func(i int) {
			if i == n {
				completeErr = h.complete(dead, created, live)
				return
			}
			results[i], errs[i] = h.claimOf(t.Context(), claims[i], true, dead.c.Token)
		})
		winner, winners := -1, 0
		for i, res := range results {
			require.NoError(t, errs[i], "takeover %d", i)
			if res.Claimed {
				winner, winners = i, winners+1
			}
		}
		if completeErr != nil {
			require.ErrorIs(t, completeErr, idemserver.ErrLeaseLost)
		}
		require.LessOrEqual(t, winners, 1, "takeovers won")
		require.True(t, (completeErr == nil) != (winners == 1),
			"either the completion (err %v) or one takeover (%d won) wins, round %d", completeErr, winners, round)
		if completeErr == nil {
			h.expectReplay(key, f, created)
			continue
		}
		h.expectInProgress(key, h.leaseOf(claims[winner], results[winner]))
	}
}

func testExtend(t *testing.T, h *harness) {
	key := idemserver.Key{Key: "k"}
	f := fp("request")

	// A lease that has ended, extended before anyone took it over, is live
	// again: Claim reports it live, with the new end.
	l := h.mustClaim(key, f, short)
	h.waitLeaseExpired(key, l)
	require.NoError(t, h.extend(l, live))
	h.expectInProgress(key, l)
	require.NoError(t, h.extend(l, live), "extending again")
	h.expectInProgress(key, l)

	// A lease shortened to end at once ends.
	require.NoError(t, h.extend(l, 0))
	h.waitLeaseExpired(key, l)
	require.NoError(t, h.extend(l, live))

	// Extending changes nothing else: the claim completes as usual.
	require.NoError(t, h.complete(l, created, live))
	h.expectReplay(key, f, created)
}

func testExtendTransactional(t *testing.T, h *harness) {
	// A claim holds while its transaction is open: Extend succeeds, and
	// changes nothing.
	key := idemserver.Key{Key: "k"}
	f := fp("request")
	l := h.mustClaim(key, f, short)
	require.NoError(t, h.extend(l, live))
	require.NoError(t, h.extend(l, 0))
	h.expectInProgress(key, l)
	require.NoError(t, h.complete(l, created, live))
	assert.ErrorIs(t, h.extend(l, live), idemserver.ErrLeaseLost, "extending a completed claim")
	h.expectReplay(key, f, created)
}

func testStaleTokens(t *testing.T, h *harness) {
	f := fp("request")
	ops := []struct {
		name string
		do   func(*harness, lease) error
	}{
		{"Complete", func(h *harness, l lease) error { return h.complete(l, created, live) }},
		{"Release", (*harness).release},
		{"Extend", func(h *harness, l lease) error { return h.extend(l, live) }},
	}
	for _, tt := range []struct {
		name string
		// setup returns the stale lease, and the live one that holds the
		// key (zero if none), in a fresh key.
		setup func(h *harness, key idemserver.Key) (stale, holder lease)
	}{
		{"wrong token", func(h *harness, key idemserver.Key) (lease, lease) {
			l := h.mustClaim(key, f, live)
			stale := l
			stale.c.Token = "wrong"
			return stale, l
		}},
		{"absent key", func(h *harness, key idemserver.Key) (lease, lease) {
			return lease{c: h.newClaim(key, f, live), ctx: h.t.Context()}, lease{}
		}},
		{"released", func(h *harness, key idemserver.Key) (lease, lease) {
			l := h.mustClaim(key, f, live)
			require.NoError(h.t, h.release(l))
			return l, lease{}
		}},
		{"released and claimed again", func(h *harness, key idemserver.Key) (lease, lease) {
			l := h.mustClaim(key, f, live)
			require.NoError(h.t, h.release(l))
			return l, h.mustClaim(key, f, live)
		}},
		{"taken over", func(h *harness, key idemserver.Key) (lease, lease) {
			l := h.mustClaim(key, f, short)
			h.waitLeaseExpired(key, l)
			c := h.newClaim(key, f, live)
			res, err := h.claimOf(h.t.Context(), c, true, l.c.Token)
			require.NoError(h.t, err)
			require.True(h.t, res.Claimed)
			return l, h.leaseOf(c, res)
		}},
	} {
		if h.tx && tt.name == "taken over" {
			continue // no leases to take over
		}
		for _, o := range ops {
			t.Run(tt.name+"/"+o.name, func(t *testing.T) {
				h := h.sub(t)
				key := idemserver.Key{Key: tt.name + "/" + o.name}
				stale, holder := tt.setup(h, key)
				assert.ErrorIs(t, o.do(h, stale), idemserver.ErrLeaseLost)
				// Nothing changed: the holder still holds the key, or
				// it is still free.
				if holder.c.Token == "" {
					h.expectFree(key)
					return
				}
				h.expectInProgress(key, holder)
				require.NoError(t, h.complete(holder, created, live))
				h.expectReplay(key, f, created)
			})
		}
	}
}

func testResponses(t *testing.T, h *harness) {
	big := make([]byte, 1<<20)
	for i := range big {
		big[i] = byte(i * 7 % 251)
	}
	allBytes := make([]byte, 256)
	for i := range allBytes {
		allBytes[i] = byte(i)
	}
	manyFields := make(http.Header)
	for i := range 100 {
		manyFields["X-Field-"+strconv.Itoa(i)] = []string{strconv.Itoa(i), ""}
	}
	for _, tt := range []struct {
		name string
		resp *idemserver.Response
	}{
		{"status only", &idemserver.Response{Status: http.StatusNoContent}},
		{"empty body with fields", &idemserver.Response{Status: http.StatusOK, Header: http.Header{"Content-Length": {"0"}}}},
		{"multi-valued fields", &idemserver.Response{Status: http.StatusCreated, Header: http.Header{
			"Link":         {"</a>; rel=next", "</b>; rel=prev", "</c>; rel=last"},
			"Vary":         {"Accept", "Accept-Encoding"},
			"X-Empty":      {""},
			"X-Unicode":    {"grüße, 世界"},
			"Content-Type": {"application/json; charset=utf-8"},
		}, Body: []byte(`{"ok":true}`)}},
		{"many fields", &idemserver.Response{Status: http.StatusAccepted, Header: manyFields}},
		{"every byte value", &idemserver.Response{Status: http.StatusOK, Body: allBytes}},
		{"1 MiB body", &idemserver.Response{Status: http.StatusOK, Header: http.Header{"Content-Type": {"application/octet-stream"}}, Body: big}},
		{"body omitted", &idemserver.Response{Status: http.StatusCreated, Header: http.Header{"Location": {"/big/1"}}, BodyOmitted: true}},
		{"client error", &idemserver.Response{Status: http.StatusNotFound, Body: []byte("no such account")}},
		{"unusual status", &idemserver.Response{Status: 299, Body: []byte("x")}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := h.sub(t)
			key := idemserver.Key{Key: "response/" + tt.name}
			f := fp(tt.name)
			want := cloneResponse(tt.resp)
			require.NoError(t, h.complete(h.mustClaim(key, f, live), tt.resp, live))
			// Twice: a replay does not change what the next one gets.
			h.expectReplay(key, f, want)
			h.expectReplay(key, f, want)
		})
	}

	// A middleware may keep bodies larger than its default limit (see
	// idemserver.WithMaxResponseBytes). A store may refuse one it cannot
	// hold, but never keep less of it than it was given.
	t.Run("larger than the default limit", func(t *testing.T) {
		h := h.sub(t)
		body := make([]byte, 3*idemserver.DefaultMaxResponseBytes+1)
		for i := range body {
			body[i] = byte(i * 13 % 241)
		}
		resp := &idemserver.Response{Status: http.StatusOK, Body: body}
		want := cloneResponse(resp)
		key := idemserver.Key{Key: "response/larger"}
		f := fp("larger")
		l := h.mustClaim(key, f, live)
		if err := h.complete(l, resp, live); err != nil {
			// Refused, the claim is left as it was (a transactional
			// store's, rolled back).
			t.Logf("the store refused a body of %d bytes: %v", len(body), err)
			if !h.tx {
				h.expectInProgress(key, l)
			}
			return
		}
		h.expectReplay(key, f, want)
	})
}

// cloneResponse returns a deep copy of r.
func cloneResponse(r *idemserver.Response) *idemserver.Response {
	c := *r
	c.Header = r.Header.Clone()
	c.Body = bytes.Clone(r.Body)
	return &c
}

func testScopes(t *testing.T, h *harness) {
	f := fp("request")
	// Pairs of keys that must stay apart, including pairs whose scope and
	// key would be equal if simply joined.
	for _, tt := range []struct {
		name string
		a, b idemserver.Key
	}{
		{"same key, two scopes", idemserver.Key{Scope: "tenant-a", Key: "k"}, idemserver.Key{Scope: "tenant-b", Key: "k"}},
		{"scope and no scope", idemserver.Key{Scope: "", Key: "k"}, idemserver.Key{Scope: "t", Key: "k"}},
		{"split moves", idemserver.Key{Scope: "ab", Key: "c"}, idemserver.Key{Scope: "a", Key: "bc"}},
		{"separator in the scope", idemserver.Key{Scope: "a:b", Key: "c"}, idemserver.Key{Scope: "a", Key: "b:c"}},
		{"NUL in the scope", idemserver.Key{Scope: "a\x00", Key: "b"}, idemserver.Key{Scope: "a", Key: "b"}},
		{"bytes that are not UTF-8", idemserver.Key{Scope: "\xff\xfe", Key: "k"}, idemserver.Key{Scope: "\xff\xfd", Key: "k"}},
		{"longest key", idemserver.Key{Scope: "s", Key: strings.Repeat("k", idemserver.MaxKeyLen)}, idemserver.Key{Scope: "s", Key: strings.Repeat("k", idemserver.MaxKeyLen-1) + "j"}},
		{"case", idemserver.Key{Scope: "Tenant", Key: "K"}, idemserver.Key{Scope: "tenant", Key: "k"}},
		// A quoted key may end in a space, and a scope may; a SQL column
		// whose collation pads with spaces would take these for one.
		{"trailing space in the key", idemserver.Key{Key: "pad"}, idemserver.Key{Key: "pad "}},
		{"trailing space in the scope", idemserver.Key{Scope: "pad", Key: "k"}, idemserver.Key{Scope: "pad ", Key: "k"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := h.sub(t)
			lb := h.mustClaim(tt.b, f, live)
			var la lease
			if h.tx {
				la = h.mustClaim(tt.a, f, live)
			} else {
				// A lease that ended is taken over in its own scope,
				// and its token takes nothing in the other.
				dead := h.mustClaim(tt.a, f, short)
				h.waitLeaseExpired(tt.a, dead)
				c := h.newClaim(tt.b, f, live)
				res, err := h.claimOf(t.Context(), c, true, dead.c.Token)
				require.NoError(t, err)
				require.False(t, res.Claimed, "TakeOver of the other scope's key, with this one's expired token")
				h.assertInProgress(c, lb.c, res.Record)
				c = h.newClaim(tt.a, f, live)
				res, err = h.claimOf(t.Context(), c, true, dead.c.Token)
				require.NoError(t, err)
				require.True(t, res.Claimed, "TakeOver of an expired lease")
				la = h.leaseOf(c, res)
				h.expectInProgress(tt.a, la)
				h.expectInProgress(tt.b, lb)
			}
			ra := &idemserver.Response{Status: http.StatusCreated, Body: []byte("a")}
			rb := &idemserver.Response{Status: http.StatusCreated, Body: []byte("b")}
			// A token is no passport into another scope.
			cross := la
			cross.c.Key = tt.b
			assert.ErrorIs(t, h.complete(cross, ra, live), idemserver.ErrLeaseLost)
			assert.ErrorIs(t, h.release(cross), idemserver.ErrLeaseLost)
			assert.ErrorIs(t, h.extend(cross, live), idemserver.ErrLeaseLost)
			// Each lease is extended and released in its own scope.
			require.NoError(t, h.extend(la, live))
			h.expectInProgress(tt.a, la)
			require.NoError(t, h.release(lb))
			h.expectInProgress(tt.a, la)
			lb = h.mustClaim(tt.b, f, live)
			require.NoError(t, h.complete(la, ra, live))
			h.expectInProgress(tt.b, lb)
			require.NoError(t, h.complete(lb, rb, live))
			h.expectReplay(tt.a, f, ra)
			h.expectReplay(tt.b, f, rb)
		})
	}
}

func testCancelledContext(t *testing.T, h *harness) {
	f := fp("request")
	ctx, cancel := context.WithCancel(t.Context())
	cancel()

	// Claim and TakeOver fail, and claim nothing.
	key := idemserver.Key{Key: "claim"}
	_, err := h.claimOf(ctx, h.newClaim(key, f, live), false, "")
	require.Error(t, err, "Claim with a cancelled context")
	h.expectFree(key)
	if !h.tx {
		l := h.mustClaim(key, f, short)
		h.waitLeaseExpired(key, l)
		_, err = h.claimOf(ctx, h.newClaim(key, f, live), true, l.c.Token)
		require.Error(t, err, "TakeOver with a cancelled context")
		// The lease still holds l's token: the failed TakeOver took nothing.
		rec := h.waitLeaseExpired(key, l)
		assert.Equal(t, l.c.Token, rec.Token)
	}

	// Complete, Release and Extend either fail and change nothing, or
	// succeed: never something in between.
	for _, tt := range []struct {
		name string
		do   func(lease) error
		// done checks the key after the call succeeded.
		done func(*harness, idemserver.Key, lease)
	}{
		{"Complete", func(l lease) error {
			return h.completeOf(ctx, l, created, time.Now().Add(live))
		}, func(h *harness, key idemserver.Key, _ lease) { h.expectReplay(key, f, created) }},
		{"Release", func(l lease) error {
			return h.s.Release(ctx, l.c.Key, l.c.Token)
		}, func(h *harness, key idemserver.Key, _ lease) { h.expectFree(key) }},
		{"Extend", func(l lease) error {
			return h.s.Extend(ctx, l.c.Key, l.c.Token, time.Now().Add(live))
		}, func(h *harness, key idemserver.Key, l lease) { h.expectInProgress(key, l) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := h.sub(t)
			key := idemserver.Key{Key: "cancelled/" + tt.name}
			l := h.mustClaim(key, f, live)
			if tt.do(l) == nil {
				tt.done(h, key, l)
				return
			}
			h.expectInProgress(key, l)
			require.NoError(t, h.complete(l, created, live))
			h.expectReplay(key, f, created)
		})
	}
}
