package idemserver

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// unknownLength hides a reader's length, as a chunked request body does.
type unknownLength struct{ io.Reader }

func TestRequestBodyLimit(t *testing.T) {
	const limit = 16
	for _, tt := range []struct {
		name    string
		body    string
		chunked bool
		refused bool
	}{
		{"empty", "", false, false},
		{"at limit", strings.Repeat("a", limit), false, false},
		{"over limit", strings.Repeat("a", limit+1), false, true},
		{"at limit, unknown length", strings.Repeat("a", limit), true, false},
		{"one over limit, unknown length", strings.Repeat("a", limit+1), true, true},
		{"far over limit, unknown length", strings.Repeat("a", 10*limit), true, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var got []byte
			mw := Middleware(nil, WithMaxBodyBytes(limit))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				got, _ = io.ReadAll(r.Body)
				w.WriteHeader(http.StatusCreated)
			}))
			r := newRequest(http.MethodPost, "/x", "k", tt.body)
			if tt.chunked {
				r.Body = io.NopCloser(unknownLength{strings.NewReader(tt.body)})
				r.ContentLength = -1
			}
			w := serve(mw, r)
			if tt.refused {
				decodeProblem(t, w, ProblemBodyTooLarge, http.StatusRequestEntityTooLarge)
				assert.Nil(t, got, "handler runs")
				return
			}
			assert.Equal(t, http.StatusCreated, w.Code)
			assert.Equal(t, tt.body, string(got), "handler reads the restored body")
		})
	}
}

func TestRequestBodyOuterLimit(t *testing.T) {
	// An http.MaxBytesReader in front of the middleware is a 413 too.
	mw := Middleware(nil)(&countingHandler{})
	r := newRequest(http.MethodPost, "/x", "k", strings.Repeat("a", 100))
	w := httptest.NewRecorder()
	r.Body = http.MaxBytesReader(w, r.Body, 10)
	r.ContentLength = -1
	mw.ServeHTTP(w, r)
	decodeProblem(t, w, ProblemBodyTooLarge, http.StatusRequestEntityTooLarge)
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("connection reset") }

func TestRequestBodyUnreadable(t *testing.T) {
	h := &countingHandler{}
	r := newRequest(http.MethodPost, "/x", "k", "")
	r.Body = io.NopCloser(failingReader{})
	r.ContentLength = -1
	w := serve(Middleware(nil)(h), r)
	p := decodeProblem(t, w, ProblemBodyUnreadable, http.StatusBadRequest)
	assert.Contains(t, p.Detail, "connection reset")
	assert.Zero(t, h.calls.Load())
}

func TestResponseLimit(t *testing.T) {
	const limit = 32
	for _, tt := range []struct {
		name   string
		writes []string
		stored bool
	}{
		{"at limit in one write", []string{strings.Repeat("r", limit)}, true},
		{"at limit in two writes", []string{strings.Repeat("r", limit/2), strings.Repeat("r", limit/2)}, true},
		{"over limit in one write", []string{strings.Repeat("r", limit+1)}, false},
		{"over limit in the third write", []string{strings.Repeat("a", 20), strings.Repeat("b", 10), strings.Repeat("c", 10)}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var calls int
			mw := Middleware(nil, WithMaxResponseBytes(limit))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls++
				w.Header().Set("X-Big", "yes")
				w.WriteHeader(http.StatusCreated)
				for _, s := range tt.writes {
					_, _ = io.WriteString(w, s)
				}
			}))
			first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, http.StatusCreated, first.Code)
			assert.Equal(t, strings.Join(tt.writes, ""), first.Body.String(), "the client gets the whole response")
			assert.Equal(t, "yes", first.Header().Get("X-Big"))

			second := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, 1, calls, "the key stays completed")
			assert.Equal(t, "true", second.Header().Get(ReplayedHeader))
			if tt.stored {
				assert.Equal(t, first.Body.String(), second.Body.String())
				return
			}
			p := decodeProblem(t, second, ProblemResponseNotStored, http.StatusCreated)
			assert.Contains(t, p.Detail, "201")
		})
	}
}

