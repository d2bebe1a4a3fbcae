package idemserver

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemhttp/idemhttp/internal/retryafter"
)

// Middleware returns net/http middleware that runs each keyed request's
// handler at most once per key and replays the outcome to every retry. A nil
// store means a new [MemoryStore] with its default limits.
//
// For a request whose method is keyed (POST and PATCH, in any case, unless
// [WithMethods] says otherwise) and that carries a key, the middleware
// reads the body (up to [WithMaxBodyBytes]; 413 beyond it), restores it for
// the handler, and takes the request's fingerprint: its method, path, query
// and body, and, when middleware in front of this one parsed its form (and
// so consumed its body, or, for a multipart form, the body up to the form's
// end), that form (fields and files, within the same limit). Middleware in front that reads the body in any other way must
// restore it: one it consumed reads as empty, and requests that differ only
// in it share a fingerprint. Then it claims the key in the store with the
// fingerprint:
//
//   - Claimed: the handler runs, with the claimed key in its context (see
//     [KeyFrom]). Its response is held back (see [WithMaxResponseBytes]
//     and Flush below), and a status below 500 is stored for [WithTTL]
//     before the client gets it. A status of 500 or more, or a panic,
//     releases the claim instead, so a retry runs the handler again; the
//     panic continues after the release. So do 408, 425 and 429, the
//     statuses below 500 that say the request was not processed and should
//     be sent again, 499, which says that the client went away, and a 409
//     with Retry-After, which says that the request is in progress in a
//     service behind the handler: storing them would answer every retry
//     with the same refusal. See [ReleasesResponse].
//   - Completed with the same fingerprint: the stored status, header fields
//     and body are replayed with Idempotent-Replayed: true, and the handler
//     does not run.
//   - In progress with the same fingerprint: 409 with Retry-After, or with
//     [WithWaitInFlight] a wait for the outcome and its replay. A claim
//     whose lease ([WithLease]) has ended, because nothing renewed it, is
//     taken over and the handler runs again.
//   - A different fingerprint: 422, whatever the record's state.
//   - The store fails, is full ([ErrStoreFull]) or refuses claims by its
//     configuration ([ErrStoreMisconfigured]): 503 with Retry-After, and
//     the handler does not run, since running it without a claim could
//     run it twice.
//
// The header fields stored are those the handler set: the ones it added,
// and those set in front of the middleware (a request id, CORS fields)
// whose values it changed. The others belong to their request, and a
// replay carries its own request's. A stored response cannot remove a
// field, so one set in front of the middleware that the handler deleted is
// missing from the first response only. Hop-by-hop fields are never stored,
// nor Set-Cookie unless [WithReplayedHeaders] allows it. As under net/http,
// the client gets the fields as they were at WriteHeader (changes to the
// map after it reach the client only as trailers), and Write fails with
// [http.ErrBodyNotAllowed] on a status that allows no body, and with
// [http.ErrContentLength] past the Content-Length the handler declared; so
// the first response and its replays agree. A body shorter than that
// Content-Length, which net/http cuts the connection after, is not stored,
// as one larger than [WithMaxResponseBytes] is not.
//
// A request whose method is not keyed goes straight to the handler, and so
// does one without a key unless [RequireKey] is set. A malformed key is
// refused with 400. Every response the middleware writes itself is a
// problem+json document; see [ProblemInProgress] and the other Problem
// constants.
//
// While the handler runs, its lease is renewed ([Store.Extend]) every third
// of a lease, so that a live handler is never taken over. If the lease is
// lost anyway, because the store says so or because no extension succeeded
// before it ended, the handler's context is cancelled with a cause wrapping
// [ErrLeaseLost]. A handler that runs longer than [WithMaxHold] has its
// context cancelled with a cause wrapping [ErrMaxHoldExceeded], and its
// lease is no longer renewed, so its key can be taken over one lease later.
//
// A handler whose context has ended (its client went away, a deadline set
// in front of the middleware passed, or the middleware cancelled it as
// above) and that returns without writing a status has not acted: its
// claim is released rather than an implicit 200 stored, the client is
// answered 503 with Retry-After ([ProblemRequestCanceled], or
// [ProblemLeaseLost] when the lease was lost), and the observer gets the
// context's cause in [Event.Err]. A handler that did write its response
// after its context ended has it stored as usual. So a handler that acts
// must write its status (WriteHeader or Write) rather than rely on the
// implicit 200 of an empty response: one that returns without writing just
// as its client goes away is taken not to have acted, and runs again.
//
// A handler that flushes ([http.Flusher] or [http.ResponseController])
// lets its response through at once, to stream it; it is still stored when
// the handler returns, but the client may see it before that. Once its
// status has been flushed it is the outcome: a streaming handler that then
// gives up (its context ended) without acting has its status stored and
// replayed all the same, so a handler must flush only what it has done.
// When a write or flush to the client fails while the response streams
// (the client went away), the handler learns it and may stop short of the
// end of its body, so the response is stored without its body, as one
// larger than [WithMaxResponseBytes] is: a replay carries its status and
// header fields and a problem of type [ProblemResponseNotStored]. A body
// that filled the Content-Length the handler declared is whole, and
// stored, however its delivery went. A
// store that implements [ResponseHolder], or a claim whose
// [ClaimResult.Hold] is set, turns streaming off: then nothing reaches the
// client before Complete returns, however large the response. An
// informational (1xx) response, such as 103 Early Hints, goes to the
// client at once, as under net/http, except then, when it is dropped: it
// is a hint, and a replay never carries one either.
// Hijacking the connection of a keyed request is refused with an error
// wrapping [http.ErrNotSupported]. The handler's ResponseWriter cannot be
// unwrapped to reach the client's, which would let bytes past the record;
// the deadlines and full duplex of [http.ResponseController] still reach
// the client's connection.
//
// A Complete or Release that fails with a transient error (any but
// [ErrLeaseLost], [ErrRolledBack], [ErrOutcomeUnknown], [ErrRetryRequest]
// and [ErrClosed]) is tried twice more,
// after 10ms and 100ms, with a context that is not cancelled, unless the
// wait would pass the end of the lease. When the store still fails to keep
// a response the handler produced, the client gets the response and the
// observer (see [WithObserver]) gets the error; the record stays in
// progress until its lease lapses, and then a retry runs the handler again.
// The response is replaced by 503 with Retry-After only when nothing the
// handler did was kept (a transactional store reports [ErrRolledBack]), or
// may not have been ([ErrOutcomeUnknown], or any other failure but
// [ErrLeaseLost] of a store that holds responses: the claim is not
// released, and the retry learns from the store what was committed), or
// when the claim
// was lost and another request's outcome is what retries get (Complete
// reports [ErrLeaseLost]; [ProblemLeaseLost]); a response that was already
// streamed cannot be replaced. When the store reports [ErrRetryRequest]
// (it discarded the attempt after a serialization failure or deadlock), the
// request runs again from the claim on, up to [MaxReruns] times, and then
// gets 503.
func Middleware(store Store, opts ...Option) func(http.Handler) http.Handler {
	if store == nil {
		store = NewMemoryStore()
	}
	cfg := newConfig(opts)
	tokens := newTokenSource()
	// A PackedStore takes and returns responses in packed form: the
	// recorder's fields and body go into the store without first becoming
	// a Response, and a replay is written from what the store kept.
	packed, _ := store.(PackedStore)
	holder, ok := store.(ResponseHolder)
	hold := ok && holder.HoldResponses()
	return func(next http.Handler) http.Handler {
		return &handler{next: next, store: store, packed: packed, hold: hold, cfg: cfg, tokens: tokens, newToken: tokens.next}
	}
}

