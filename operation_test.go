package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lifecycleCase is a reply to an operation's call, sent through a
// Transport that makes two attempts, and whether it leaves the
// operation's key pending once the response's body is closed.
type lifecycleCase struct {
	name        string
	reply       []func(http.ResponseWriter, *http.Request)
	wantPending bool
}

// lifecycleCases are the Transport's rules for releasing an operation's
// key, which TestOperationKeyLifecycle checks, and which Settle follows
// for an operation made with HoldKey (TestSettleFollowsTheKeyLifecycle).
func lifecycleCases() []lifecycleCase {
	return []lifecycleCase{
		{"2xx releases", []func(http.ResponseWriter, *http.Request){status(201)}, false},
		{"3xx releases", []func(http.ResponseWriter, *http.Request){status(304)}, false},
		{"303 without a Location releases", []func(http.ResponseWriter, *http.Request){status(303)}, false},
		// http.Client would follow it: the GET that follows has the outcome.
		{"301 stays pending", []func(http.ResponseWriter, *http.Request){status(301, "Location", "/done")}, true},
		{"302 stays pending", []func(http.ResponseWriter, *http.Request){status(302, "Location", "/done")}, true},
		{"303 stays pending", []func(http.ResponseWriter, *http.Request){status(303, "Location", "/done")}, true},
		{"307 stays pending", []func(http.ResponseWriter, *http.Request){status(307, "Location", "/elsewhere")}, true},
		{"308 stays pending", []func(http.ResponseWriter, *http.Request){status(308, "Location", "/elsewhere")}, true},
		// Asks for the request to be sent elsewhere, but says not where.
		{"307 without a Location stays pending", []func(http.ResponseWriter, *http.Request){status(307)}, true},
		// http.Client follows none of these.
		{"300 with a Location releases", []func(http.ResponseWriter, *http.Request){status(300, "Location", "/choice")}, false},
		{"retried then 2xx releases", []func(http.ResponseWriter, *http.Request){status(503), status(200)}, false},
		{"non-retryable 4xx releases", []func(http.ResponseWriter, *http.Request){status(422)}, false},
		{"plain 409 releases", []func(http.ResponseWriter, *http.Request){status(409)}, false},
		{"409 with an invalid Retry-After releases", []func(http.ResponseWriter, *http.Request){status(409, "Retry-After", "later")}, false},
		{"exhausted 5xx stays pending", []func(http.ResponseWriter, *http.Request){status(503)}, true},
		{"exhausted 429 stays pending", []func(http.ResponseWriter, *http.Request){status(429)}, true},
		{"exhausted in-progress 409 stays pending", []func(http.ResponseWriter, *http.Request){status(409, "Retry-After", "0")}, true},
		{"non-retryable 5xx stays pending", []func(http.ResponseWriter, *http.Request){status(501)}, true},
		{"lost connections stay pending", []func(http.ResponseWriter, *http.Request){hangUp}, true},
	}
}

func TestOperationKeyLifecycle(t *testing.T) {
	for _, tt := range lifecycleCases() {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, tt.reply...)
			store := NewMemoryKeyStore()
			tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithBackoff(noWait), WithMaxAttempts(2))
			ctx := WithOperation(context.Background(), "order-1")

			resp, err := tr.RoundTrip(post(t, ctx, srv.URL, "x"))
			if err == nil {
				resp.Body.Close()
			}

			pending, perr := store.Pending(context.Background())
			require.NoError(t, perr)
			if !tt.wantPending {
				assert.Empty(t, pending)
				return
			}
			require.Len(t, pending, 1)
			assert.Equal(t, "order-1", pending[0].Operation)
			assert.Equal(t, srv.keys()[0], pending[0].Key)
		})
	}
}

