package idemserver

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// holdingStore is a stubStore that holds responses, as a transactional
// store does.
type holdingStore struct{ *stubStore }

func (holdingStore) HoldResponses() bool { return true }

// claimHoldingStore returns a stubStore whose claims say to hold
// responses (ClaimResult.Hold), as a transactional store's do, and which
// does not implement ResponseHolder, as a wrapper of such a store that
// forwards only the Store methods does not.
func claimHoldingStore() *stubStore {
	s := newStubStore()
	s.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
		res, err := s.MemoryStore.Claim(ctx, c)
		res.Hold = res.Claimed
		return res, err
	}
	return s
}

// holders are the two ways a store says to hold responses.
var holders = []struct {
	name string
	new  func() (Store, *stubStore)
}{
	{"ResponseHolder", func() (Store, *stubStore) { s := newStubStore(); return holdingStore{s}, s }},
	{"ClaimResult.Hold", func() (Store, *stubStore) { s := claimHoldingStore(); return s, s }},
}

func TestHoldingStoreLetsNothingThroughEarly(t *testing.T) {
	for _, holder := range holders {
		t.Run(holder.name, func(t *testing.T) { testHoldingStoreLetsNothingThroughEarly(t, holder.new) })
	}
}

func testHoldingStoreLetsNothingThroughEarly(t *testing.T, newStore func() (Store, *stubStore)) {
	for _, tt := range []struct {
		name    string
		handler func(w http.ResponseWriter)
		body    string
		omitted bool
	}{
		{"flush", func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/plain")
			_, _ = w.Write([]byte("one, "))
			require.NoError(t, http.NewResponseController(w).Flush())
			_, _ = w.Write([]byte("two"))
		}, "one, two", false},
		{"larger than the limit", func(w http.ResponseWriter) {
			_, _ = w.Write([]byte(strings.Repeat("x", 10)))
			_, _ = w.Write([]byte(strings.Repeat("y", 10)))
		}, strings.Repeat("x", 10) + strings.Repeat("y", 10), true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			store, stub := newStore()
			w := httptestRecorder()
			var stored *Response
			stub.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
				assert.False(t, w.wroteHeader.Load(), "the client got the response before Complete")
				stored = resp
				return stub.MemoryStore.Complete(ctx, k, token, resp, exp)
			}
			runs := 0
			mw := Middleware(store, WithMaxResponseBytes(15))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				tt.handler(w)
			}))
			mw.ServeHTTP(w, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, http.StatusOK, w.Code)
			assert.Equal(t, tt.body, w.Body.String(), "the client gets the whole response")
			require.NotNil(t, stored)
			assert.Equal(t, tt.omitted, stored.BodyOmitted)
			if !tt.omitted {
				assert.Equal(t, tt.body, string(stored.Body))
			}
			replay := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, "true", replay.Header().Get(ReplayedHeader))
			assert.Equal(t, 1, runs)
		})
	}
}

func TestClaimHoldKeepsARolledBackResponseFromTheClient(t *testing.T) {
	// A store that says to hold on its claims alone (a transactional store
	// behind a wrapper that hides ResponseHolder) has a response that
	// flushed, or outgrew the limit, answered 503 when Complete rolls it
	// back: the client must not be told of work that was not kept.
	for _, tt := range []struct {
		name    string
		handler func(w http.ResponseWriter)
	}{
		{"flush", func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("paid"))
			require.NoError(t, http.NewResponseController(w).Flush())
		}},
		{"larger than the limit", func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(strings.Repeat("x", 20)))
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			store := claimHoldingStore()
			w := httptestRecorder()
			store.complete = func(ctx context.Context, k Key, token string, _ *Response, _ time.Time) error {
				assert.False(t, w.wroteHeader.Load(), "the client got the response before Complete")
				_ = store.MemoryStore.Release(ctx, k, token)
				return fmt.Errorf("commit: %w", ErrRolledBack)
			}
			var events []Event
			mw := Middleware(store, WithMaxResponseBytes(15), WithObserver(func(e Event) { events = append(events, e) }))(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { tt.handler(w) }))
			mw.ServeHTTP(w, newRequest(http.MethodPost, "/x", "k", "b"))
			decodeProblem(t, w.ResponseRecorder, ProblemStoreUnavailable, http.StatusServiceUnavailable)
			require.Len(t, events, 1)
			assert.Equal(t, OutcomeUnavailable, events[0].Outcome)
			assert.ErrorIs(t, events[0].Err, ErrRolledBack)
		})
	}
}