// Outcome says what the middleware did with a keyed request.
type Outcome int

// Outcomes reported to the observer.
const (
	// OutcomeUnkeyed: the request had no key and went to the handler.
	OutcomeUnkeyed Outcome = iota + 1
	// OutcomeRejected: the key or body was refused (400 or 413).
	OutcomeRejected
	// OutcomeUnavailable: the store failed and the handler did not run, or
	// its outcome was rolled back, or could not be stored because its claim
	// was lost (503).
	OutcomeUnavailable
	// OutcomeExecuted: the handler ran and its response was stored.
	OutcomeExecuted
	// OutcomeReleased: the handler ran, answered 5xx (or 408, 425, 429,
	// 499, or 409 with Retry-After), panicked, or returned without
	// answering after its context ended, and the claim was released.
	OutcomeReleased
	// OutcomeReplayed: a stored response was replayed.
	OutcomeReplayed
	// OutcomeInProgress: the key was in progress (409).
	OutcomeInProgress
	// OutcomeMismatch: the key belongs to a different request (422).
	OutcomeMismatch
	// OutcomeCanceled: the request's context ended (its client left)
	// while the key was being claimed, and the handler did not run.
	OutcomeCanceled
)

// String returns the outcome's name, such as "replayed".
func (o Outcome) String() string {
	switch o {
	case OutcomeUnkeyed:
		return "unkeyed"
	case OutcomeRejected:
		return "rejected"
	case OutcomeUnavailable:
		return "unavailable"
	case OutcomeExecuted:
		return "executed"
	case OutcomeReleased:
		return "released"
	case OutcomeReplayed:
		return "replayed"
	case OutcomeInProgress:
		return "in progress"
	case OutcomeMismatch:
		return "mismatch"
	case OutcomeCanceled:
		return "canceled"
	}
	return "Outcome(" + strconv.Itoa(int(o)) + ")"
}

