package idemserver

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"io"
	"maps"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"
)

// Middleware returns net/http middleware that runs each keyed request's
// handler at most once per key and replays the outcome to every retry. A nil
// store means a new [MemoryStore] with its default limits.
//
// For a request whose method is keyed (POST and PATCH unless [WithMethods]
// says otherwise) and that carries a key, the middleware reads the body (up
// to [WithMaxBodyBytes]; 413 beyond it), restores it for the handler, and
// claims the key in the store with the request's fingerprint:
//
//   - Claimed: the handler runs. Its response is held back (see
//     [WithMaxResponseBytes] and Flush below), and a status below 500 is
//     stored for [WithTTL] before the client gets it. A status of 500 or
//     more, or a panic, releases the claim instead, so a retry runs the
//     handler again; the panic continues after the release. So do 408,
//     425 and 429, the statuses below 500 that say the request was not
//     processed and should be sent again: storing them would answer every
//     retry with the same refusal.
//   - Completed with the same fingerprint: the stored status, header fields
//     and body are replayed with Idempotent-Replayed: true, and the handler
//     does not run.
//   - In progress with the same fingerprint: 409 with Retry-After, or with
//     [WithWaitInFlight] a wait for the outcome and its replay. A claim
//     whose lease ([WithLease]) has expired is taken over and the handler
//     runs again.
//   - A different fingerprint: 422, whatever the record's state.
//   - The store fails: 503 with Retry-After, and the handler does not run,
//     since running it without a claim could run it twice.
//
// A request whose method is not keyed goes straight to the handler, and so
// does one without a key unless [RequireKey] is set. A malformed key is
// refused with 400. Every response the middleware writes itself is a
// problem+json document; see [ProblemInProgress] and the other Problem
// constants.
//
// A handler that flushes ([http.Flusher] or [http.ResponseController])
// lets its response through at once, to stream it; it is still stored when
// the handler returns, but the client may see it before that. A store that
// implements [ResponseHolder] turns this off: then nothing reaches the
// client before Complete returns. Hijacking the connection of a keyed
// request is refused with an error wrapping [http.ErrNotSupported]. When
// the store fails to keep a response the handler produced, the client still
// gets the response and the observer (see [WithObserver]) gets the error;
// the record stays in progress until its lease expires. Only when a
// transactional store reports [ErrRolledBack] or [ErrOutcomeUnknown] is the
// response replaced by 503, since nothing the handler did was kept, or may
// not have been; and when it reports [ErrRetryRequest] the request runs
// again from the claim on, up to [MaxReruns] times.
func Middleware(store Store, opts ...Option) func(http.Handler) http.Handler {
	if store == nil {
		store = NewMemoryStore()
	}
	cfg := newConfig(opts)
	tokens := newTokenSource()
	// A MemoryStore is asked directly, for responses in packed form: the
	// recorder's fields and body go into the store without first becoming
	// a Response, and a replay is written from the stored string.
	mem, _ := store.(*MemoryStore)
	holder, ok := store.(ResponseHolder)
	hold := ok && holder.HoldResponses()
	return func(next http.Handler) http.Handler {
		return &handler{next: next, store: store, mem: mem, hold: hold, cfg: cfg, tokens: tokens}
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
	// its outcome was rolled back (503).
	OutcomeUnavailable
	// OutcomeExecuted: the handler ran and its response was stored.
	OutcomeExecuted
	// OutcomeReleased: the handler ran, answered 5xx (or 408, 425 or
	// 429) or panicked, and the
	// claim was released.
	OutcomeReleased
	// OutcomeReplayed: a stored response was replayed.
	OutcomeReplayed
	// OutcomeInProgress: the key was in progress (409).
	OutcomeInProgress
	// OutcomeMismatch: the key belongs to a different request (422).
	OutcomeMismatch
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
	// For a handler that panicked it wraps [ErrHandlerPanicked].
	Err error
}

// ErrHandlerPanicked is reported to the observer, in [Event.Err], when a
// handler panicked and its claim was released.
var ErrHandlerPanicked = errors.New("idemserver: handler panicked")

// Wait-in-flight polling intervals, and how many expired leases one
// request tries to take over before it treats the key as in progress.
const (
	maxTakeOvers = 4
	firstPoll    = 5 * time.Millisecond
	maxPoll      = 250 * time.Millisecond
)

type handler struct {
	next   http.Handler
	store  Store
	mem    *MemoryStore // store, if it is a MemoryStore
	hold   bool         // hold every response until Complete returns; see ResponseHolder
	cfg    *config
	tokens *tokenSource
}

func (m *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	cfg := m.cfg
	if !cfg.methods[r.Method] {
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
		m.next.ServeHTTP(w, r)
		m.observe(Event{Request: r, Outcome: OutcomeUnkeyed})
		return
	}
	if len(values) > 1 {
		m.reject(w, r, Key{}, ProblemMalformedKey, http.StatusBadRequest, "more than one "+cfg.header+" header")
		return
	}
	raw, err := ParseKey(values[0])
	if err != nil {
		m.reject(w, r, Key{}, ProblemMalformedKey, http.StatusBadRequest, err.Error())
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
			"a keyed request body may be at most "+strconv.FormatInt(cfg.maxBody, 10)+" bytes")
		return
	case err != nil:
		m.reject(w, r, key, ProblemBodyUnreadable, http.StatusBadRequest, err.Error())
		return
	}
	if body != nil {
		bufs.reqBody = body
	}
	fp := fingerprint(r.Method, r.URL.EscapedPath(), r.URL.RawQuery, body)
	m.claim(w, r, key, fp, bufs)
}

