package idemserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

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
			dedup := Middleware(store, WithClock(clock.Now), WithObserver(func(e Event) { events = append(events, e) }))(h)
			// A field set in front of the middleware belongs to the request,
			// whatever the middleware answers.
			outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("X-Request-Id", "req-1")
				dedup.ServeHTTP(w, r)
			})
			w := serve(outer, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, tt.status, w.Code)
			assert.Equal(t, "req-1", w.Header().Get("X-Request-Id"))
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

// TestDamagedStoredResponse has the store hand back a completed record whose
// status no handler could have answered, as a store whose data was damaged
// or mis-decoded would: the middleware must not crash on it, nor replay it
// as something else (net/http sends a 1xx as an interim response and then
// an empty 200, a success the handler never gave). It fails closed, as for
// a store it cannot read, and the handler does not run.
func TestDamagedStoredResponse(t *testing.T) {
	fp := fingerprint(http.MethodPost, "/x", "", []byte("b"))
	for _, status := range []int{0, -1, 100, 103, 199, 1000, 1 << 40} {
		t.Run(strconv.Itoa(status), func(t *testing.T) {
			store := newStubStore()
			store.claim = func(context.Context, Claim) (ClaimResult, error) {
				return ClaimResult{Record: Record{Fingerprint: fp,
					Response: &Response{Status: status, Body: []byte("paid")}}}, nil
			}
			var log eventLog
			h := &countingHandler{}
			srv := httptest.NewServer(Middleware(store, WithObserver(log.observe))(h))
			defer srv.Close()
			req, err := http.NewRequest(http.MethodPost, srv.URL+"/x", strings.NewReader("b"))
			require.NoError(t, err)
			req.Header.Set(DefaultKeyHeader, "k")
			resp, err := srv.Client().Do(req)
			require.NoError(t, err, "the server answered")
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			require.NoError(t, err)
			assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "body: %s", body)
			assert.Equal(t, "application/problem+json", resp.Header.Get("Content-Type"))
			assert.NotEmpty(t, resp.Header.Get("Retry-After"))
			assert.Zero(t, h.calls.Load(), "the handler did not run")
			events := log.all()
			require.Len(t, events, 1)
			assert.Equal(t, OutcomeUnavailable, events[0].Outcome)
			assert.Error(t, events[0].Err)
		})
	}
}

// Retry-After is the wait rounded up to whole seconds, at least one, for a
// wait of any size: the longest is not rounded past the largest Duration
// into the shortest.
func TestRetryAfterRounding(t *testing.T) {
	for _, tt := range []struct {
		d    time.Duration
		want string
	}{
		{-time.Second, "1"},
		{time.Millisecond, "1"},
		{time.Second, "1"},
		{2500 * time.Millisecond, "3"},
		{math.MaxInt64, "9223372037"},
	} {
		assert.Equal(t, tt.want, newConfig([]Option{WithRetryAfter(tt.d)}).retryAfter, "%v", tt.d)
	}
}

func TestStoreUnavailableSaysWhy(t *testing.T) {
	// One problem type for every claim the store could not make, and a
	// detail that says which: a store that refuses by its configuration is
	// reachable, and telling the client otherwise sends whoever reads it
	// after a network fault.
	for _, tt := range []struct {
		err    error
		detail string
	}{
		{errors.New("connection refused"), "could not be reached"},
		{fmt.Errorf("shard: %w", ErrStoreFull), "is full"},
		{fmt.Errorf("eviction: %w", ErrStoreMisconfigured), "until its configuration is fixed"},
	} {
		t.Run(tt.err.Error(), func(t *testing.T) {
			store := newStubStore()
			store.claim = func(context.Context, Claim) (ClaimResult, error) { return ClaimResult{}, tt.err }
			var seen []Event
			h := &countingHandler{}
			w := serve(Middleware(store, WithObserver(func(e Event) { seen = append(seen, e) }))(h), newRequest(http.MethodPost, "/x", "k", "b"))
			p := decodeProblem(t, w, ProblemStoreUnavailable, http.StatusServiceUnavailable)
			assert.Contains(t, p.Detail, tt.detail)
			assert.NotEmpty(t, w.Header().Get("Retry-After"))
			assert.Zero(t, h.calls.Load(), "the handler did not run")
			require.Len(t, seen, 1)
			assert.Equal(t, OutcomeUnavailable, seen[0].Outcome)
			assert.ErrorIs(t, seen[0].Err, tt.err)
		})
	}
}