func TestProblemDocuments(t *testing.T) {
	store := newStubStore()
	clock := newFakeClock()
	fp := fingerprint(http.MethodPost, "/x", "", []byte("b"))
	_, err := store.Claim(t.Context(), Claim{Key: Key{Key: "busy"}, Fingerprint: fp, Token: "t", Now: clock.Now(), LeaseExpires: clock.Now().Add(time.Hour)})
	require.NoError(t, err)
	mw := Middleware(store, RequireKey(), WithClock(clock.Now), WithMaxBodyBytes(4), WithRetryAfter(2500*time.Millisecond))(&countingHandler{})
	failing := newStubStore()
	failing.claim = func(context.Context, Claim) (ClaimResult, error) { return ClaimResult{}, errors.New("down") }
	down := Middleware(failing, WithRetryAfter(time.Millisecond))(&countingHandler{})

	for _, tt := range []struct {
		name       string
		h          http.Handler
		r          *http.Request
		typ        string
		status     int
		retryAfter string
	}{
		{"malformed key", mw, newRequest(http.MethodPost, "/x", "a b", "b"), ProblemMalformedKey, 400, ""},
		{"missing key", mw, newRequest(http.MethodPost, "/x", "", "b"), ProblemMissingKey, 400, ""},
		{"body too large", mw, newRequest(http.MethodPost, "/x", "k", "12345"), ProblemBodyTooLarge, 413, ""},
		{"fingerprint mismatch", mw, newRequest(http.MethodPost, "/x", "busy", "c"), ProblemFingerprintMismatch, 422, ""},
		{"in progress", mw, newRequest(http.MethodPost, "/x", "busy", "b"), ProblemInProgress, 409, "3"},
		{"store unavailable", down, newRequest(http.MethodPost, "/x", "k", "b"), ProblemStoreUnavailable, 503, "1"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			w := serve(tt.h, tt.r)
			p := decodeProblem(t, w, tt.typ, tt.status)
			assert.True(t, strings.HasPrefix(p.Type, "https://"), "type is an absolute URI")
			assert.NotEmpty(t, p.Detail)
			assert.Equal(t, tt.retryAfter, w.Header().Get("Retry-After"))
			assert.Equal(t, "no-store", w.Header().Get("Cache-Control"))
		})
	}
}

func TestStoreFailure(t *testing.T) {
	errDown := errors.New("connection refused")
	clock := newFakeClock()
	fp := fingerprint(http.MethodPost, "/x", "", []byte("b"))
	expired := func(t *testing.T, s *stubStore) {
		_, err := s.MemoryStore.Claim(t.Context(), Claim{Key: Key{Key: "k"}, Fingerprint: fp, Token: "old", Now: clock.Now(), LeaseExpires: clock.Now()})
		require.NoError(t, err)
	}
	for _, tt := range []struct {
		name    string
		setup   func(*testing.T, *stubStore)
		status  int
		runs    bool
		outcome Outcome
	}{
		{
			name: "claim fails",
			setup: func(_ *testing.T, s *stubStore) {
				s.claim = func(context.Context, Claim) (ClaimResult, error) { return ClaimResult{}, errDown }
			},
			status: http.StatusServiceUnavailable, outcome: OutcomeUnavailable,
		},
		{
			name: "takeover fails",
			setup: func(t *testing.T, s *stubStore) {
				expired(t, s)
				s.takeOver = func(context.Context, Claim, string) (ClaimResult, error) { return ClaimResult{}, errDown }
			},
			status: http.StatusServiceUnavailable, outcome: OutcomeUnavailable,
		},
		{
			name: "context ends before claim",
			setup: func(_ *testing.T, s *stubStore) {
				s.claim = func(context.Context, Claim) (ClaimResult, error) { return ClaimResult{}, context.Canceled }
			},
			status: http.StatusServiceUnavailable, outcome: OutcomeUnavailable,
		},
		{
			name: "complete fails: response delivered",
			setup: func(_ *testing.T, s *stubStore) {
				s.complete = func(context.Context, Key, string, *Response, time.Time) error { return errDown }
			},
			status: http.StatusCreated, runs: true, outcome: OutcomeExecuted,
		},
		{
			name: "complete rolled back: 503",
			setup: func(_ *testing.T, s *stubStore) {
				s.complete = func(context.Context, Key, string, *Response, time.Time) error { return ErrRolledBack }
			},
			status: http.StatusServiceUnavailable, runs: true, outcome: OutcomeUnavailable,
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			store := newStubStore()
			tt.setup(t, store)
			var events []Event
			h := &countingHandler{}
			w := serve(Middleware(store, WithClock(clock.Now), WithObserver(func(e Event) { events = append(events, e) }))(h),
				newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, tt.status, w.Code)
			if w.Code == http.StatusServiceUnavailable {
				decodeProblem(t, w, ProblemStoreUnavailable, http.StatusServiceUnavailable)
				assert.Equal(t, "1", w.Header().Get("Retry-After"))
				assert.Empty(t, w.Header().Get("X-Call"), "no header of the handler's")
			}
			assert.Equal(t, tt.runs, h.calls.Load() == 1, "handler runs")
			require.Len(t, events, 1)
			assert.Equal(t, tt.outcome, events[0].Outcome)
			assert.Error(t, events[0].Err)
		})
	}
}