// An Event tells the observer (see [WithObserver]) what the middleware did
// with one request whose method is keyed.
type Event struct {
	// Request is the request, as the handler saw it.
	Request *http.Request
	// Key is the request's scoped key; zero when it had none.
	Key Key
	// Outcome is what the middleware did.
	Outcome Outcome
	// Status is the status code the client was sent; for a panic, zero.
	Status int
	// Err is the store's error, if any: the cause of OutcomeUnavailable,
	// or a failure to complete or release a claim, such as [ErrLeaseLost].
	// For a handler that panicked it wraps [ErrHandlerPanicked]; for a
	// store that was full, [ErrStoreFull]; for one that refused claims by
	// its configuration, [ErrStoreMisconfigured]. When the handler's context
	// ended, it wraps the context's cause: the client's, or one wrapping
	// [ErrLeaseLost] or [ErrMaxHoldExceeded] when the middleware cancelled it.
	Err error
	// Evictions lists the completed records that the store dropped before
	// they expired to make room for this request's key (see
	// [ClaimResult.Evictions]): a retry of any of them runs its handler
	// again.
	Evictions []Eviction
}

// ErrHandlerPanicked is reported to the observer, in [Event.Err], when a
// handler panicked; the claim of a keyed request was released.
var ErrHandlerPanicked = errors.New("idemserver: handler panicked")

// Wait-in-flight polling intervals, and how many expired leases one
// request tries to take over before it treats the key as in progress.
const (
	maxTakeOvers = 4
	firstPoll    = 5 * time.Millisecond
	maxPoll      = 250 * time.Millisecond
)

type handler struct {
	next     http.Handler
	store    Store
	packed   PackedStore // store, if it is one
	hold     bool        // hold every response until Complete returns; see ResponseHolder and ClaimResult.Hold
	cfg      *config
	tokens   *tokenSource
	newToken func() string // tokens.next, made once
}

func (m *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	cfg := m.cfg
	if !cfg.keyed(r.Method) {
		m.next.ServeHTTP(w, r)
		return
	}
	values := r.Header[cfg.header]
	if len(values) == 0 {
		if cfg.requireKey {
			writeProblem(w, ProblemMissingKey, http.StatusBadRequest,
				"a "+r.Method+" request must carry an "+cfg.header+" header", "")
			m.observe(Event{Request: r, Outcome: OutcomeRejected, Status: http.StatusBadRequest})
			return
		}
		m.serveUnkeyed(w, r)
		return
	}
	if len(values) > 1 {
		m.reject(w, r, Key{}, ProblemMalformedKey, http.StatusBadRequest, "more than one "+cfg.header+" header", nil)
		return
	}
	raw, err := ParseKey(values[0])
	if err != nil {
		m.reject(w, r, Key{}, ProblemMalformedKey, http.StatusBadRequest, err.Error(), nil)
		return
	}
	key := Key{Key: raw}
	if cfg.scope != nil {
		key.Scope = cfg.scope(r)
	}
	bufs := getBuffers()
	defer bufs.put()
	body, err := readBody(r.Body, r.ContentLength, cfg.maxBody, bufs.reqBody)
	switch {
	case errors.Is(err, errBodyTooLarge):
		m.reject(w, r, key, ProblemBodyTooLarge, http.StatusRequestEntityTooLarge,
			"a keyed request body may be at most "+strconv.FormatInt(cfg.maxBody, 10)+" bytes", nil)
		return
	case errors.Is(err, os.ErrDeadlineExceeded):
		// The server's read deadline passed while a slow client sent the
		// body: 408 invites the same request again, 400 would be final.
		m.reject(w, r, key, ProblemBodyUnreadable, http.StatusRequestTimeout, err.Error(), nil)
		return
	case err != nil:
		m.reject(w, r, key, ProblemBodyUnreadable, http.StatusBadRequest, err.Error(), nil)
		return
	}
	if body != nil {
		bufs.reqBody = body
	}
	var form []byte
	if r.PostForm != nil || r.MultipartForm != nil {
		// A middleware in front parsed the form, and read its body: all of
		// it, or, for a multipart form, up to its closing boundary, so
		// that what the middleware read is only what followed.
		form, err = parsedForm(r, cfg.maxBody)
		switch {
		case errors.Is(err, errBodyTooLarge):
			m.reject(w, r, key, ProblemBodyTooLarge, http.StatusRequestEntityTooLarge,
				"a keyed request's form may be at most "+strconv.FormatInt(cfg.maxBody, 10)+" bytes", nil)
			return
		case errors.Is(err, errFormFile):
			// The error names a temporary file of this server, which is
			// not the client's to see; the request itself may be sound,
			// so the answer invites it again.
			m.reject(w, r, key, ProblemBodyUnreadable, http.StatusInternalServerError,
				"a file of the request's form could not be read back; the request was not processed", nil)
			return
		case err != nil:
			m.reject(w, r, key, ProblemBodyUnreadable, http.StatusBadRequest, err.Error(), nil)
			return
		}
	}
	fp := fingerprintForm(r.Method, r.URL.EscapedPath(), r.URL.RawQuery, body, form)
	m.claim(w, r, key, fp, bufs)
}