// claim claims key and acts on the answer: run the handler, replay, refuse
// or wait.
func (m *handler) claim(w http.ResponseWriter, r *http.Request, key Key, fp Fingerprint, bufs *buffers) {
	cfg := m.cfg
	ctx := r.Context()
	newClaim := func() Claim {
		now := cfg.now()
		return Claim{Key: key, Fingerprint: fp, Now: now, LeaseExpires: now.Add(cfg.lease)}
	}
	c := newClaim()
	res, stored, ref, err := m.claimIn(ctx, &c, false, "")
	var waited time.Duration
	poll := firstPoll
	takeOvers, reruns := 0, 0
	for {
		switch {
		case err != nil:
			writeProblem(w, ProblemStoreUnavailable, http.StatusServiceUnavailable,
				"the idempotency store could not be reached; the request was not processed", cfg.retryAfter)
			m.observe(Event{Request: r, Key: key, Outcome: OutcomeUnavailable, Status: http.StatusServiceUnavailable, Err: err})
			return
		case res.Claimed:
			if m.run(w, r, key, c.Token, ref, res.Context, bufs, reruns < MaxReruns) {
				// The store discarded the attempt and asked for another.
				reruns++
				c = newClaim()
				res, stored, ref, err = m.claimIn(ctx, &c, false, "")
				continue
			}
			return
		case res.Record.Fingerprint != fp:
			m.reject(w, r, key, ProblemFingerprintMismatch, http.StatusUnprocessableEntity,
				"this idempotency key was used for a request with a different method, path, query or body")
			return
		case stored != "":
			p := unpack(stored)
			p.replay(w)
			m.observe(Event{Request: r, Key: key, Outcome: OutcomeReplayed, Status: p.status})
			return
		case !c.Now.Before(res.Record.LeaseExpires) && takeOvers < maxTakeOvers:
			takeOvers++
			c = newClaim()
			res, stored, ref, err = m.claimIn(ctx, &c, true, res.Record.Token)
			continue
		case waited < cfg.wait && ctx.Err() == nil:
			d := min(poll, cfg.wait-waited)
			if !sleep(ctx, d) {
				break
			}
			waited += d
			poll = min(2*poll, maxPoll)
			c = newClaim()
			res, stored, ref, err = m.claimIn(ctx, &c, false, "")
			continue
		}
		writeProblem(w, ProblemInProgress, http.StatusConflict,
			"a request with this idempotency key is in progress; retry later", cfg.retryAfter)
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeInProgress, Status: http.StatusConflict})
		return
	}
}

// claimIn claims c.Key in the store, or takes over expiredToken's lease
// if takeOver is set, and sets c.Token to the new lease token. A completed
// record's response comes back packed, as stored, which is empty for any
// other answer; ref locates the record of a successful claim in a
// MemoryStore.
func (m *handler) claimIn(ctx context.Context, c *Claim, takeOver bool, expiredToken string) (res ClaimResult, stored string, ref memRef, err error) {
	if m.mem != nil {
		// The MemoryStore makes the token only when it inserts the record,
		// so that a replay costs none.
		res, stored, ref, err = m.mem.claimPacked(ctx, *c, takeOver, expiredToken, m.tokens)
		c.Token = ref.token
		return res, stored, ref, err
	}
	c.Token = m.tokens.next()
	if takeOver {
		res, err = m.store.TakeOver(ctx, *c, expiredToken)
	} else {
		res, err = m.store.Claim(ctx, *c)
	}
	if err == nil && !res.Claimed && res.Record.Completed() {
		stored = packResponse(res.Record.Response)
	}
	return res, stored, memRef{}, err
}

