package pgstore

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type ctxKey struct{}

func TestPoolWait(t *testing.T) {
	// ended reports whether w's Done channel is closed.
	ended := func(w *poolWait) bool {
		select {
		case <-w.Done():
			return true
		default:
			return false
		}
	}
	t.Run("ended at the bound", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			w := newPoolWait()
			start := time.Now()
			w.start(context.Background(), 130*time.Millisecond)
			<-w.Done()
			assert.Equal(t, 130*time.Millisecond, time.Since(start), "ended at the bound, not at a tick after it")
			assert.ErrorIs(t, w.Err(), context.DeadlineExceeded)
			timedOut, reusable := w.end()
			assert.True(t, timedOut)
			assert.False(t, reusable, "its channel is closed")
		})
	})
	t.Run("ended with its request", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			parent, cancel := context.WithCancel(context.Background())
			defer cancel()
			w := newPoolWait()
			start := time.Now()
			w.start(parent, time.Hour)
			time.Sleep(70 * time.Millisecond)
			cancel()
			<-w.Done()
			assert.Equal(t, 2*poolTick, time.Since(start), "noticed at the next tick")
			assert.ErrorIs(t, w.Err(), context.Canceled)
			timedOut, reusable := w.end()
			assert.False(t, timedOut, "the request ended it, not the bound")
			assert.False(t, reusable)
		})
	})
	t.Run("ended early, then used again", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			w := newPoolWait()
			for range 3 {
				w.start(context.Background(), time.Second)
				time.Sleep(3*poolTick + poolTick/2) // ticks, each rearming the timer
				timedOut, reusable := w.end()
				require.False(t, timedOut)
				require.True(t, reusable)
				require.NoError(t, w.Err())
			}
			// A wait that ended is not ended later by its timer.
			time.Sleep(2 * time.Second)
			synctest.Wait()
			assert.False(t, ended(w))
			assert.NoError(t, w.Err())
		})
	})
	t.Run("deadline and values", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			parent := context.WithValue(context.Background(), ctxKey{}, "v")
			w := newPoolWait()
			w.start(parent, time.Second)
			d, ok := w.Deadline()
			assert.True(t, ok)
			assert.Equal(t, time.Now().Add(time.Second), d)
			assert.Equal(t, "v", w.Value(ctxKey{}))
			w.end()

			soon, cancel := context.WithTimeout(parent, 10*time.Millisecond)
			defer cancel()
			w.start(soon, time.Second)
			d, _ = w.Deadline()
			assert.Equal(t, time.Now().Add(10*time.Millisecond), d, "the request's deadline, which comes first")
			<-w.Done()
			assert.ErrorIs(t, w.Err(), context.DeadlineExceeded)
			timedOut, _ := w.end()
			assert.False(t, timedOut, "the request's deadline ended it, not the bound")
		})
	})
}

func TestConnAllocatesNothingOfItsOwnWithAFreeConnection(t *testing.T) {
	// A claim's bounded wait for a pool connection costs no allocation
	// beyond database/sql's own when a connection is free: the replay
	// path runs through it.
	if raceEnabled {
		t.Skip("allocations are counted without -race")
	}
	db := newTestDB(t, 2)
	s := db.newStore(t, WithTransactional())
	ctx := t.Context()
	viaStore := testing.AllocsPerRun(100, func() {
		conn, err := s.conn(ctx)
		require.NoError(t, err)
		require.NoError(t, conn.Close())
	})
	viaPool := testing.AllocsPerRun(100, func() {
		conn, err := db.Conn(ctx)
		require.NoError(t, err)
		require.NoError(t, conn.Close())
	})
	assert.Equal(t, viaPool, viaStore)
}