// serveUnkeyed passes a request without a key to the handler and reports
// it, also when the handler panics.
func (m *handler) serveUnkeyed(w http.ResponseWriter, r *http.Request) {
	if m.cfg.observe == nil {
		m.next.ServeHTTP(w, r)
		return
	}
	returned := false
	defer func() {
		if !returned { // panic or runtime.Goexit: report it and let it go on
			m.observe(Event{Request: r, Outcome: OutcomeUnkeyed, Err: ErrHandlerPanicked})
		}
	}()
	m.next.ServeHTTP(w, r)
	returned = true
	m.observe(Event{Request: r, Outcome: OutcomeUnkeyed})
}

// claim claims key and acts on the answer: run the handler, replay, refuse
// or wait.
func (m *handler) claim(w http.ResponseWriter, r *http.Request, key Key, fp Fingerprint, bufs *buffers) {
	cfg := m.cfg
	ctx := r.Context()
	// sent is when the latest claim was sent, by the runtime's clock, on
	// which the lease keeper runs: the lease runs from then, however late
	// the store answers.
	var sent time.Time
	newClaim := func() Claim {
		now := cfg.now()
		sent = now
		if cfg.ownClock {
			sent = time.Now()
		}
		return Claim{Key: key, Fingerprint: fp, Now: now, LeaseExpires: now.Add(cfg.lease), ReportEvictions: cfg.observe != nil}
	}
	c := newClaim()
	res, err := m.claimIn(ctx, bufs, &c, false, "")
	var waited time.Duration
	poll := firstPoll
	takeOvers, reruns := 0, 0
	// evicted lists the records that the claims of attempts the store
	// discarded dropped early: they stay dropped, so whatever answers the
	// request reports them.
	var evicted []Eviction
	for {
		switch {
		case err != nil && ctx.Err() != nil:
			// The client left while the store was being asked: the store
			// did not fail, and no one reads the answer.
			writeProblem(w, ProblemRequestCanceled, http.StatusServiceUnavailable,
				"the request was canceled before it was processed; nothing was stored", cfg.retryAfter)
			m.observe(Event{Request: r, Key: key, Outcome: OutcomeCanceled, Status: http.StatusServiceUnavailable,
				Err: errors.Join(context.Cause(ctx), err), Evictions: evicted})
			return
		case err != nil:
			detail := "the idempotency store could not be reached; the request was not processed"
			switch {
			case errors.Is(err, ErrStoreMisconfigured): // first: waiting does not mend it
				detail = "the idempotency store refuses requests until its configuration is fixed; the request was not processed"
			case errors.Is(err, ErrStoreFull):
				detail = "the idempotency store is full; the request was not processed"
			}
			writeProblem(w, ProblemStoreUnavailable, http.StatusServiceUnavailable, detail, cfg.retryAfter)
			m.observe(Event{Request: r, Key: key, Outcome: OutcomeUnavailable, Status: http.StatusServiceUnavailable, Err: err, Evictions: evicted})
			return
		case res.Claimed:
			if evicted != nil {
				// A new slice: the store's may share an array it keeps.
				res.Evictions = slices.Concat(evicted, res.Evictions)
			}
			if m.run(w, r, key, c, sent, &res, bufs, reruns < MaxReruns) {
				// The store discarded the attempt and asked for another.
				reruns++
				evicted = res.Evictions
				c = newClaim()
				res, err = m.claimIn(ctx, bufs, &c, false, "")
				continue
			}
			return
		case res.Record.Fingerprint != fp:
			m.reject(w, r, key, ProblemFingerprintMismatch, http.StatusUnprocessableEntity,
				"this idempotency key was used for a request with a different method, path, query or body", evicted)
			return
		case !res.Response.IsZero():
			p := res.Response.view()
			if !replayableStatus(p.status) {
				// Damaged, or not a response at all: fail closed rather
				// than crash or replay it as something else.
				err = fmt.Errorf("idemserver: the store returned a response with status %d, which no handler answers", p.status)
				continue
			}
			p.replay(w)
			m.observe(Event{Request: r, Key: key, Outcome: OutcomeReplayed, Status: p.status, Evictions: evicted})
			return
		case !c.Now.Before(res.Record.LeaseExpires) && takeOvers < maxTakeOvers:
			takeOvers++
			c = newClaim()
			res, err = m.claimIn(ctx, bufs, &c, true, res.Record.Token)
			continue
		case waited < cfg.wait && ctx.Err() == nil:
			d := min(poll, cfg.wait-waited)
			if !sleep(ctx, d) {
				break
			}
			waited += d
			poll = min(2*poll, maxPoll)
			c = newClaim()
			res, err = m.claimIn(ctx, bufs, &c, false, "")
			continue
		}
		writeProblem(w, ProblemInProgress, http.StatusConflict,
			"a request with this idempotency key is in progress; retry later", cfg.retryAfter)
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeInProgress, Status: http.StatusConflict, Evictions: evicted})
		return
	}
}

