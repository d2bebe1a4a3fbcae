package idemserver

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCompleteRetried makes Complete fail a few times: a transient failure
// is tried again, a bounded number of times and not past the lease's end;
// a failure that retrying cannot mend is not. Whatever happens, the
// client gets an answer, and the observer the error.
func TestCompleteRetried(t *testing.T) {
	for _, tt := range []struct {
		name      string
		lease     time.Duration
		failures  int
		err       error
		wantCalls int
		stored    bool
		status    int
	}{
		{name: "fails twice", failures: 2, err: errTransient, wantCalls: 3, stored: true, status: http.StatusCreated},
		{name: "fails for good", failures: 100, err: errTransient, wantCalls: 3, status: http.StatusCreated},
		{name: "lease ends first", lease: 50 * time.Millisecond, failures: 100, err: errTransient, wantCalls: 2, status: http.StatusCreated},
		{name: "lease lost", failures: 100, err: fmt.Errorf("taken: %w", ErrLeaseLost), wantCalls: 1, status: http.StatusServiceUnavailable},
		{name: "rolled back", failures: 100, err: ErrRolledBack, wantCalls: 1, status: http.StatusServiceUnavailable},
		{name: "store closed", failures: 100, err: ErrClosed, wantCalls: 1, status: http.StatusCreated},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := newStubStore()
				calls := 0
				store.complete = func(ctx context.Context, k Key, token string, resp *Response, expires time.Time) error {
					calls++
					assert.NoError(t, ctx.Err(), "Complete's context is not cancelled")
					if calls <= tt.failures {
						return tt.err
					}
					return store.MemoryStore.Complete(ctx, k, token, resp, expires)
				}
				var log eventLog
				h := &countingHandler{}
				ctx, cancel := context.WithCancel(t.Context())
				mw := Middleware(store, WithLease(tt.lease), WithObserver(log.observe))(
					http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						h.ServeHTTP(w, r)
						cancel() // the client goes while the outcome is stored
					}))
				w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b").WithContext(ctx))

				assert.Equal(t, tt.wantCalls, calls, "Complete calls")
				assert.Equal(t, tt.status, w.Code)
				events := log.all()
				require.Len(t, events, 1)
				retry := serve(Middleware(store, WithLease(tt.lease))(h), newRequest(http.MethodPost, "/x", "k", "b"))
				if tt.stored {
					assert.NoError(t, events[0].Err)
					assertReplayed(t, true, retry, h)
					assert.Equal(t, w.Body.String(), retry.Body.String())
					return
				}
				assert.ErrorIs(t, events[0].Err, tt.err)
				if tt.status == http.StatusCreated && tt.err != ErrClosed {
					// The record stays in progress until its lease lapses.
					decodeProblem(t, retry, ProblemInProgress, http.StatusConflict)
				}
			})
		})
	}
}

// TestReleaseRetried makes Release fail twice with a transient error after
// the handler answered 500: the third try releases the claim, so the retry
// runs the handler again rather than waiting for the lease to lapse.
func TestReleaseRetried(t *testing.T) {
	for _, tt := range []struct {
		name    string
		handler func(*countingHandler) http.Handler
	}{
		{"server error", func(h *countingHandler) http.Handler {
			h.status = http.StatusInternalServerError
			return h
		}},
		{"panic", func(h *countingHandler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if h.calls.Add(1) == 1 {
					panic(http.ErrAbortHandler)
				}
			})
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := newStubStore()
				calls := 0
				store.release = func(ctx context.Context, k Key, token string) error {
					calls++
					if calls <= 2 {
						return errTransient
					}
					return store.MemoryStore.Release(ctx, k, token)
				}
				h := &countingHandler{}
				mw := Middleware(store)(tt.handler(h))
				func() {
					defer func() { _ = recover() }()
					serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
				}()
				assert.Equal(t, 3, calls, "Release calls")
				assert.Zero(t, store.Len(), "claim released")
				serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
				assert.EqualValues(t, 2, h.calls.Load(), "the retry ran the handler")
			})
		})
	}
}