func TestReleaseFailureStillDelivers(t *testing.T) {
	store := newStubStore()
	store.release = func(context.Context, Key, string) error { return ErrLeaseLost }
	var events []Event
	w := serve(Middleware(store, WithObserver(func(e Event) { events = append(events, e) }))(&countingHandler{status: 502}),
		newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, http.StatusBadGateway, w.Code)
	assert.Equal(t, "call 1", w.Body.String())
	require.Len(t, events, 1)
	assert.ErrorIs(t, events[0].Err, ErrLeaseLost)
}

func TestStoreContextReachesHandler(t *testing.T) {
	// A transactional store hands the handler a context of its own and gets
	// it back, without cancellation, when the claim ends.
	type txKey struct{}
	store := newStubStore()
	var completeCtx context.Context
	store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
		res, err := store.MemoryStore.Claim(ctx, c)
		res.Context = context.WithValue(ctx, txKey{}, "tx-1")
		return res, err
	}
	store.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
		completeCtx = ctx
		return store.MemoryStore.Complete(ctx, k, token, resp, exp)
	}
	var seen any
	ctx, cancel := context.WithCancel(t.Context())
	mw := Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cancel() // the client goes away: the outcome must still be stored
		seen = r.Context().Value(txKey{})
		w.WriteHeader(http.StatusCreated)
	}))
	r := newRequest(http.MethodPost, "/x", "k", "b").WithContext(ctx)
	w := serve(mw, r)
	assert.Equal(t, http.StatusCreated, w.Code)
	assert.Equal(t, "tx-1", seen)
	require.NotNil(t, completeCtx)
	assert.Equal(t, "tx-1", completeCtx.Value(txKey{}))
	assert.NoError(t, completeCtx.Err())
}

func TestWaitInFlight(t *testing.T) {
	for _, tt := range []struct {
		name       string
		wait       time.Duration
		finishesIn time.Duration // zero: never
		cancel     bool
		replay     bool
	}{
		{"first finishes within the wait", time.Second, 300 * time.Millisecond, false, true},
		{"first finishes after the wait", time.Second, 5 * time.Second, false, false},
		{"no wait", 0, 300 * time.Millisecond, false, false},
		{"waiting client goes away", time.Minute, 0, true, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				release := make(chan struct{})
				var calls int
				mw := Middleware(nil, WithWaitInFlight(tt.wait))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					calls++
					<-release
					w.WriteHeader(http.StatusCreated)
					_, _ = io.WriteString(w, "done")
				}))
				firstDone := make(chan *httptest.ResponseRecorder, 1)
				go func() { firstDone <- serve(mw, newRequest(http.MethodPost, "/x", "k", "b")) }()
				synctest.Wait() // the first request holds the claim
				if tt.finishesIn > 0 {
					time.AfterFunc(tt.finishesIn, func() { close(release) })
				}
				ctx, cancel := context.WithCancel(t.Context())
				defer cancel()
				if tt.cancel {
					time.AfterFunc(10*time.Second, cancel)
				}
				start := time.Now()
				w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b").WithContext(ctx))
				if tt.replay {
					assert.Equal(t, http.StatusCreated, w.Code)
					assert.Equal(t, "true", w.Header().Get(ReplayedHeader))
					assert.Equal(t, "done", w.Body.String())
					assert.Less(t, time.Since(start), tt.finishesIn+maxPoll+time.Millisecond, "replays soon after the first finishes")
				} else {
					decodeProblem(t, w, ProblemInProgress, http.StatusConflict)
					assert.LessOrEqual(t, time.Since(start), max(tt.wait, 10*time.Second), "gives up by the bound")
				}
				if tt.finishesIn == 0 {
					close(release)
				}
				<-firstDone
				assert.Equal(t, 1, calls)
			})
		})
	}
}
