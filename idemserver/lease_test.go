package idemserver

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const testLease = time.Second

var errTransient = errors.New("store briefly unreachable")

// runFor is a handler that works for d unless its context ends first, and
// then answers 201 naming the call. It records its context's cause, and
// when it ended, in cause and ended.
type runFor struct {
	d      atomic.Int64 // a time.Duration
	calls  atomic.Int64
	cause  atomic.Pointer[error]
	ended  atomic.Pointer[time.Time]
	ignore bool // keeps working after its context ends
}

func newRunFor(d time.Duration, ignore bool) *runFor {
	h := &runFor{ignore: ignore}
	h.d.Store(int64(d))
	return h
}

func (h *runFor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := h.calls.Add(1)
	done := time.After(time.Duration(h.d.Load()))
	select {
	case <-done:
	case <-r.Context().Done():
		now, cause := time.Now(), context.Cause(r.Context())
		h.ended.Store(&now)
		h.cause.Store(&cause)
		if !h.ignore {
			return
		}
		<-done
	}
	w.WriteHeader(http.StatusCreated)
	_, _ = io.WriteString(w, "call "+itoa(n))
}

// eventLog collects the observer's events from any goroutine.
type eventLog struct {
	mu     sync.Mutex
	events []Event
}

func (l *eventLog) observe(e Event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, e)
}

func (l *eventLog) all() []Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.events)
}

// serveAsync serves r in a new goroutine; the response arrives on the
// channel.
func serveAsync(h http.Handler, r *http.Request) <-chan *httptest.ResponseRecorder {
	done := make(chan *httptest.ResponseRecorder, 1)
	go func() { done <- serve(h, r) }()
	return done
}

// TestLeaseRenewedWhileHandlerRuns runs a handler for ten leases: its lease
// is renewed throughout, so every duplicate meanwhile is told 409, the
// handler runs once and its context never ends. Leases asked for below
// MinLease, too short to be renewed in time (the keeper renews at most once
// a millisecond), are MinLease, and renewed as well.
func TestLeaseRenewedWhileHandlerRuns(t *testing.T) {
	for _, tt := range []struct{ asked, lease time.Duration }{
		{testLease, testLease},
		{time.Nanosecond, MinLease},
		{100 * time.Microsecond, MinLease},
		{2 * time.Millisecond, MinLease},
		{MinLease - 1, MinLease},
	} {
		t.Run(tt.asked.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				h := newRunFor(10*tt.lease, false)
				mw := Middleware(nil, WithLease(tt.asked))(h)
				first := serveAsync(mw, newRequest(http.MethodPost, "/x", "k", "b"))
				synctest.Wait()
				for range 19 {
					time.Sleep(tt.lease / 2)
					w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
					decodeProblem(t, w, ProblemInProgress, http.StatusConflict)
				}
				w := <-first
				assert.Equal(t, http.StatusCreated, w.Code)
				assert.Equal(t, "call 1", w.Body.String())
				assert.Nil(t, h.cause.Load(), "the handler's context did not end")
				retry := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
				assert.Equal(t, "true", retry.Header().Get(ReplayedHeader))
				assert.Equal(t, "call 1", retry.Body.String())
				assert.EqualValues(t, 1, h.calls.Load())
			})
		})
	}
}

// TestDeadHandlerIsTakenOver leaves a claim made directly through the store,
// as by a process that then died: nothing renews it, and once its lease has
// ended the next request takes it over.
func TestDeadHandlerIsTakenOver(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := NewMemoryStore()
		now := time.Now()
		res, err := store.Claim(t.Context(), Claim{
			Key: Key{Key: "k"}, Fingerprint: fingerprint(http.MethodPost, "/x", "", []byte("b")),
			Token: "dead", Now: now, LeaseExpires: now.Add(testLease),
		})
		require.NoError(t, err)
		require.True(t, res.Claimed)
		h := &countingHandler{}
		mw := Middleware(store, WithLease(testLease))(h)

		time.Sleep(testLease - time.Millisecond)
		decodeProblem(t, serve(mw, newRequest(http.MethodPost, "/x", "k", "b")), ProblemInProgress, http.StatusConflict)
		time.Sleep(time.Millisecond)
		w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		assert.Equal(t, http.StatusCreated, w.Code)
		assert.EqualValues(t, 1, h.calls.Load())
	})
}

