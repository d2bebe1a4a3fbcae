package idemserver

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// watchLate is how a store commonly watches a call's context while it
// waits on a connection: a goroutine that selects on ctx.Done() and on the
// call's end. The goroutine may not run before the call returns, so its
// Done, Err, Deadline and Value may come after it, when the middleware
// has used the call's context for another call. It must find that context
// whole, never one being made ready for the next call.
func watchLate(wg *sync.WaitGroup, ctx context.Context) (finished func()) {
	end := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		select {
		case <-ctx.Done():
		case <-end:
		}
		_, _ = ctx.Deadline()
		_ = ctx.Err()
		_ = ctx.Value(unsetContextKey{})
	}()
	return func() { close(end) }
}

// unsetContextKey is a context key that no one sets.
type unsetContextKey struct{}

// TestStoreCallContextWatchedLate has a store watch the context of each of
// its calls from a goroutine that may outlive the call, while many
// requests run at once with a store timeout short enough to end some
// calls. Under the race detector it fails if a call's context is made
// ready for another call while such a goroutine reads it; in any build, if
// a request's outcome is not the one its handler gave.
func TestStoreCallContextWatchedLate(t *testing.T) {
	var wg sync.WaitGroup
	defer wg.Wait()
	store := newStubStore()
	defer store.MemoryStore.Close()
	store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
		defer watchLate(&wg, ctx)()
		return store.MemoryStore.Claim(ctx, c)
	}
	store.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
		defer watchLate(&wg, ctx)()
		return store.MemoryStore.Complete(ctx, k, token, resp, exp)
	}
	h := &countingHandler{}
	mw := Middleware(store, WithStoreTimeout(time.Millisecond))(h)
	const workers, requests = 4, 100
	var failed sync.Map
	concurrentlyN(workers, func(w int) {
		for i := range requests {
			key := fmt.Sprintf("k%d-%d", w, i)
			resp := serve(mw, newRequest(http.MethodPost, "/x", key, "b"))
			if resp.Code != http.StatusCreated && resp.Code != http.StatusServiceUnavailable {
				failed.Store(key, resp.Code)
			}
		}
	})
	failed.Range(func(k, v any) bool {
		t.Errorf("%v: status %v", k, v)
		return true
	})
	require.LessOrEqual(t, h.calls.Load(), int64(workers*requests))
	assert.Positive(t, h.calls.Load())
}

func concurrentlyN(n int, f func(i int)) {
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f(i)
		}()
	}
	wg.Wait()
}

// TestStoreCallContextAfterStorePanic has a store watch a claim's context
// and then panic, so that the call never ends normally. Its context, whose
// timer still runs, must not be used for a later call: that call would end
// at the panicked call's deadline, and a Complete ended early is a
// response that may go unstored, and run again.
func TestStoreCallContextAfterStorePanic(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := newStubStore()
		defer store.MemoryStore.Close()
		panicking := false
		var errs []error
		store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
			if panicking {
				_ = ctx.Done() // watched, as a store waiting on a connection does
				panic("store bug")
			}
			time.Sleep(600 * time.Millisecond) // past the panicked call's deadline, within its own
			errs = append(errs, ctx.Err())
			return store.MemoryStore.Claim(ctx, c)
		}
		h := &countingHandler{}
		mw := Middleware(store, WithStoreTimeout(time.Second))(h)
		for i := range 20 {
			panicking = true
			func() {
				defer func() { _ = recover() }()
				serve(mw, newRequest(http.MethodPost, "/x", fmt.Sprintf("p%d", i), "b"))
			}()
			time.Sleep(500 * time.Millisecond)
			panicking = false
			w := serve(mw, newRequest(http.MethodPost, "/x", fmt.Sprintf("k%d", i), "b"))
			assert.Equal(t, http.StatusCreated, w.Code)
		}
		for i, err := range errs {
			assert.NoError(t, err, "claim %d", i)
		}
	})
}