// claimIn claims c.Key in the store, or takes over expiredToken's lease
// if takeOver is set, and sets c.Token to the new lease token. A completed
// record's response comes back packed, whatever the store. The store's
// answer must come within the store timeout (see [WithStoreTimeout]).
func (m *handler) claimIn(ctx context.Context, bufs *buffers, c *Claim, takeOver bool, expiredToken string) (PackedClaimResult, error) {
	call := bufs.storeCall(ctx, m.callDeadline(c.Now))
	res, err := m.claimCall(call, c, takeOver, expiredToken)
	bufs.endCall(call, err == nil && res.Context != nil)
	return res, err
}

func (m *handler) claimCall(ctx context.Context, c *Claim, takeOver bool, expiredToken string) (PackedClaimResult, error) {
	if m.packed != nil {
		// The store makes the token only when it inserts the record, so
		// that a replay costs none.
		res, err := m.packed.ClaimPacked(ctx, PackedClaim{
			Claim: *c, TakeOver: takeOver, ExpiredToken: expiredToken,
			NewToken: m.newToken,
		})
		c.Token = res.Token
		return res, err
	}
	c.Token = m.tokens.next()
	var res PackedClaimResult
	var err error
	if takeOver {
		res.ClaimResult, err = m.store.TakeOver(ctx, *c, expiredToken)
	} else {
		res.ClaimResult, err = m.store.Claim(ctx, *c)
	}
	if err == nil && !res.Claimed && res.Record.Completed() {
		res.Response = PackResponse(res.Record.Response)
		res.Record.Response = nil
	}
	return res, err
}