func TestClaimHoldAllowsReruns(t *testing.T) {
	// A response held by the claim's word may be dropped for another run,
	// as one held by a ResponseHolder may.
	store := claimHoldingStore()
	completes := 0
	store.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
		if completes++; completes == 1 {
			_ = store.MemoryStore.Release(ctx, k, token)
			return fmt.Errorf("%w: %w", ErrRolledBack, ErrRetryRequest)
		}
		return store.MemoryStore.Complete(ctx, k, token, resp, exp)
	}
	h := &countingHandler{}
	w := serve(Middleware(store)(h), newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, http.StatusCreated, w.Code)
	assert.Equal(t, "2", w.Header().Get("X-Call"), "the second run's answer")
	assert.Equal(t, int64(2), h.calls.Load(), "handler runs")
}

// watchedRecorder is a ResponseRecorder that tells whether anything was
// sent to it.
type watchedRecorder struct {
	*httptest.ResponseRecorder
	wroteHeader atomic.Bool
}

func httptestRecorder() *watchedRecorder {
	return &watchedRecorder{ResponseRecorder: httptest.NewRecorder()}
}

func (w *watchedRecorder) WriteHeader(code int) {
	w.wroteHeader.Store(true)
	w.ResponseRecorder.WriteHeader(code)
}

func (w *watchedRecorder) Write(p []byte) (int, error) {
	w.wroteHeader.Store(true)
	return w.ResponseRecorder.Write(p)
}

func (w *watchedRecorder) Flush() {
	w.wroteHeader.Store(true)
	w.ResponseRecorder.Flush()
}

func TestOutcomeUnknownAnswers503WithoutRelease(t *testing.T) {
	store := holdingStore{newStubStore()}
	store.complete = func(context.Context, Key, string, *Response, time.Time) error {
		return fmt.Errorf("commit: connection reset: %w", ErrOutcomeUnknown)
	}
	released := 0
	store.release = func(context.Context, Key, string) error { released++; return nil }
	var events []Event
	h := &countingHandler{}
	w := serve(Middleware(store, WithObserver(func(e Event) { events = append(events, e) }))(h), newRequest(http.MethodPost, "/x", "k", "b"))
	decodeProblem(t, w, ProblemStoreUnavailable, http.StatusServiceUnavailable)
	assert.NotEmpty(t, w.Header().Get("Retry-After"))
	assert.Empty(t, w.Header().Get("X-Call"), "none of the handler's response")
	assert.Zero(t, released, "a commit of unknown outcome is never followed by a release")
	require.Len(t, events, 1)
	assert.ErrorIs(t, events[0].Err, ErrOutcomeUnknown)
	assert.Equal(t, OutcomeUnavailable, events[0].Outcome)
}

