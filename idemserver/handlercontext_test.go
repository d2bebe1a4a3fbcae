package idemserver

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var errGone = errors.New("client gone")

type testValueKey struct{}

// isDone reports whether done is closed, without waiting.
func isDone(done <-chan struct{}) bool {
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// TestHandlerContext drives a handler's context through the orders in which
// its parent ends, the keeper cancels it and the handler returns, with and
// without Done asked for first (which makes it cancellable early). Whatever
// the order, it answers as a context.WithCancelCause child of its parent
// would: the first cause wins, and a context derived from it, before or
// after, ends with it, at once (it is the child's child, not a goroutine's
// watch).
func TestHandlerContext(t *testing.T) {
	errLost := errors.New("lease lost")
	type step int
	const (
		askDone step = iota
		derive
		parentEnds
		keeperCancels
		handlerReturns
	)
	for _, tt := range []struct {
		name      string
		steps     []step
		wantCause error // nil: not done
	}{
		{"nothing", nil, nil},
		{"Done asked for", []step{askDone, derive}, nil},
		{"parent ends", []step{derive, parentEnds}, errGone},
		{"parent ends after Done", []step{askDone, derive, parentEnds}, errGone},
		{"keeper cancels", []step{derive, keeperCancels}, errLost},
		{"keeper cancels after Done", []step{askDone, derive, keeperCancels}, errLost},
		{"keeper cancels after the parent ended", []step{parentEnds, keeperCancels, derive}, errGone},
		{"parent ends after the keeper cancelled", []step{keeperCancels, parentEnds}, errLost},
		{"handler returns", []step{derive, handlerReturns}, context.Canceled},
		{"handler returns after Done", []step{askDone, derive, handlerReturns}, context.Canceled},
		{"handler returns after the keeper cancelled", []step{keeperCancels, handlerReturns, derive}, errLost},
		{"handler returns after the parent ended", []step{parentEnds, handlerReturns}, errGone},
		{"parent ends after the handler returned", []step{handlerReturns, parentEnds}, context.Canceled},
		{"keeper cancels after the handler returned", []step{askDone, handlerReturns, keeperCancels}, context.Canceled},
	} {
		t.Run(tt.name, func(t *testing.T) {
			parent, cancelParent := context.WithCancelCause(context.WithValue(context.Background(), testValueKey{}, "v"))
			defer cancelParent(nil)
			key := Key{Scope: "s", Key: "k"}
			c := &handlerContext{parent: parent, key: &key}
			var derived []context.Context
			for _, s := range tt.steps {
				switch s {
				case askDone:
					assert.False(t, isDone(c.Done()))
				case derive:
					d, cancel := context.WithCancel(c)
					defer cancel()
					derived = append(derived, d)
				case parentEnds:
					cancelParent(errGone)
				case keeperCancels:
					c.cancel(errLost)
				case handlerReturns:
					c.end()
				}
			}

			got, ok := KeyFrom(c)
			assert.True(t, ok)
			assert.Equal(t, key, got)
			assert.Equal(t, "v", c.Value(testValueKey{}), "the parent's values")
			for i, ctx := range append([]context.Context{c}, derived...) {
				if tt.wantCause == nil {
					assert.NoError(t, ctx.Err(), "context %d", i)
					assert.NoError(t, context.Cause(ctx), "context %d", i)
					assert.False(t, isDone(ctx.Done()), "context %d", i)
					continue
				}
				assert.ErrorIs(t, ctx.Err(), context.Canceled, "context %d", i)
				assert.Equal(t, tt.wantCause, context.Cause(ctx), "context %d", i)
				assert.True(t, isDone(ctx.Done()), "context %d", i)
			}
		})
	}
}

// TestHandlerContextDeadline: the handler's context has its parent's
// deadline.
func TestHandlerContextDeadline(t *testing.T) {
	at := time.Now().Add(time.Hour)
	parent, cancel := context.WithDeadline(context.Background(), at)
	defer cancel()
	c := &handlerContext{parent: parent, key: &Key{}}
	d, ok := c.Deadline()
	assert.True(t, ok)
	assert.Equal(t, at, d)
}

// TestHandlerContextConcurrentUse asks a handler's context for Done, Err,
// its cause and its values from several goroutines while the keeper cancels
// it and the handler returns: every reader sees it end with the keeper's
// cause, and the race detector sees no race.
func TestHandlerContextConcurrentUse(t *testing.T) {
	errLost := errors.New("lease lost")
	for range 50 {
		key := Key{Key: "k"}
		c := &handlerContext{parent: context.Background(), key: &key}
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range 4 {
			wg.Go(func() {
				<-start
				if i%2 == 0 {
					<-c.Done()
				} else {
					for c.Err() == nil {
						time.Sleep(time.Microsecond)
					}
				}
				assert.Equal(t, errLost, context.Cause(c))
				_, ok := KeyFrom(c)
				assert.True(t, ok)
			})
		}
		wg.Go(func() {
			<-start
			c.cancel(errLost)
			c.end()
		})
		close(start)
		wg.Wait()
		require.Equal(t, errLost, context.Cause(c))
	}
}

// TestHandlerContextAfterReturn: a handler that keeps its request's context
// past its return (in a goroutine it started, say) finds it ended, with
// context.Canceled, or with the client's cause if the client had gone
// first, and still carrying its key, whether or not it asked for Done
// before it returned.
func TestHandlerContextAfterReturn(t *testing.T) {
	for _, tt := range []struct {
		name       string
		askDone    bool
		clientGone bool
		want       error
	}{
		{"never asked for Done", false, false, context.Canceled},
		{"asked for Done", true, false, context.Canceled},
		{"client gone first", false, true, errGone},
		{"asked for Done, client gone first", true, true, errGone},
	} {
		t.Run(tt.name, func(t *testing.T) {
			reqCtx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			var kept context.Context
			mw := Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				kept = r.Context()
				if tt.askDone {
					assert.False(t, isDone(kept.Done()))
				}
				if tt.clientGone {
					cancel(errGone)
				}
				w.WriteHeader(http.StatusCreated)
			}))
			serve(mw, newRequest(http.MethodPost, "/x", "k", "b").WithContext(reqCtx))
			cancel(errors.New("the server ends the request's context after the handler"))

			require.NotNil(t, kept)
			assert.True(t, isDone(kept.Done()))
			assert.ErrorIs(t, kept.Err(), context.Canceled)
			assert.Equal(t, tt.want, context.Cause(kept))
			k, ok := KeyFrom(kept)
			assert.True(t, ok)
			assert.Equal(t, Key{Key: "k"}, k)
		})
	}
}