// run serves a claimed request and stores or releases its outcome. When the
// store asks for the request to run again (see [ErrRetryRequest]) and
// mayRerun is set, it sends nothing, leaves w's header as it found it, and
// reports true.
func (m *handler) run(w http.ResponseWriter, r *http.Request, key Key, c Claim, sent time.Time, claim *PackedClaimResult, bufs *buffers, mayRerun bool) (rerun bool) {
	cfg := m.cfg
	token := c.Token
	if !cfg.now().Before(c.LeaseExpires) {
		// The store's answer came after the lease it granted had ended:
		// another request may take the key over at any moment, so the
		// handler must not start.
		storeCtx := claim.Context
		if storeCtx == nil {
			storeCtx = r.Context()
		}
		call, cancel := context.WithTimeout(context.WithoutCancel(storeCtx), cfg.storeTimeout)
		err := m.store.Release(call, key, token)
		cancel()
		writeProblem(w, ProblemLeaseLost, http.StatusServiceUnavailable,
			"the idempotency store granted the key too late to process the request", cfg.retryAfter)
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeUnavailable, Status: http.StatusServiceUnavailable,
			Err: errors.Join(ErrLeaseLost, err), Evictions: claim.Evictions})
		return false
	}
	// The claim itself may say to hold (see ClaimResult.Hold): a wrapper
	// around the store may hide its ResponseHolder method.
	hold := m.hold || claim.Hold
	x := &claimedRequest{
		body: bodyReader{b: bufs.reqBody},
		rec: recorder{w: w, limit: cfg.maxResponse, allow: cfg.replayHeaders,
			fields: bufs.fields, body: bufs.respBody, hold: hold, http1: r.ProtoMajor < 2},
		lease: leaseKeeper{m: m, key: key, token: token},
	}
	rec, lease := &x.rec, &x.lease
	defer rec.release(bufs)
	if r.Body != nil && r.Body != http.NoBody {
		defer x.body.release()
		r.Body = &x.body
	}
	reqCtx := r.Context()
	storeCtx := claim.Context
	if storeCtx == nil {
		storeCtx = reqCtx
	}
	// The handler's context ends when the request's does, when the lease
	// keeper gives up, or when the handler returns; it carries the claimed
	// key.
	ctx := &x.ctx
	ctx.parent, ctx.key = storeCtx, &lease.key
	defer ctx.end()
	// A request carries its context in an unexported field that only a
	// copy of the request can change, so the handler gets a copy. The
	// copy WithContext makes, inlined, does not escape: copied into x, it
	// costs no allocation of its own.
	x.req = *r.WithContext(ctx)
	r = &x.req
	// The outcome must be recorded even when the client has gone.
	x.detached.parent = storeCtx
	storeCtx = &x.detached
	lease.ctx, lease.hctx = &x.detached, ctx
	lease.start(sent)

	// A response held back by a store that holds responses (and so
	// discards the attempt's work with it) may be dropped for another run.
	again := func(err error) bool {
		if !mayRerun || !hold || rec.streaming || !errors.Is(err, ErrRetryRequest) {
			return false
		}
		rec.resetHeader()
		return true
	}

	returned := false
	defer func() {
		if !returned { // panic or runtime.Goexit: release and let it go on
			leaseEnd, _ := lease.stop()
			err := m.release(storeCtx, bufs, key, token, leaseEnd)
			m.observe(Event{Request: r, Key: key, Outcome: OutcomeReleased, Err: errors.Join(ErrHandlerPanicked, err), Evictions: claim.Evictions})
		}
	}()
	m.next.ServeHTTP(rec, r)
	returned = true
	// No extension may run once the claim is being ended.
	leaseEnd, lost := lease.stop()

	if !rec.wroteHeader && (reqCtx.Err() != nil || ctx.Err() != nil) {
		// The handler gave up on its ended context without answering, so
		// it did not act: storing an implicit 200 would tell every retry
		// that it had.
		cause := context.Cause(reqCtx)
		if cause == nil {
			cause = context.Cause(ctx)
		}
		err := m.release(storeCtx, bufs, key, token, leaseEnd)
		typ, detail := ProblemRequestCanceled, "the request was canceled before it was processed; nothing was stored"
		if errors.Is(cause, ErrLeaseLost) || errors.Is(err, ErrLeaseLost) {
			typ, detail = ProblemLeaseLost, "the request lost its idempotency key before it was processed"
		}
		m.replaceResponse(rec, typ, detail)
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeReleased, Status: http.StatusServiceUnavailable, Err: errors.Join(cause, err), Evictions: claim.Evictions})
		return false
	}
	rec.finish(r.Method == http.MethodHead)

	if rec.releases {
		err := m.release(storeCtx, bufs, key, token, leaseEnd)
		if again(err) {
			return true
		}
		rec.deliver()
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeReleased, Status: rec.status,
			Err: errors.Join(context.Cause(reqCtx), lost, err), Evictions: claim.Evictions})
		return false
	}
	now := cfg.now()
	expires := now.Add(cfg.ttl) // time.Time saturates; a store converting it must clamp
	var resp *Response
	if m.packed == nil {
		resp = rec.response()
	}
	var err error
	for try := 1; ; try++ {
		start := now
		if try > 1 {
			start = cfg.now()
		}
		call := bufs.storeCall(storeCtx, m.callDeadline(start))
		if m.packed != nil {
			err = m.packed.CompletePacked(call, PackedCompletion{
				Key: key, Token: token, Ref: claim.Ref, Response: packedOf(rec.parts()), Now: now, Expires: expires,
			})
		} else {
			err = m.store.Complete(call, key, token, resp, expires)
		}
		bufs.endCall(call, false)
		if !retryEnd(err, try, leaseEnd) {
			break
		}
	}
	if again(err) {
		return true
	}
	switch {
	case !rec.streaming && (errors.Is(err, ErrRolledBack) || errors.Is(err, ErrRetryRequest)):
		m.replaceResponse(rec, ProblemStoreUnavailable,
			"the outcome could not be kept and was rolled back; the request was not processed")
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeUnavailable, Status: http.StatusServiceUnavailable, Err: err, Evictions: claim.Evictions})
	case !rec.streaming && (errors.Is(err, ErrOutcomeUnknown) || hold && err != nil && !errors.Is(err, ErrLeaseLost)):
		// No one can tell yet whether the handler's work was kept: the
		// client must not take its response as the outcome, and the claim
		// is not released; the retry learns from the store. A store that
		// holds responses keeps nothing of the claim unless Complete
		// succeeds, so any failure it does not classify is this case too.
		m.replaceResponse(rec, ProblemStoreUnavailable,
			"whether the outcome was kept is not known; retry the same request to learn it")
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeUnavailable, Status: http.StatusServiceUnavailable, Err: err, Evictions: claim.Evictions})
	case !rec.streaming && errors.Is(err, ErrLeaseLost):
		// Another request took the key over: a retry gets its outcome, so
		// this client must not be told a different one.
		m.replaceResponse(rec, ProblemLeaseLost,
			"the request lost its idempotency key to another request before its outcome was stored")
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeUnavailable, Status: http.StatusServiceUnavailable, Err: errors.Join(lost, err), Evictions: claim.Evictions})
	default:
		// A response that could not be stored still reaches the client;
		// its record stays in progress until the lease lapses, and then a
		// retry runs the handler again.
		rec.deliver()
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeExecuted, Status: rec.status, Err: errors.Join(lost, err), Evictions: claim.Evictions})
	}
	return false
}

