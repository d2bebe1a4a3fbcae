package redisstore_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

// TestStoreTimeoutBoundsCompleteOnSilentRedis has Redis stop answering
// (CLIENT PAUSE) while a handler runs, with a client configured as the
// package documentation says for idemserver.WithStoreTimeout to bound its
// calls: ContextTimeoutEnabled, and no read timeout of its own. The
// Complete must fail at the middleware's deadline, with the pause still
// on, rather than wait for Redis to answer; the handler runs once.
func TestStoreTimeoutBoundsCompleteOnSilentRedis(t *testing.T) {
	addr := redisAddr(t)
	client := redis.NewClient(&redis.Options{
		Addr: addr, ContextTimeoutEnabled: true, ReadTimeout: -1, WriteTimeout: -1, MaxRetries: -1,
	})
	t.Cleanup(func() { _ = client.Close() })
	admin := clientOf(t, addr)
	store := redisstore.New(client, redisstore.WithPrefix(newPrefix(t, admin)), redisstore.WithEvictionAllowed())

	const pause = 3 * time.Second
	var runs atomic.Int64
	var events []idemserver.Event
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		created(runs.Add(1), w)
		if runs.Load() == 1 {
			require.NoError(t, admin.Do(r.Context(), "CLIENT", "PAUSE", pause.Milliseconds(), "ALL").Err())
		}
	})
	mw := idemserver.Middleware(store, idemserver.WithStoreTimeout(50*time.Millisecond),
		idemserver.WithObserver(func(e idemserver.Event) { events = append(events, e) }))(h)

	req := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("b"))
	req.Header.Set(idemserver.DefaultKeyHeader, "k")
	w := httptest.NewRecorder()
	mw.ServeHTTP(w, req)
	// A command sent now waits for the pause to end.
	paused := client.Ping(t.Context()).Err()
	require.Len(t, events, 1)
	e := events[0]
	assert.Equal(t, idemserver.OutcomeExecuted, e.Outcome, "the response reached the client, not stored")
	assert.True(t, errors.Is(e.Err, os.ErrDeadlineExceeded) || errors.Is(e.Err, context.DeadlineExceeded),
		"the Complete timed out: %v", e.Err)
	assert.Equal(t, http.StatusCreated, w.Code)
	assert.NoError(t, paused, "Redis answers once the pause ends")

	// The retry either replays the response or finds the key in progress
	// (the Complete never landed); it never runs the handler again.
	retry := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("b"))
	retry.Header.Set(idemserver.DefaultKeyHeader, "k")
	w = httptest.NewRecorder()
	mw.ServeHTTP(w, retry)
	if w.Code == http.StatusCreated {
		assert.Equal(t, "run 1", w.Body.String())
	} else {
		assert.Equal(t, http.StatusConflict, w.Code)
	}
	assert.EqualValues(t, 1, runs.Load())
}