// An operation whose retries ran out sends the same key on the next call,
// and a new key once it has completed.
func TestOperationReusesKeyAcrossCalls(t *testing.T) {
	srv := newServer(t, status(503), status(503), status(200), status(200))
	store := NewMemoryKeyStore()
	tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithBackoff(noWait), WithMaxAttempts(2))
	ctx := WithOperation(context.Background(), "payment-9")

	assert.Equal(t, 503, do(t, tr, post(t, ctx, srv.URL, "x")).StatusCode)
	assert.Equal(t, 200, do(t, tr, post(t, ctx, srv.URL, "x")).StatusCode)
	do(t, tr, post(t, ctx, srv.URL, "x")) // a new operation under the same id

	keys := srv.keys()
	require.Len(t, keys, 4)
	assert.Equal(t, keys[0], keys[1])
	assert.Equal(t, keys[0], keys[2], "the second call reused the pending key")
	assert.NotEqual(t, keys[0], keys[3], "a completed operation's key is not reused")
}

func TestOperationsGetDistinctKeys(t *testing.T) {
	srv := newServer(t, status(503))
	store := NewMemoryKeyStore()
	tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithBackoff(noWait), WithMaxAttempts(1))
	do(t, tr, post(t, WithOperation(context.Background(), "a"), srv.URL, "x"))
	do(t, tr, post(t, WithOperation(context.Background(), "b"), srv.URL, "x"))
	keys := srv.keys()
	require.Len(t, keys, 2)
	assert.NotEqual(t, keys[0], keys[1])
}

func TestCanceledOperationStaysPending(t *testing.T) {
	ctx, cancel := context.WithCancel(WithOperation(context.Background(), "op"))
	store := NewMemoryKeyStore()
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		cancel()
		return nil, r.Context().Err()
	})
	_, err := NewTransport(base, WithKeyStore(store)).RoundTrip(post(t, ctx, "http://x.invalid", "x"))
	require.ErrorIs(t, err, context.Canceled)
	pending, err := store.Pending(context.Background())
	require.NoError(t, err)
	assert.Len(t, pending, 1)
}

func TestKeyStoreFailureSendsNothing(t *testing.T) {
	srv := newServer(t, status(200))
	boom := errors.New("disk full")
	var logs bytes.Buffer
	tr := NewTransport(newBaseTransport(t), WithKeyStore(&failingStore{err: boom}),
		WithLogger(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))))

	resp, err := tr.RoundTrip(post(t, WithOperation(context.Background(), "op"), srv.URL, "x"))

	assert.Nil(t, resp)
	assert.ErrorIs(t, err, boom)
	assert.ErrorIs(t, err, ErrKeyStore)
	var re *RetryError
	require.ErrorAs(t, err, &re)
	assert.Zero(t, re.Attempts)
	assert.Zero(t, srv.hits.Load())
	assert.Contains(t, logs.String(), `level=WARN msg="idemhttp: no idempotency key, nothing sent"`)
	assert.Contains(t, logs.String(), "disk full")
}

// A key the caller set is the caller's to keep: the KeyStore does not
// record it, even when the outcome is not final and a key of the store's
// would stay pending.
func TestCallerKeyIgnoresOperation(t *testing.T) {
	srv := newServer(t, status(503))
	store := NewMemoryKeyStore()
	req := post(t, WithOperation(context.Background(), "op"), srv.URL, "x")
	req.Header.Set("Idempotency-Key", "caller-key")
	resp := do(t, NewTransport(newBaseTransport(t), WithKeyStore(store), WithMaxAttempts(1)), req)
	resp.Body.Close()
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Equal(t, []string{"caller-key"}, srv.keys())
	pending, _ := store.Pending(context.Background())
	assert.Empty(t, pending)
}

func TestReleaseFailureStillReturnsResponse(t *testing.T) {
	srv := newServer(t, status(200))
	var logs bytes.Buffer
	store := &releaseFails{MemoryKeyStore: NewMemoryKeyStore()}
	tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	resp := do(t, tr, post(t, WithOperation(context.Background(), "op"), srv.URL, "x"))
	assert.Equal(t, 200, resp.StatusCode)
	assert.Contains(t, logs.String(), "releasing key")
}

type releaseFails struct{ *MemoryKeyStore }

func (releaseFails) Release(context.Context, string, string) error { return errors.New("no") }

