package idemhttp

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
)

// The fates of a held key, as the response that holds it decides them.
const (
	heldUndecided int32 = iota // the body is not yet read to its end or closed
	heldDelivered              // the final outcome reached the caller: Settle may release
	heldKept                   // a read of the body failed, or a Close interrupted one
	heldNotFinal               // the response is not the operation's final outcome
)

// heldKey is the pending key of an operation made with [HoldKey], as the
// response of one of its calls holds it for [Settle]. It rides in the
// context of the response's Request, where http.Client leaves it, as the
// link of a redirect does (see linkRedirect).
type heldKey struct {
	owner          *Transport // whose KeyStore holds key
	operation, key string
	status         int
	fate           atomic.Int32 // one of the held constants
	// shared: another call of the operation sent the key in the gap
	// before the redirect this call followed (see flights), and the key
	// is that call's to release: Settle releases nothing.
	shared bool
	// superseded, for a shared outcome, lists the outcomes of the other
	// calls that its request superseded, given back once it is delivered
	// (see flights.restore).
	superseded []*heldKey

	mu      sync.Mutex // serializes Settles of this response
	settled bool       // a Settle released the key
}

// heldKeyCtx is the context key of a *heldKey.
type heldKeyCtx struct{}

// holdKey attaches to resp the operation's key, which the call leaves
// pending for [Settle]. final says whether resp is the operation's final
// outcome; if so, it is delivered once its body has been read to its end
// or closed (see decide), and at once if it has none.
func (c *call) holdKey(resp *http.Response, final bool) *heldKey {
	h := &heldKey{owner: c.keyOwner(), operation: c.operation, key: c.opKey, status: resp.StatusCode, shared: c.shared, superseded: c.superseded}
	switch {
	case !final:
		h.fate.Store(heldNotFinal)
	case !c.shared:
		h.owner.flights.hold(c.operation, h)
	}
	r := resp.Request // set by attempt if the base transport did not
	resp.Request = r.WithContext(context.WithValue(r.Context(), heldKeyCtx{}, h))
	return h
}

// decide records what became of the final response's body: delivered if
// it was read to its end or closed with no read failed or in progress.
// The first decision stands.
func (h *heldKey) decide(delivered bool) {
	fate := heldKept
	if delivered {
		fate = heldDelivered
	}
	if h.fate.CompareAndSwap(heldUndecided, fate) && delivered && len(h.superseded) > 0 {
		// The caller of this shared outcome holds the flight still.
		h.owner.flights.restore(h.operation, h.superseded)
	}
}

// Settle releases the idempotency key of the operation whose call returned
// resp, a call made with [HoldKey] (see [WithOperation]). Call it once the
// program has kept what the response told it, so that a crash before then
// leaves the key pending and the next call of the operation gets the
// server's replay instead of acting again.
//
// Settle releases the key only if the Transport would have released it
// without HoldKey: resp is the operation's final outcome (for a redirect
// that [http.Client] followed, the response of the last request of the
// chain), and its body has been read to its end, or closed with no read
// failed or in progress. Otherwise it releases nothing and returns an
// error that wraps [ErrNotFinal]: read the body to its end or close it
// first, or, for an outcome that is not final, call the operation again.
//
// A call of the operation started since the call that returned resp (in
// this process, among the Transports whose calls of the operation are kept
// apart; see [WithOperation]) supersedes resp: it sent the key again, and
// its caller, whose outcome need not be final, may need the key still. So
// does a call that ended with nothing sent (its context ended first, or
// the rate limiter or the breaker refused it): its caller may have sent
// the key in an earlier call whose outcome it never learnt. Settle of a
// superseded response returns nil and releases nothing; the
// later call's outcome, or its Settle, releases the key by these same
// rules. The same holds for the response to the request that follows a
// redirect after another call of the operation ran in between (see
// WithOperation): its outcome is final for its caller, but the key is the
// other call's, and once the body has been read to its end or closed,
// Settle returns nil and releases nothing. That request superseded the
// other call's outcome while its own might not reach its caller; once it
// has, the other call's Settle releases the key again.
//
// A response of a call made without HoldKey, without an operation, or
// through a RoundTripper other than a [Transport] holds no key for
// Settle: the error wraps [ErrNotHeld].
//
// The key is released in the [KeyStore] of the Transport that holds it,
// with [KeyStore.Release], which forgets only that key: a Settle that
// comes after the operation has been started anew under another key
// leaves the new key alone. Settle takes the operation's flight while it
// releases, so it never releases a key that another call is sending: if a
// call of the operation is in flight, it fails with an error that wraps
// [ErrOperationInFlight], and the key stays pending; settle again once
// that call is through. The KeyStore's error, if any, is returned, and the
// key stays pending. A Settle whose ctx has ended releases nothing and
// returns ctx's error; once the release has begun, Settle waits for it to
// finish even if ctx ends, as the Transport's own releases do, so that an
// error always means the key is still pending. Once a Settle of resp has released the key, later
// ones return nil and do nothing. Settle is safe for concurrent use.
func Settle(ctx context.Context, resp *http.Response) error {
	var h *heldKey
	if resp != nil && resp.Request != nil {
		h, _ = resp.Request.Context().Value(heldKeyCtx{}).(*heldKey)
	}
	if h == nil {
		return fmt.Errorf("%w: not a response of an operation made with HoldKey through a Transport", ErrNotHeld)
	}
	return h.settle(ctx)
}

func (h *heldKey) settle(ctx context.Context) error {
	switch h.fate.Load() {
	case heldDelivered:
	case heldUndecided:
		return fmt.Errorf("%w: %q: the response body is not yet read to its end or closed", ErrNotFinal, h.operation)
	case heldKept:
		return fmt.Errorf("%w: %q: reading the response body failed", ErrNotFinal, h.operation)
	default:
		return fmt.Errorf("%w: %q: a %d is not the operation's final outcome", ErrNotFinal, h.operation, h.status)
	}
	if h.shared {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.settled {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("idemhttp: settling %q: %w", h.operation, err)
	}
	f := h.owner.flights
	superseded, err := f.settle(h.operation, h)
	if err != nil {
		return err
	}
	defer f.end(h.operation)
	if superseded {
		// The key is the later call's to release, or already released.
		h.settled = true
		return nil
	}
	// Once begun, the release is waited for even if ctx ends: a store may
	// forget the key at once and make that durable later (a FileKeyStore
	// does), and an error returned meanwhile would say the key is pending
	// while the next call of the operation takes a new one.
	if err := h.owner.cfg.keyStore.Release(context.WithoutCancel(ctx), h.operation, h.key); err != nil {
		f.hold(h.operation, h) // to be settled again
		return fmt.Errorf("idemhttp: settling %q: %w", h.operation, err)
	}
	h.settled = true
	return nil
}
