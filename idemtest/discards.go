package idemtest

import (
	"context"
	"errors"
	"time"

	"github.com/idemhttp/idemhttp/idemserver"
)

// discardWatcher is the store the middleware of a Server is given when the
// test's store holds responses (idemserver.ResponseHolder): it passes every
// call through, and tells the ledger of each Complete that reports the
// run's work discarded (idemserver.ErrRolledBack, or
// idemserver.ErrRetryRequest), so that the run is not counted. Such a
// store keeps the handler's work and its outcome together or not at all,
// so a run it discarded did not execute, whether the middleware then runs
// the request again or answers 503.
type discardWatcher struct {
	idemserver.Store
	ledger *ledger
}

// watchDiscards returns store as the middleware of a Server with l is to
// see it: wrapped in a discardWatcher, which keeps its PackedStore
// methods, if it holds responses, or as it is.
func watchDiscards(store idemserver.Store, l *ledger) idemserver.Store {
	if !l.hold {
		return store
	}
	w := discardWatcher{Store: store, ledger: l}
	if packed, ok := store.(idemserver.PackedStore); ok {
		return packedDiscardWatcher{w, packed}
	}
	return w
}

// HoldResponses implements idemserver.ResponseHolder: the store it wraps
// holds responses.
func (discardWatcher) HoldResponses() bool { return true }

func (w discardWatcher) Complete(ctx context.Context, key idemserver.Key, token string, resp *idemserver.Response, expires time.Time) error {
	err := w.Store.Complete(ctx, key, token, resp, expires)
	w.completed(ctx, err)
	return err
}

// completed tells the ledger of a Complete that failed with err, under ctx,
// if the store discarded the run's work.
func (w discardWatcher) completed(ctx context.Context, err error) {
	if errors.Is(err, idemserver.ErrRolledBack) || errors.Is(err, idemserver.ErrRetryRequest) {
		w.ledger.discarded(ctx)
	}
}

// packedDiscardWatcher is a discardWatcher of a PackedStore.
type packedDiscardWatcher struct {
	discardWatcher
	packed idemserver.PackedStore
}

func (w packedDiscardWatcher) ClaimPacked(ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error) {
	return w.packed.ClaimPacked(ctx, c)
}

func (w packedDiscardWatcher) CompletePacked(ctx context.Context, c idemserver.PackedCompletion) error {
	err := w.packed.CompletePacked(ctx, c)
	w.completed(ctx, err)
	return err
}