func TestRetryRequestRerunsTheHandler(t *testing.T) {
	retry := fmt.Errorf("could not serialize access: %w", ErrRetryRequest)
	for _, tt := range []struct {
		name string
		// fail makes the store discard attempt n and ask for a rerun.
		fail    func(s holdingStore, n *int)
		status  int // of the handler's first attempt
		reruns  int
		answer  int
		outcome Outcome
	}{
		{"from Complete", func(s holdingStore, n *int) {
			s.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
				if *n++; *n == 1 {
					_ = s.MemoryStore.Release(ctx, k, token)
					return fmt.Errorf("%w: %w", ErrRolledBack, retry)
				}
				return s.MemoryStore.Complete(ctx, k, token, resp, exp)
			}
		}, http.StatusCreated, 1, http.StatusCreated, OutcomeExecuted},
		{"from Release", func(s holdingStore, n *int) {
			s.release = func(ctx context.Context, k Key, token string) error {
				*n++
				_ = s.MemoryStore.Release(ctx, k, token)
				return retry
			}
		}, http.StatusInternalServerError, 1, http.StatusCreated, OutcomeExecuted},
		{"bounded", func(s holdingStore, n *int) {
			s.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
				*n++
				_ = s.MemoryStore.Release(ctx, k, token)
				return fmt.Errorf("%w: %w", ErrRolledBack, retry)
			}
		}, http.StatusCreated, MaxReruns, http.StatusServiceUnavailable, OutcomeUnavailable},
	} {
		t.Run(tt.name, func(t *testing.T) {
			store := holdingStore{newStubStore()}
			var failures int
			tt.fail(store, &failures)
			var runs atomic.Int64
			var events []Event
			mw := Middleware(store, WithObserver(func(e Event) { events = append(events, e) }))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := runs.Add(1)
				body := make([]byte, 1)
				_, _ = r.Body.Read(body)
				w.Header().Add("X-Attempt", itoa(n))
				w.Header().Add("X-Body", string(body))
				if n == 1 {
					w.WriteHeader(tt.status)
				} else {
					w.WriteHeader(http.StatusCreated)
				}
				_, _ = io.WriteString(w, "attempt "+itoa(n))
			}))
			outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("X-Request-Id", "outer")
				mw.ServeHTTP(w, r)
			})
			w := serve(outer, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, tt.answer, w.Code)
			assert.Equal(t, int64(1+tt.reruns), runs.Load(), "handler runs")
			assert.Equal(t, []string{"outer"}, w.Header()["X-Request-Id"], "the outer fields stay")
			if tt.answer == http.StatusCreated {
				assert.Equal(t, []string{itoa(runs.Load())}, w.Header()["X-Attempt"], "only the last attempt's fields")
				assert.Equal(t, []string{"b"}, w.Header()["X-Body"], "every attempt reads the body")
				assert.Equal(t, "attempt "+itoa(runs.Load()), w.Body.String(), "only the last attempt's body")
			}
			require.Len(t, events, 1)
			assert.Equal(t, tt.outcome, events[0].Outcome)
			if tt.answer == http.StatusCreated {
				replay := serve(outer, newRequest(http.MethodPost, "/x", "k", "b"))
				assert.Equal(t, "true", replay.Header().Get(ReplayedHeader))
				assert.Equal(t, w.Body.String(), replay.Body.String(), "the replay is the first answer")
			}
		})
	}
}

func TestRetryRequestNeedsAHoldingStore(t *testing.T) {
	// A store that lets responses through cannot take one back: no rerun.
	store := newStubStore()
	store.complete = func(context.Context, Key, string, *Response, time.Time) error {
		return fmt.Errorf("%w: %w", ErrRolledBack, ErrRetryRequest)
	}
	h := &countingHandler{}
	w := serve(Middleware(store)(h), newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, http.StatusServiceUnavailable, w.Code)
	assert.Equal(t, int64(1), h.calls.Load())
}

// TestRetryRequestReportsTheEvictionsOfEveryClaim: a claim that dropped a
// completed record early to make room, and whose attempt the store then
// discarded, is followed by another claim that drops nothing. The observer
// must still hear of the dropped record, whose key a retry would run again.
func TestRetryRequestReportsTheEvictionsOfEveryClaim(t *testing.T) {
	for _, tt := range []struct {
		name string
		// second answers the claim that follows the discarded attempt.
		second  func(s holdingStore, c Claim) (ClaimResult, error)
		outcome Outcome
	}{
		{"rerun executed", nil, OutcomeExecuted},
		{"rerun refused by a full store", func(holdingStore, Claim) (ClaimResult, error) {
			return ClaimResult{}, ErrStoreFull
		}, OutcomeUnavailable},
		{"rerun finds the key in progress", func(s holdingStore, c Claim) (ClaimResult, error) {
			return ClaimResult{Record: Record{Fingerprint: c.Fingerprint, Token: "other", LeaseExpires: c.LeaseExpires}}, nil
		}, OutcomeInProgress},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// One record fits: the claim of "b" drops the completed "a".
			store := holdingStore{&stubStore{MemoryStore: NewMemoryStore(WithShards(1), WithMaxEntries(1), WithEvictOldest())}}
			claims := 0
			store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
				if claims++; claims == 3 && tt.second != nil {
					return tt.second(store, c)
				}
				return store.MemoryStore.Claim(ctx, c)
			}
			discarded := discardFirstCompletion(store, "b")
			var events []Event
			mw := Middleware(store, WithObserver(func(e Event) { events = append(events, e) }))(&countingHandler{})
			serve(mw, newRequest(http.MethodPost, "/x", "a", "b"))
			serve(mw, newRequest(http.MethodPost, "/x", "b", "b"))
			require.True(t, *discarded, "the first attempt of b was discarded")
			require.Len(t, events, 2)
			assert.Equal(t, tt.outcome, events[1].Outcome)
			require.Len(t, events[1].Evictions, 1, "the record dropped for the discarded attempt is reported")
			assert.Equal(t, Key{Key: "a"}, events[1].Evictions[0].Key)
		})
	}
}