// run serves a claimed request and stores or releases its outcome. When the
// store asks for the request to run again (see [ErrRetryRequest]) and
// mayRerun is set, it sends nothing, leaves w's header as it found it, and
// reports true.
func (m *handler) run(w http.ResponseWriter, r *http.Request, key Key, token string, ref memRef, storeCtx context.Context, bufs *buffers, mayRerun bool) (rerun bool) {
	// The handler's body and ResponseWriter, in one allocation.
	x := &struct {
		body bodyReader
		rec  recorder
	}{
		body: bodyReader{b: bufs.reqBody},
		rec: recorder{w: w, limit: m.cfg.maxResponse, allow: m.cfg.replayHeaders,
			fields: bufs.fields, body: bufs.respBody, hold: m.hold},
	}
	rec := &x.rec
	defer rec.release(bufs)
	if r.Body != nil && r.Body != http.NoBody {
		defer x.body.release()
		r.Body = &x.body
	}
	if storeCtx != nil {
		r = r.WithContext(storeCtx)
	} else {
		storeCtx = r.Context()
	}
	// The outcome must be recorded even when the client has gone.
	storeCtx = context.WithoutCancel(storeCtx)
	// A held response may be discarded, for a rerun or a 503: keep the
	// fields set before the handler ran, to start again from them.
	var outer http.Header
	if m.hold {
		outer = w.Header().Clone()
	}
	restore := func() {
		h := w.Header()
		clear(h)
		maps.Copy(h, outer)
	}
	again := func(err error) bool {
		if !mayRerun || outer == nil || rec.streaming || !errors.Is(err, ErrRetryRequest) {
			return false
		}
		restore()
		return true
	}
	returned := false
	defer func() {
		if !returned { // panic or runtime.Goexit: release and let it go on
			err := m.store.Release(storeCtx, key, token)
			m.observe(Event{Request: r, Key: key, Outcome: OutcomeReleased, Err: errors.Join(ErrHandlerPanicked, err)})
		}
	}()
	m.next.ServeHTTP(rec, r)
	returned = true
	rec.finish()

	if released(rec.status) {
		err := m.store.Release(storeCtx, key, token)
		if again(err) {
			return true
		}
		rec.deliver()
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeReleased, Status: rec.status, Err: err})
		return false
	}
	expires := m.cfg.now().Add(m.cfg.ttl)
	var err error
	if m.mem != nil {
		err = m.mem.completePacked(ref, key, token, rec.parts(), expires)
	} else {
		err = m.store.Complete(storeCtx, key, token, rec.response(), expires)
	}
	if again(err) {
		return true
	}
	if (errors.Is(err, ErrRolledBack) || errors.Is(err, ErrOutcomeUnknown) || errors.Is(err, ErrRetryRequest)) && !rec.streaming {
		// Nothing the handler did was kept, or no one can tell yet: the
		// client must not take the handler's response as the outcome.
		// The claim is not released; the retry learns from the store.
		restore()
		detail := "the outcome could not be kept and was rolled back; the request was not processed"
		if errors.Is(err, ErrOutcomeUnknown) {
			detail = "whether the outcome was kept is not known; retry the same request to learn it"
		}
		writeProblem(w, ProblemStoreUnavailable, http.StatusServiceUnavailable, detail, m.cfg.retryAfter)
		m.observe(Event{Request: r, Key: key, Outcome: OutcomeUnavailable, Status: http.StatusServiceUnavailable, Err: err})
		return false
	}
	rec.deliver()
	m.observe(Event{Request: r, Key: key, Outcome: OutcomeExecuted, Status: rec.status, Err: err})
	return false
}

// released reports whether a response with status ends its claim with a
// release rather than being stored: a server error, or a refusal that
// invites the client to send the same request again.
func released(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests:
		return true
	}
	return status >= http.StatusInternalServerError
}

func (m *handler) reject(w http.ResponseWriter, r *http.Request, key Key, typ string, status int, detail string) {
	writeProblem(w, typ, status, detail, "")
	outcome := OutcomeRejected
	if typ == ProblemFingerprintMismatch {
		outcome = OutcomeMismatch
	}
	m.observe(Event{Request: r, Key: key, Outcome: outcome, Status: status})
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

// readBody reads body, whose length is contentLength or -1 if unknown, into
// buf, which it grows as needed, and fails with errBodyTooLarge past max
// bytes.
func readBody(body io.Reader, contentLength, max int64, buf []byte) ([]byte, error) {
	if body == nil || body == http.NoBody {
		return nil, nil
	}
	if contentLength > max {
		return nil, errBodyTooLarge
	}
	size := contentLength
	if size < 0 {
		size = 512
	}
	// One byte more than expected, so that reading the EOF needs no growth.
	if int64(cap(buf)) < size+1 {
		buf = make([]byte, 0, size+1)
	}
	buf = buf[:0]
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
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