// TestLeaseLostCancelsHandlerCheckingErr is TestLeaseLostCancelsHandler
// for a handler that never asks for Done but checks Err from time to time:
// its context ends with a cause wrapping ErrLeaseLost at the first
// extension too, and it notices at its next check.
func TestLeaseLostCancelsHandlerCheckingErr(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := newStubStore()
		store.extend = func(context.Context, Key, string, time.Time) error {
			return ErrLeaseLost
		}
		const poll = testLease / 30
		var ended time.Time
		var cause error
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			for end := time.Now().Add(10 * testLease); time.Now().Before(end); time.Sleep(poll) {
				if ctx.Err() != nil {
					ended, cause = time.Now(), context.Cause(ctx)
					return
				}
			}
			w.WriteHeader(http.StatusCreated)
		})
		var log eventLog
		mw := Middleware(store, WithLease(testLease), WithObserver(log.observe))(h)
		start := time.Now()
		w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))

		assert.ErrorIs(t, cause, ErrLeaseLost)
		extension := start.Add(testLease / 3)
		assert.False(t, ended.Before(extension), "not before the first extension")
		assert.WithinDuration(t, extension, ended, poll, "at the first check after it")
		decodeProblem(t, w, ProblemLeaseLost, http.StatusServiceUnavailable)
		events := log.all()
		require.Len(t, events, 1)
		assert.Equal(t, OutcomeReleased, events[0].Outcome)
		assert.ErrorIs(t, events[0].Err, ErrLeaseLost)
	})
}