func TestOperationFromContext(t *testing.T) {
	_, ok := OperationFrom(context.Background())
	assert.False(t, ok)
	id, ok := OperationFrom(WithOperation(context.Background(), "x"))
	assert.True(t, ok)
	assert.Equal(t, "x", id)
}

func TestMemoryKeyStore(t *testing.T) {
	ctx := context.Background()
	s := NewMemoryKeyStore()

	key, err := s.Acquire(ctx, "a", "k1")
	require.NoError(t, err)
	assert.Equal(t, "k1", key)
	key, err = s.Acquire(ctx, "a", "k2")
	require.NoError(t, err)
	assert.Equal(t, "k1", key, "a pending key wins over a new candidate")

	require.NoError(t, s.Release(ctx, "a", "stale-key"))
	key, _ = s.Acquire(ctx, "a", "k3")
	assert.Equal(t, "k1", key, "releasing another key leaves the pending one")

	require.NoError(t, s.Release(ctx, "a", "k1"))
	require.NoError(t, s.Release(ctx, "never", "k"))
	key, _ = s.Acquire(ctx, "a", "k4")
	assert.Equal(t, "k4", key)

	_, err = s.Acquire(ctx, "", "k")
	assert.ErrorIs(t, err, ErrInvalidOperation)
	_, err = s.Acquire(ctx, strings.Repeat("x", MaxOperationIDLen+1), "k")
	assert.ErrorIs(t, err, ErrInvalidOperation)

	canceled, cancel := context.WithCancel(ctx)
	cancel()
	_, err = s.Acquire(canceled, "b", "k")
	assert.ErrorIs(t, err, context.Canceled)
}

func TestMemoryKeyStorePendingOrder(t *testing.T) {
	ctx := context.Background()
	var s MemoryKeyStore // the zero value works
	tick := 0
	s.now = func() time.Time { tick++; return time.Unix(int64(100-tick), 0) }
	for _, op := range []string{"first", "second", "third"} {
		_, err := s.Acquire(ctx, op, "key-"+op)
		require.NoError(t, err)
	}
	pending, err := s.Pending(ctx)
	require.NoError(t, err)
	var ops []string
	for _, p := range pending {
		ops = append(ops, p.Operation)
	}
	assert.Equal(t, []string{"third", "second", "first"}, ops, "oldest first")
}

func TestMemoryKeyStoreConcurrentAcquireAgrees(t *testing.T) {
	s := NewMemoryKeyStore()
	const goroutines = 64
	keys := make([]string, goroutines)
	var wg sync.WaitGroup
	for i := range goroutines {
		wg.Go(func() {
			k, err := s.Acquire(context.Background(), "same", strings.Repeat("k", i+1))
			assert.NoError(t, err)
			keys[i] = k
		})
	}
	wg.Wait()
	for _, k := range keys {
		assert.Equal(t, keys[0], k)
	}
}

// A stale operation is only marked: the Transport still sends its key when
// the operation is called again, as the documentation of WithStaleAfter
// says, so that reconciling it is the caller's decision.
func TestStaleOperationKeepsItsKey(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var keys []string
		code := http.StatusServiceUnavailable
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			keys = append(keys, r.Header.Get(DefaultKeyHeader))
			return okResponse(r, code), nil
		})
		store := &MemoryKeyStore{StaleAfter: time.Hour}
		tr := NewTransport(base, WithKeyStore(store), WithMaxAttempts(1))
		ctx := WithOperation(context.Background(), "order-1")

		resp := do(t, tr, post(t, ctx, "http://x.invalid", "x"))
		resp.Body.Close()
		time.Sleep(2 * time.Hour)
		pending, err := store.Pending(context.Background())
		require.NoError(t, err)
		require.Len(t, pending, 1)
		assert.True(t, pending[0].Stale)

		code = http.StatusCreated
		resp = do(t, tr, post(t, ctx, "http://x.invalid", "x"))
		resp.Body.Close()
		require.Len(t, keys, 2)
		assert.Equal(t, keys[0], keys[1], "the stale key is sent again")
		assert.Empty(t, pendingKeys(t, store))
	})
}