// TestLeaseLostCancelsHandler makes the store report that the lease is
// lost at the first extension: the handler's context ends with a cause
// wrapping ErrLeaseLost, and the observer is told.
func TestLeaseLostCancelsHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := newStubStore()
		store.extend = func(context.Context, Key, string, time.Time) error {
			return ErrLeaseLost
		}
		var log eventLog
		h := newRunFor(10*testLease, false)
		mw := Middleware(store, WithLease(testLease), WithObserver(log.observe))(h)
		start := time.Now()
		w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))

		require.NotNil(t, h.cause.Load(), "the handler's context ended")
		assert.ErrorIs(t, *h.cause.Load(), ErrLeaseLost)
		assert.Equal(t, start.Add(testLease/3), *h.ended.Load(), "at the first extension")
		decodeProblem(t, w, ProblemLeaseLost, http.StatusServiceUnavailable)
		events := log.all()
		require.Len(t, events, 1)
		assert.Equal(t, OutcomeReleased, events[0].Outcome)
		assert.ErrorIs(t, events[0].Err, ErrLeaseLost)
	})
}

// TestLeaseExtensionRetried makes extensions fail for a while: a lease
// that is extended before it ends keeps the handler running; one that
// cannot be ends the handler's context before the lease does, with a cause
// wrapping ErrLeaseLost. No extension is made after the claim has ended.
func TestLeaseExtensionRetried(t *testing.T) {
	for _, tt := range []struct {
		name     string
		failures int64 // extensions that fail before the rest succeed
		lost     bool
	}{
		{"fails once", 1, false},
		{"fails for half a lease", int64(testLease / 2 / renewRetryDelay(testLease)), false},
		{"fails for good", 1 << 62, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := newStubStore()
				var extensions, failed atomic.Int64
				var ended atomic.Bool
				store.extend = func(ctx context.Context, k Key, token string, expires time.Time) error {
					assert.False(t, ended.Load(), "extension after the claim ended")
					extensions.Add(1)
					if failed.Add(1) <= tt.failures {
						return errTransient
					}
					return store.MemoryStore.Extend(ctx, k, token, expires)
				}
				store.complete = func(ctx context.Context, k Key, token string, resp *Response, expires time.Time) error {
					ended.Store(true)
					return store.MemoryStore.Complete(ctx, k, token, resp, expires)
				}
				store.release = func(ctx context.Context, k Key, token string) error {
					ended.Store(true)
					return store.MemoryStore.Release(ctx, k, token)
				}
				var log eventLog
				h := newRunFor(10*testLease, false)
				mw := Middleware(store, WithLease(testLease), WithObserver(log.observe))(h)
				start := time.Now()
				w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
				events := log.all()
				require.Len(t, events, 1)
				if !tt.lost {
					assert.Nil(t, h.cause.Load(), "the handler's context did not end")
					assert.Equal(t, http.StatusCreated, w.Code)
					assert.Equal(t, OutcomeExecuted, events[0].Outcome)
					assert.NoError(t, events[0].Err)
					assert.Greater(t, extensions.Load(), tt.failures)
				} else {
					require.NotNil(t, h.cause.Load(), "the handler's context ended")
					assert.ErrorIs(t, *h.cause.Load(), ErrLeaseLost)
					assert.ErrorIs(t, *h.cause.Load(), errTransient)
					assert.Less(t, *h.ended.Load(), start.Add(testLease), "before the lease ended")
					assert.Greater(t, extensions.Load(), int64(2), "extensions are tried again")
					decodeProblem(t, w, ProblemLeaseLost, http.StatusServiceUnavailable)
					assert.ErrorIs(t, events[0].Err, ErrLeaseLost)
				}
				n := extensions.Load()
				time.Sleep(10 * testLease)
				assert.Equal(t, n, extensions.Load(), "no extension after the request")
			})
		})
	}
}