// TestRetryRequestLeavesTheStoresEvictionsAlone: the evictions a store
// reports belong to it; the middleware must not write into their backing
// array when it adds a rerun's claim's to a discarded attempt's.
func TestRetryRequestLeavesTheStoresEvictionsAlone(t *testing.T) {
	store := holdingStore{&stubStore{MemoryStore: NewMemoryStore()}}
	kept := []Eviction{{Key: Key{Key: "first"}}, {Key: Key{Key: "the store's own"}}}
	claims := 0
	store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
		res, err := store.MemoryStore.Claim(ctx, c)
		switch claims++; claims {
		case 1:
			res.Evictions = kept[:1] // a view with room behind it
		case 2:
			res.Evictions = []Eviction{{Key: Key{Key: "second"}}}
		}
		return res, err
	}
	discarded := discardFirstCompletion(store, "k")
	var events []Event
	mw := Middleware(store, WithObserver(func(e Event) { events = append(events, e) }))(&countingHandler{})
	serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	require.True(t, *discarded)
	require.Len(t, events, 1)
	assert.Equal(t, []Eviction{{Key: Key{Key: "first"}}, {Key: Key{Key: "second"}}}, events[0].Evictions)
	assert.Equal(t, Key{Key: "the store's own"}, kept[1].Key, "the store's array was written to")
}

// discardFirstCompletion makes store discard the first completion of key,
// as a transactional store does after a serialization failure: it rolls
// the claim back and asks for a rerun. The flag it returns tells whether
// that happened.
func discardFirstCompletion(store holdingStore, key string) *bool {
	discarded := new(bool)
	store.complete = func(ctx context.Context, k Key, token string, resp *Response, exp time.Time) error {
		if k.Key == key && !*discarded {
			*discarded = true
			_ = store.MemoryStore.Release(ctx, k, token)
			return fmt.Errorf("%w: %w", ErrRolledBack, ErrRetryRequest)
		}
		return store.MemoryStore.Complete(ctx, k, token, resp, exp)
	}
	return discarded
}

// TestHoldingStoreFailedCompleteSendsNoSuccess has a store that holds
// responses fail every Complete with an error it does not classify (a
// commit cut off by its call's deadline, reported as the context's
// error). Such a store kept nothing of the claim unless Complete
// succeeded, so the handler's 201 must not reach the client: it would be
// told of work that may have been discarded. It gets 503, and the claim
// is not released, since the commit may have landed.
func TestHoldingStoreFailedCompleteSendsNoSuccess(t *testing.T) {
	for _, holder := range holders {
		t.Run(holder.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store, stub := holder.new()
				calls := 0
				stub.complete = func(context.Context, Key, string, *Response, time.Time) error {
					calls++
					return fmt.Errorf("commit: %w", context.DeadlineExceeded)
				}
				released := 0
				stub.release = func(context.Context, Key, string) error { released++; return nil }
				var events []Event
				h := &countingHandler{}
				w := serve(Middleware(store, WithObserver(func(e Event) { events = append(events, e) }))(h),
					newRequest(http.MethodPost, "/x", "k", "b"))
				assert.Equal(t, 3, calls, "a transient failure is tried again")
				decodeProblem(t, w, ProblemStoreUnavailable, http.StatusServiceUnavailable)
				assert.NotEmpty(t, w.Header().Get("Retry-After"))
				assert.Empty(t, w.Header().Get("X-Call"), "none of the handler's response")
				assert.Zero(t, released, "a commit that may have landed is not released")
				require.Len(t, events, 1)
				assert.Equal(t, OutcomeUnavailable, events[0].Outcome)
				assert.ErrorIs(t, events[0].Err, context.DeadlineExceeded)
			})
		})
	}
}
