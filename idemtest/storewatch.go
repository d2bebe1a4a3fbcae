package idemtest

import (
	"context"
	"errors"
	"time"

	"github.com/idemhttp/idemhttp/idemserver"
)

// storeWatcher is the store the middleware of a Server is given: it passes
// every call through to the test's store, and tells the ledger what the
// ledger cannot see from in front of the middleware or behind it.
//
// Each claim names the scoped key of its request (in the ledger's note in
// the request's context), so that a replay, which the middleware serves
// without the handler, is checked against the answers given in its own
// scope: a store that replays one tenant's response to another is caught
// although the handler did give that answer, to someone else.
//
// When the test's store holds responses (idemserver.ResponseHolder, or its
// claims say so in idemserver.ClaimResult.Hold), each Complete that
// reports the run's work discarded (idemserver.ErrRolledBack, or
// idemserver.ErrRetryRequest) takes the run back from the ledger. Such a
// store keeps the handler's work and its outcome together or not at all, so
// a run it discarded did not execute, whether the middleware then runs the
// request again or answers 503.
type storeWatcher struct {
	idemserver.Store
	ledger *ledger
}

// watchStore returns store wrapped for the middleware of a Server with l:
// in a storeWatcher, which keeps its PackedStore methods and says whether
// it holds responses as the store does.
func watchStore(store idemserver.Store, l *ledger) idemserver.Store {
	w := storeWatcher{Store: store, ledger: l}
	if packed, ok := store.(idemserver.PackedStore); ok {
		return packedStoreWatcher{w, packed}
	}
	return w
}

// HoldResponses implements idemserver.ResponseHolder: it reports whether
// the store it wraps holds responses.
func (w storeWatcher) HoldResponses() bool { return w.ledger.hold.Load() }

func (w storeWatcher) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	w.ledger.claiming(ctx, c.Key)
	res, err := w.Store.Claim(ctx, c)
	w.claimed(res)
	return res, err
}

func (w storeWatcher) TakeOver(ctx context.Context, c idemserver.Claim, expiredToken string) (idemserver.ClaimResult, error) {
	w.ledger.claiming(ctx, c.Key)
	res, err := w.Store.TakeOver(ctx, c, expiredToken)
	w.claimed(res)
	return res, err
}

// claimed tells the ledger of a claim that says to hold its response,
// before the handler runs: a store wrapped so that it hides
// idemserver.ResponseHolder still says so on its claims.
func (w storeWatcher) claimed(res idemserver.ClaimResult) {
	if res.Claimed && res.Hold {
		w.ledger.hold.Store(true)
	}
}

func (w storeWatcher) Complete(ctx context.Context, key idemserver.Key, token string, resp *idemserver.Response, expires time.Time) error {
	err := w.Store.Complete(ctx, key, token, resp, expires)
	w.completed(ctx, err)
	return err
}

// completed tells the ledger of a Complete that failed with err, under ctx,
// if the store discarded the run's work.
func (w storeWatcher) completed(ctx context.Context, err error) {
	if w.ledger.hold.Load() && (errors.Is(err, idemserver.ErrRolledBack) || errors.Is(err, idemserver.ErrRetryRequest)) {
		w.ledger.discarded(ctx)
	}
}

// packedStoreWatcher is a storeWatcher of a PackedStore.
type packedStoreWatcher struct {
	storeWatcher
	packed idemserver.PackedStore
}

func (w packedStoreWatcher) ClaimPacked(ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error) {
	w.ledger.claiming(ctx, c.Key)
	res, err := w.packed.ClaimPacked(ctx, c)
	w.claimed(res.ClaimResult)
	return res, err
}

func (w packedStoreWatcher) CompletePacked(ctx context.Context, c idemserver.PackedCompletion) error {
	err := w.packed.CompletePacked(ctx, c)
	w.completed(ctx, err)
	return err
}