// TestLeaseLostBeforeComplete lets a handler lose its lease (it cannot be
// extended), keep working and answer after another request has taken its
// key over and stored its own outcome. The first client is not given an
// answer that differs from the stored one: it is told to retry, and its
// retry gets the stored outcome.
func TestLeaseLostBeforeComplete(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := newStubStore()
		store.extend = func(context.Context, Key, string, time.Time) error {
			return errTransient
		}
		var log eventLog
		h := newRunFor(3*testLease, true)
		mw := Middleware(store, WithLease(testLease), WithObserver(log.observe))(h)
		first := serveAsync(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		time.Sleep(testLease)
		h.d.Store(0) // the request that takes the key over answers at once
		second := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		assert.Equal(t, http.StatusCreated, second.Code)
		assert.Equal(t, "call 2", second.Body.String())

		w := <-first
		decodeProblem(t, w, ProblemLeaseLost, http.StatusServiceUnavailable)
		assert.NotEmpty(t, w.Header().Get("Retry-After"))
		events := log.all()
		require.Len(t, events, 2)
		assert.Equal(t, OutcomeUnavailable, events[1].Outcome)
		assert.ErrorIs(t, events[1].Err, ErrLeaseLost)
		retry := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		assert.Equal(t, "true", retry.Header().Get(ReplayedHeader))
		assert.Equal(t, "call 2", retry.Body.String())
	})
}

// TestMaxHold runs a handler that ignores its context past the maximum
// hold: its context ends then, its lease is no longer renewed and lapses one
// lease later, when a duplicate takes the key over.
func TestMaxHold(t *testing.T) {
	for _, tt := range []struct {
		name    string
		maxHold time.Duration
		want    time.Duration
	}{
		{"default", 0, DefaultMaxHold},
		{"shorter", 5 * testLease, 5 * testLease},
		{"shorter than the lease", testLease / 2, testLease / 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var log eventLog
				h := newRunFor(tt.want+3*testLease, true)
				mw := Middleware(nil, WithLease(testLease), WithMaxHold(tt.maxHold),
					WithObserver(log.observe))(h)
				start := time.Now()
				first := serveAsync(mw, newRequest(http.MethodPost, "/x", "k", "b"))

				// The lease was extended before the maximum hold ended: the
				// key is held a while longer, but no more than a lease.
				time.Sleep(tt.want + time.Millisecond)
				require.NotNil(t, h.cause.Load(), "the handler's context ended")
				assert.ErrorIs(t, *h.cause.Load(), ErrMaxHoldExceeded)
				assert.Equal(t, start.Add(tt.want), *h.ended.Load())
				decodeProblem(t, serve(mw, newRequest(http.MethodPost, "/x", "k", "b")), ProblemInProgress, http.StatusConflict)

				time.Sleep(testLease - time.Millisecond)
				h.d.Store(0)
				second := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
				assert.Equal(t, "call 2", second.Body.String(), "taken over within a lease of the maximum hold")

				decodeProblem(t, <-first, ProblemLeaseLost, http.StatusServiceUnavailable)
				events := log.all()
				require.Len(t, events, 3)
				assert.ErrorIs(t, events[2].Err, ErrMaxHoldExceeded)
				assert.ErrorIs(t, events[2].Err, ErrLeaseLost)
			})
		})
	}
}

// TestMaxHoldHandlerGivesUp: a handler that returns without answering when
// its context ends at the maximum hold has its claim released.
func TestMaxHoldHandlerGivesUp(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var log eventLog
		h := newRunFor(time.Hour, false)
		mw := Middleware(nil, WithLease(testLease), WithMaxHold(5*testLease),
			WithObserver(log.observe))(h)
		w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		decodeProblem(t, w, ProblemRequestCanceled, http.StatusServiceUnavailable)
		events := log.all()
		require.Len(t, events, 1)
		assert.Equal(t, OutcomeReleased, events[0].Outcome)
		assert.ErrorIs(t, events[0].Err, ErrMaxHoldExceeded)
		h.d.Store(0)
		retry := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		assert.Equal(t, "call 2", retry.Body.String(), "the claim was released")
	})
}