// replaceResponse answers 503 with Retry-After and a problem of type typ in
// place of a response the handler wrote, and has not reached the client.
// The fields set in front of the middleware stay; the handler's go.
func (m *handler) replaceResponse(rec *recorder, typ, detail string) {
	rec.resetHeader()
	writeProblem(rec.w, typ, http.StatusServiceUnavailable, detail, m.cfg.retryAfter)
}

// Ending a claim is tried again after a transient failure, after each of
// these waits in turn.
var endRetryDelays = [...]time.Duration{10 * time.Millisecond, 100 * time.Millisecond}

// release releases key's claim, trying again after a transient failure
// while the lease lasts (leaseEnd, by the runtime's clock).
func (m *handler) release(ctx context.Context, bufs *buffers, key Key, token string, leaseEnd time.Time) error {
	for try := 1; ; try++ {
		call := bufs.storeCall(ctx, m.callDeadline(m.cfg.now()))
		err := m.store.Release(call, key, token)
		bufs.endCall(call, false)
		if !retryEnd(err, try, leaseEnd) {
			return err
		}
	}
}

// callDeadline returns the deadline of a store call that starts at now,
// by the middleware's clock: now itself when that clock is the runtime's
// (reading the clock once more costs a replay about a tenth of its time
// here), else the runtime's clock read afresh, since a call's deadline is
// real time.
func (m *handler) callDeadline(now time.Time) time.Time {
	if m.cfg.ownClock {
		now = time.Now()
	}
	return now.Add(m.cfg.storeTimeout)
}

// retryEnd reports whether to try again the Complete or Release that failed
// with err on its try'th attempt, and if so waits first. Only a transient
// failure is tried again, at most len(endRetryDelays) times, and not when
// the wait would pass leaseEnd, after which the key may be taken over.
func retryEnd(err error, try int, leaseEnd time.Time) bool {
	if err == nil || try > len(endRetryDelays) ||
		errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrRolledBack) || errors.Is(err, ErrClosed) ||
		errors.Is(err, ErrOutcomeUnknown) || errors.Is(err, ErrRetryRequest) {
		return false
	}
	d := endRetryDelays[try-1]
	if !time.Now().Add(d).Before(leaseEnd) {
		return false
	}
	time.Sleep(d)
	return true
}

// statusClientClosedRequest is the status that nginx and others log, and
// some handlers write, for a request whose client went away.
const statusClientClosedRequest = 499

// ReleasesStatus reports whether the middleware releases the claim of a
// handler that answered with status, so that a retry runs the handler
// again, rather than storing the response as the key's outcome: a server
// error (500 or more), a refusal that invites the client to send the same
// request again (408, 425, 429), or a note that the client went away
// before it got an answer (499). Every other status is stored, except a
// 409 with Retry-After; see [ReleasesResponse].
func ReleasesStatus(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests, statusClientClosedRequest:
		return true
	}
	return status >= http.StatusInternalServerError
}

// ReleasesResponse reports whether the middleware releases the claim of a
// handler that answered with status and the header fields h (as they were
// when it wrote the status), rather than storing the response: when
// [ReleasesStatus] says so, and for a 409 with a valid Retry-After
// (delta-seconds or an HTTP-date). That is how a
// server that deduplicates requests, as this middleware does, says that
// another request with the key is still in progress. A handler that passes
// it on from such a service behind it, as a gateway does, has no outcome
// yet: stored, it would answer every retry "in progress" long after the
// service finished.
//
// Field names match in any case, as a client reads them: net/http sends a
// field set straight into the map under a name that is not canonical, such
// as "retry-after", as it was set.
func ReleasesResponse(status int, h http.Header) bool {
	if status == http.StatusConflict {
		v := h.Get("Retry-After")
		if v == "" {
			v = nonCanonicalRetryAfter(h)
		}
		// A value that is not delta-seconds or an HTTP-date is one a
		// client ignores (idemhttp's does), so that it takes the 409 for
		// a final conflict; stored, every retry gets that same answer.
		// Validity does not depend on the time: any instant will do.
		_, ok := retryafter.Parse(v, time.Time{})
		return ok
	}
	return ReleasesStatus(status)
}

// nonCanonicalRetryAfter returns the value of a Retry-After field that h
// holds under a name other than the canonical one, or "". Only a 409
// without the canonical field looks, so no other response pays for the
// scan.
func nonCanonicalRetryAfter(h http.Header) string {
	for name, values := range h {
		if len(values) > 0 && values[0] != "" && len(name) == len("Retry-After") && strings.EqualFold(name, "Retry-After") {
			return values[0]
		}
	}
	return ""
}

