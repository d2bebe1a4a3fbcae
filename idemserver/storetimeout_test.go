package idemserver

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tcpTimeout is how long a call to a store whose connection went silent
// takes when nothing but the operating system bounds it.
const tcpTimeout = 15 * time.Minute

var errConnTimedOut = errors.New("read tcp: connection timed out")

// silent is a store call on a connection that went silent without a
// reset: it answers only when its context ends, or when the operating
// system gives up on the connection.
func silent(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(tcpTimeout):
		return errConnTimedOut
	}
}

// TestStoreTimeoutBoundsCalls has each kind of store call go silent: the
// request must end within a few store timeouts, as a store failure, and
// not when the connection times out. Before the store timeout, ending a
// claim waited on the silent connection.
func TestStoreTimeoutBoundsCalls(t *testing.T) {
	const timeout = 2 * time.Second
	tests := []struct {
		name   string
		status int // the handler's
		stub   func(*stubStore)
		check  func(t *testing.T, w *http.Response, e Event, h *countingHandler)
	}{{
		name: "claim",
		stub: func(s *stubStore) {
			s.claim = func(ctx context.Context, _ Claim) (ClaimResult, error) { return ClaimResult{}, silent(ctx) }
		},
		check: func(t *testing.T, w *http.Response, e Event, h *countingHandler) {
			assert.Equal(t, http.StatusServiceUnavailable, w.StatusCode)
			assert.Equal(t, OutcomeUnavailable, e.Outcome)
			assert.Zero(t, h.calls.Load(), "the handler did not run")
		},
	}, {
		name: "complete",
		stub: func(s *stubStore) {
			s.complete = func(ctx context.Context, _ Key, _ string, _ *Response, _ time.Time) error { return silent(ctx) }
		},
		check: func(t *testing.T, w *http.Response, e Event, h *countingHandler) {
			// Not stored: the response still reaches the client.
			assert.Equal(t, http.StatusCreated, w.StatusCode)
			assert.Equal(t, OutcomeExecuted, e.Outcome)
		},
	}, {
		name:   "release",
		status: http.StatusBadGateway,
		stub: func(s *stubStore) {
			s.release = func(ctx context.Context, _ Key, _ string) error { return silent(ctx) }
		},
		check: func(t *testing.T, w *http.Response, e Event, h *countingHandler) {
			assert.Equal(t, http.StatusBadGateway, w.StatusCode)
			assert.Equal(t, OutcomeReleased, e.Outcome)
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := newStubStore()
				defer store.MemoryStore.Close()
				tt.stub(store)
				var log eventLog
				h := &countingHandler{status: tt.status}
				mw := Middleware(store, WithStoreTimeout(timeout), WithObserver(log.observe))(h)
				start := time.Now()
				w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
				took := time.Since(start)
				// A first try and two more, each bounded, and the waits
				// between them.
				assert.LessOrEqual(t, took, 3*timeout+time.Second)
				events := log.all()
				require.Len(t, events, 1)
				assert.ErrorIs(t, events[0].Err, context.DeadlineExceeded)
				tt.check(t, w.Result(), events[0], h)
			})
		})
	}
}

// TestStoreTimeoutCompleteLanded has a Complete stored whose answer never
// comes back: the Complete sent again must be answered as the first was,
// so that the client gets the response its retry replays, and the handler
// runs once. The MemoryStore once refused the completion sent again, and
// the client was told that its request had lost its key.
func TestStoreTimeoutCompleteLanded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := newStubStore()
		defer store.MemoryStore.Close()
		var completes atomic.Int32
		store.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
			if err := store.MemoryStore.Complete(ctx, k, token, resp, exp); err != nil || completes.Add(1) > 1 {
				return err
			}
			return silent(ctx) // stored; the answer is lost
		}
		var log eventLog
		h := &countingHandler{}
		mw := Middleware(store, WithStoreTimeout(time.Second), WithObserver(log.observe))(h)
		first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		assert.Equal(t, http.StatusCreated, first.Code)
		assert.Equal(t, "call 1", first.Body.String())
		assert.EqualValues(t, 2, completes.Load(), "the Complete was sent again")
		events := log.all()
		require.Len(t, events, 1)
		assert.Equal(t, OutcomeExecuted, events[0].Outcome)
		assert.NoError(t, events[0].Err)

		store.complete = nil
		retry := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		assert.Equal(t, http.StatusCreated, retry.Code)
		assert.Equal(t, "call 1", retry.Body.String())
		assertReplayed(t, true, retry, h)
	})
}

// TestStoreTimeoutExtend has every extension of the lease go silent: the
// handler's context must be cancelled with ErrLeaseLost before the lease
// ends, when another request may take the key over, and the renewal must
// not outlive the request.
func TestStoreTimeoutExtend(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := newStubStore()
		defer store.MemoryStore.Close()
		store.extend = func(ctx context.Context, _ Key, _ string, _ time.Time) error { return silent(ctx) }
		const lease = 30 * time.Second
		var cause error
		var ended time.Duration
		mw := Middleware(store, WithLease(lease), WithStoreTimeout(2*time.Second))(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				start := time.Now()
				<-r.Context().Done()
				ended = time.Since(start)
				cause = context.Cause(r.Context())
			}))
		w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		decodeProblem(t, w, ProblemLeaseLost, http.StatusServiceUnavailable)
		assert.ErrorIs(t, cause, ErrLeaseLost)
		assert.Less(t, ended, lease, "cancelled before the lease ended")
	})
}

// TestClaimCanceledByClient has the client leave while its claim waits on
// the store: the observer is told the request was canceled, not that the
// store failed.
func TestClaimCanceledByClient(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := newStubStore()
		defer store.MemoryStore.Close()
		ctx, cancel := context.WithCancelCause(t.Context())
		store.claim = func(ctx context.Context, _ Claim) (ClaimResult, error) {
			cancel(errClientGone)
			return ClaimResult{}, silent(ctx)
		}
		var log eventLog
		h := &countingHandler{}
		mw := Middleware(store, WithObserver(log.observe))(h)
		w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b").WithContext(ctx))
		decodeProblem(t, w, ProblemRequestCanceled, http.StatusServiceUnavailable)
		events := log.all()
		require.Len(t, events, 1)
		assert.Equal(t, OutcomeCanceled, events[0].Outcome)
		assert.ErrorIs(t, events[0].Err, errClientGone)
		assert.Zero(t, h.calls.Load())
	})
}

// TestStoreContextOutlivesClaimTimeout has a store that watches the claim's
// context hand the handler a context derived from it: the claim's bound
// must not end the handler's context, however long the handler runs.
func TestStoreContextOutlivesClaimTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		type txKey struct{}
		store := newStubStore()
		defer store.MemoryStore.Close()
		store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
			_ = ctx.Done() // as a database driver does
			res, err := store.MemoryStore.Claim(ctx, c)
			res.Context = context.WithValue(ctx, txKey{}, "tx")
			return res, err
		}
		var err error
		var value any
		mw := Middleware(store, WithStoreTimeout(time.Second))(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				time.Sleep(10 * time.Second)
				err, value = r.Context().Err(), r.Context().Value(txKey{})
				w.WriteHeader(http.StatusCreated)
			}))
		w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		assert.Equal(t, http.StatusCreated, w.Code)
		assert.NoError(t, err)
		assert.Equal(t, "tx", value)
	})
}