// TestRenewedLeaseNotTakenOver lets a renewal that the keeper sent before
// the lease ended reach the store only after a duplicate has seen the
// lease ended, and before the duplicate's takeover: as when the store is
// slow to take its lock or a round trip is in flight. The renewal
// succeeded, so the handler is live and keeps running, its context intact;
// the takeover must not replace its lease, or two handlers run at once for
// one key while the first believes it still holds it.
func TestRenewedLeaseNotTakenOver(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := newStubStore()
		proceed, landed := make(chan struct{}), make(chan struct{})
		var extensions atomic.Int64
		store.extend = func(ctx context.Context, k Key, token string, expires time.Time) error {
			if extensions.Add(1) > 1 {
				return store.MemoryStore.Extend(ctx, k, token, expires)
			}
			// Sent in time; applied, and reported, only later.
			<-proceed
			defer close(landed)
			return store.MemoryStore.Extend(context.WithoutCancel(ctx), k, token, expires)
		}
		store.takeOver = func(ctx context.Context, c Claim, expired string) (ClaimResult, error) {
			close(proceed)
			<-landed
			return store.MemoryStore.TakeOver(ctx, c, expired)
		}
		h := newRunFor(3*testLease, false)
		mw := Middleware(store, WithLease(testLease))(h)
		first := serveAsync(mw, newRequest(http.MethodPost, "/x", "k", "b"))

		time.Sleep(testLease + testLease/10) // past the lease the duplicate sees
		w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		decodeProblem(t, w, ProblemInProgress, http.StatusConflict)

		<-first
		assert.EqualValues(t, 1, h.calls.Load(), "one execution")
	})
}

// TestSlowRenewalKeepsLease makes an extension take most of a lease to
// succeed, as a store under load may: the lease it gives lasts from when it
// was sent, so the next extension must follow in time, and the live
// handler keeps running with its context intact.
func TestSlowRenewalKeepsLease(t *testing.T) {
	for _, slow := range []time.Duration{testLease / 3, 7 * testLease / 10, 9 * testLease / 10} {
		t.Run(slow.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := newStubStore()
				var extensions atomic.Int64
				store.extend = func(ctx context.Context, k Key, token string, expires time.Time) error {
					extensions.Add(1)
					if err := ctx.Err(); err != nil {
						return err // too late to send
					}
					// Sent in time; applied and reported only later.
					time.Sleep(slow)
					return store.MemoryStore.Extend(context.WithoutCancel(ctx), k, token, expires)
				}
				h := newRunFor(5*testLease, false)
				mw := Middleware(store, WithLease(testLease))(h)
				w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
				if c := h.cause.Load(); c != nil {
					t.Fatalf("the handler's context ended: %v", *c)
				}
				assert.Equal(t, http.StatusCreated, w.Code)
				assert.Equal(t, "call 1", w.Body.String())
				assert.Greater(t, extensions.Load(), int64(3))
			})
		})
	}
}

// TestExtensionInProgressEndsWithTheClaim lets the handler return while an
// extension of its lease waits on a store that does not answer: the
// extension's context is cancelled then, rather than at the end of the
// lease, so the response is not held back by it.
func TestExtensionInProgressEndsWithTheClaim(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := newStubStore()
		extendErr := make(chan error, 1)
		store.extend = func(ctx context.Context, _ Key, _ string, _ time.Time) error {
			<-ctx.Done()
			extendErr <- ctx.Err()
			return ctx.Err()
		}
		h := newRunFor(testLease/2, false)
		mw := Middleware(store, WithLease(testLease))(h)
		start := time.Now()
		w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		assert.Equal(t, start.Add(testLease/2), time.Now(), "the response waits for no extension")
		assert.Equal(t, http.StatusCreated, w.Code)
		assert.Equal(t, context.Canceled, <-extendErr)
	})
}

