package idemserver

import (
	"context"
	"errors"
	"io"
	"net/http"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var errClientGone = errors.New("client timed out")

// TestClientGoneIsNotStored sends a request whose client gives up after a
// second, while the handler is still working, and then retries it. A
// handler that gave up too, without answering, did not act, so its claim is
// released and the retry runs it; one that finished its response anyway
// has its response stored and replayed.
func TestClientGoneIsNotStored(t *testing.T) {
	for _, tt := range []struct {
		name string
		// gaveUp is what the handler does when its context ends.
		gaveUp     func(w http.ResponseWriter)
		wantStatus int    // the first response's status
		wantType   string // its problem type, for a problem
		stored     bool
	}{
		{
			name:       "returns without writing",
			gaveUp:     func(http.ResponseWriter) {},
			wantStatus: http.StatusServiceUnavailable, wantType: ProblemRequestCanceled,
		},
		{
			name:       "sets header fields and returns without writing",
			gaveUp:     func(w http.ResponseWriter) { w.Header().Set("X-Partial", "yes") },
			wantStatus: http.StatusServiceUnavailable, wantType: ProblemRequestCanceled,
		},
		{
			name:       "answers 499",
			gaveUp:     func(w http.ResponseWriter) { w.WriteHeader(499) },
			wantStatus: 499,
		},
		{
			name: "finishes its response",
			gaveUp: func(w http.ResponseWriter) {
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, "charged")
			},
			wantStatus: http.StatusCreated,
			stored:     true,
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := NewMemoryStore()
				var events []Event
				h := &countingHandler{}
				mw := Middleware(store, WithObserver(func(e Event) { events = append(events, e) }))(
					http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						select {
						case <-r.Context().Done():
							h.calls.Add(1)
							tt.gaveUp(w)
						case <-time.After(5 * time.Second):
							h.ServeHTTP(w, r)
						}
					}))

				ctx, cancel := context.WithTimeoutCause(t.Context(), time.Second, errClientGone)
				defer cancel()
				first := serve(mw, newRequest(http.MethodPost, "/charges", "k", "b").WithContext(ctx))
				require.Len(t, events, 1)
				if tt.wantType != "" {
					decodeProblem(t, first, tt.wantType, tt.wantStatus)
					assert.NotEmpty(t, first.Header().Get("Retry-After"))
					assert.Empty(t, first.Header().Get("X-Partial"), "the handler's fields do not reach the client")
				} else {
					assert.Equal(t, tt.wantStatus, first.Code)
				}
				assert.Equal(t, tt.wantStatus, events[0].Status)

				retry := serve(mw, newRequest(http.MethodPost, "/charges", "k", "b"))
				if tt.stored {
					assert.Equal(t, OutcomeExecuted, events[0].Outcome)
					assert.NoError(t, events[0].Err)
					assertReplayed(t, true, retry, h)
					assert.Equal(t, first.Body.String(), retry.Body.String())
					return
				}
				assert.Equal(t, OutcomeReleased, events[0].Outcome)
				assert.ErrorIs(t, events[0].Err, errClientGone, "the observer learns why")
				assert.Equal(t, http.StatusCreated, retry.Code)
				assert.Equal(t, "call 2", retry.Body.String())
				assertReplayed(t, false, retry, h)
			})
		})
	}
}

// TestClientGoneStoreContext checks that the request's own context decides,
// even when a store gives the handler a context of its own that does not
// end with the request's.
func TestClientGoneStoreContext(t *testing.T) {
	store := newStubStore()
	store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
		res, err := store.MemoryStore.Claim(ctx, c)
		res.Context = context.WithoutCancel(ctx)
		return res, err
	}
	ctx, cancel := context.WithCancelCause(t.Context())
	calls := 0
	mw := Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		if calls == 1 {
			cancel(errClientGone) // the client leaves; the handler gives up
		}
	}))
	first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b").WithContext(ctx))
	decodeProblem(t, first, ProblemRequestCanceled, http.StatusServiceUnavailable)
	assert.Zero(t, store.Len(), "claim released")
	serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, 2, calls)
}