// reject answers with a problem of type typ and reports it, with the
// records that claims made for the request dropped early, if any.
func (m *handler) reject(w http.ResponseWriter, r *http.Request, key Key, typ string, status int, detail string, evicted []Eviction) {
	writeProblem(w, typ, status, detail, "")
	outcome := OutcomeRejected
	if typ == ProblemFingerprintMismatch {
		outcome = OutcomeMismatch
	}
	m.observe(Event{Request: r, Key: key, Outcome: outcome, Status: status, Evictions: evicted})
}

func (m *handler) observe(e Event) {
	if m.cfg.observe != nil {
		m.cfg.observe(e)
	}
}

// sleep waits for d and reports true, or reports false when ctx ends first.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

var errBodyTooLarge = errors.New("request body too large")

// firstBodyBuffer is the most readBody allocates before any of the body
// has arrived, whatever length the request announces.
const firstBodyBuffer = 4 << 10

// readBody reads body, whose length is contentLength or -1 if unknown, into
// buf, and fails with errBodyTooLarge past max bytes.
//
// The buffer grows with the bytes that arrive rather than with the length
// announced, so that requests that announce a large body and send little
// (slowly, or never) do not pin the memory for it: it starts at buf's
// capacity, or at most firstBodyBuffer, and doubles as it fills, up to one
// byte past the announced length (so that reading the EOF needs no growth)
// and never past max+1.
func readBody(body io.Reader, contentLength, max int64, buf []byte) ([]byte, error) {
	if body == nil || body == http.NoBody {
		return nil, nil
	}
	// max+1 and contentLength+1, here and in growBody, must not overflow
	// for a limit of "no limit" (math.MaxInt64) and a body announced as
	// long as net/http allows (math.MaxInt64 too): no body is that long,
	// so one byte less changes nothing else.
	max = min(max, math.MaxInt64-1)
	if contentLength > max {
		return nil, errBodyTooLarge
	}
	expect := max + 1
	if contentLength >= 0 {
		expect = contentLength + 1
	}
	buf = buf[:0]
	if int64(cap(buf)) < min(expect, firstBodyBuffer) {
		buf = make([]byte, 0, min(expect, firstBodyBuffer))
	}
	for {
		if len(buf) == cap(buf) {
			buf = growBody(buf, expect, max)
		}
		n, err := body.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if int64(len(buf)) > max {
			return nil, errBodyTooLarge
		}
		if err == io.EOF {
			return buf, nil
		}
		if err != nil {
			var tooLarge *http.MaxBytesError
			if errors.As(err, &tooLarge) {
				return nil, errBodyTooLarge
			}
			return nil, err
		}
	}
}

// growBody returns full buf with twice its capacity, but no more than
// expect while the body is shorter than it, and never more than max+1.
func growBody(buf []byte, expect, max int64) []byte {
	size := 2 * int64(cap(buf))
	if int64(len(buf)) < expect {
		size = min(size, expect)
	}
	size = min(size, max+1)
	grown := make([]byte, len(buf), size)
	copy(grown, buf)
	return grown
}

// bodyReader gives the handler the body the middleware read.
type bodyReader struct {
	b []byte
	i int
}

func (r *bodyReader) Read(p []byte) (int, error) {
	if r.i >= len(r.b) {
		return 0, io.EOF
	}
	n := copy(p, r.b[r.i:])
	r.i += n
	return n, nil
}

func (r *bodyReader) Close() error { return nil }

// release lets go of the body, whose buffer is about to be reused: a
// handler that wrongly reads after it returned gets EOF.
func (r *bodyReader) release() { r.b, r.i = nil, 0 }

// tokenSource makes lease tokens: a random prefix, unique to the
// middleware, and a counter.
type tokenSource struct {
	prefix string
	n      atomic.Uint64
}

func newTokenSource() *tokenSource {
	b := make([]byte, 12)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return &tokenSource{prefix: base64.RawURLEncoding.EncodeToString(b) + "."}
}

func (t *tokenSource) next() string {
	var buf [64]byte
	b := append(buf[:0], t.prefix...)
	return string(strconv.AppendUint(b, t.n.Add(1), 36))
}

// claimedRequest is what a claimed request's handler gets: its body,
// ResponseWriter, context and request, and the keeper of its lease, in one
// allocation. It is never reused: the handler may keep any of it after it
// returns. Its size is kept within 760 bytes on 64-bit platforms: with the
// 8-byte header the allocator puts before an object of over 512 bytes
// that holds pointers, it then fits the 768-byte size class, and the next
// is 896.
type claimedRequest struct {
	body     bodyReader
	rec      recorder
	lease    leaseKeeper
	ctx      handlerContext
	detached detachedContext
	req      http.Request
}