// TestClaimAnsweredAfterItsLease has the store grant a claim whose answer
// arrives only after the lease it granted has ended, as a store stalled in
// the middle of a claim may. Another request may take the key over at any
// moment then, so the handler must not run: the client gets 503 and the
// key is released for its retry.
func TestClaimAnsweredAfterItsLease(t *testing.T) {
	clock := newFakeClock()
	store := newStubStore()
	slow := true
	store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
		res, err := store.MemoryStore.Claim(ctx, c)
		if slow {
			clock.Advance(testLease)
		}
		return res, err
	}
	var events []Event
	h := &countingHandler{}
	mw := Middleware(store, WithLease(testLease), WithClock(clock.Now),
		WithObserver(func(e Event) { events = append(events, e) }))(h)

	w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	decodeProblem(t, w, ProblemLeaseLost, http.StatusServiceUnavailable)
	assert.NotEmpty(t, w.Header().Get("Retry-After"))
	assert.Zero(t, h.calls.Load(), "the handler did not start")
	require.Len(t, events, 1)
	assert.Equal(t, OutcomeUnavailable, events[0].Outcome)
	assert.ErrorIs(t, events[0].Err, ErrLeaseLost)

	slow = false
	w = serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, http.StatusCreated, w.Code, "the key was released for the retry")
	assert.EqualValues(t, 1, h.calls.Load())
}

// TestSlowClaimLeaseRenewedInTime has the store answer a claim late, with
// little of the lease it granted left. The lease runs from the claim, not
// from when the answer arrived, so its first renewal must be due a third
// of a lease after the claim: a duplicate sent after the granted lease has
// ended is told 409, and the handler, which is still running, is not run
// a second time.
func TestSlowClaimLeaseRenewedInTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := newStubStore()
		var slow atomic.Bool
		slow.Store(true)
		store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
			res, err := store.MemoryStore.Claim(ctx, c)
			if slow.Swap(false) {
				time.Sleep(testLease * 9 / 10)
			}
			return res, err
		}
		h := newRunFor(5*testLease, false)
		mw := Middleware(store, WithLease(testLease))(h)
		start := time.Now()
		first := serveAsync(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		time.Sleep(testLease + testLease/10)
		require.True(t, time.Now().After(start.Add(testLease)), "the granted lease has ended")
		w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
		decodeProblem(t, w, ProblemInProgress, http.StatusConflict)
		assert.EqualValues(t, 1, h.calls.Load(), "the live handler was not taken over")
		w = <-first
		assert.Equal(t, http.StatusCreated, w.Code)
		assert.Nil(t, h.cause.Load(), "the handler's context did not end")
	})
}

// TestLeaseLostAfterStreaming has Complete report the lease lost for a
// response the handler already streamed. The client has its status and
// part of its body, so nothing replaces them: it gets the rest as
// written, and the observer gets the lost lease.
func TestLeaseLostAfterStreaming(t *testing.T) {
	store := newStubStore()
	store.complete = func(context.Context, Key, string, *Response, time.Time) error {
		return ErrLeaseLost
	}
	var events []Event
	mw := Middleware(store, WithObserver(func(e Event) { events = append(events, e) }))(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "event 1\n")
			w.(http.Flusher).Flush()
			_, _ = io.WriteString(w, "event 2\n")
		}))
	w := &flushRecorder{ResponseRecorder: httptest.NewRecorder()}
	mw.ServeHTTP(w, newRequest(http.MethodPost, "/x", "k", "b"))
	assert.Equal(t, []string{"event 1\n"}, w.bodyAtFlush, "streamed before Complete")
	assert.Equal(t, http.StatusCreated, w.Code)
	assert.Equal(t, "event 1\nevent 2\n", w.Body.String())
	require.Len(t, events, 1)
	assert.ErrorIs(t, events[0].Err, ErrLeaseLost)
}
