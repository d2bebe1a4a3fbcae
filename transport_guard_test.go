package idemhttp

import (
	"context"
	"io"
	"net/http"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// taggedContext is a context.Context of a struct type holding a map, as a
// tracing or tenancy library may pass by value. Nothing in the
// context.Context contract asks for a comparable type.
type taggedContext struct {
	context.Context
	tags map[string]string
}

// A keyed request whose context is of an uncomparable type is sent like
// any other: the Transport never compares contexts with ==, which panics at
// run time for such a type.
func TestKeyedRequestWithUncomparableContextDoesNotPanic(t *testing.T) {
	srv := newServer(t, status(200))
	tr := NewTransport(newBaseTransport(t), WithBackoff(noWait))
	ctx := taggedContext{Context: context.Background(), tags: map[string]string{"tenant": "a"}}

	var resp *http.Response
	require.NotPanics(t, func() {
		resp = do(t, tr, post(t, ctx, srv.URL, "charge"))
	})
	assert.Equal(t, 200, resp.StatusCode)
	require.Len(t, srv.keys(), 1)
}

// Attempt.Elapsed is "how long the attempt took, up to the response
// headers": a key generator that takes time (one that asks an ID service)
// is not counted in the first attempt's, nor in the budget's and the
// breaker's view of when it was sent.
func TestFirstAttemptElapsedExcludesKeyGeneration(t *testing.T) {
	// What makes a request wait before its first attempt (a key generator
	// of the caller's, a KeyStore, the host's rate limiter) is not the
	// attempt's time: its clock starts once it is admitted.
	for _, tt := range []struct {
		name      string
		opts      []Option
		operation bool
		requests  int // the last one is measured
	}{
		{name: "key generator", requests: 1, opts: []Option{WithKeyGenerator(func() (string, error) {
			time.Sleep(2 * time.Second) // a remote ID service
			return "k-1", nil
		})}},
		{name: "KeyStore", requests: 1, operation: true, opts: []Option{WithKeyStore(slowKeyStore{NewMemoryKeyStore()})}},
		{name: "rate limiter", requests: 2, opts: []Option{WithRateLimit(0.5, 1)}}, // the second waits 2s
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
					return &http.Response{StatusCode: 200, Body: http.NoBody, Request: r}, nil
				})
				var elapsed []time.Duration
				tr := NewTransport(base, append(tt.opts,
					WithAttemptHook(func(a Attempt) { elapsed = append(elapsed, a.Elapsed) }))...)
				ctx := context.Background()
				if tt.operation {
					ctx = WithOperation(ctx, "order-1")
				}
				start := time.Now()
				for range tt.requests {
					req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://pay.example/charge", nil)
					require.NoError(t, err)
					resp, err := tr.RoundTrip(req)
					require.NoError(t, err)
					resp.Body.Close()
				}
				require.GreaterOrEqual(t, time.Since(start), 2*time.Second, "the request waited")
				// The attempt itself took no time on the bubble's clock.
				assert.Zero(t, elapsed[len(elapsed)-1])
			})
		})
	}
}

// slowKeyStore is a KeyStore whose Acquire takes two seconds.
type slowKeyStore struct{ KeyStore }

func (s slowKeyStore) Acquire(ctx context.Context, op, key string) (string, error) {
	time.Sleep(2 * time.Second)
	return s.KeyStore.Acquire(ctx, op, key)
}

func TestReadsHeaderOnly(t *testing.T) {
	// An attempt shares the caller's header map only with net/http's own
	// Transport, which reads it, and not on js, where that Transport
	// deletes the js.fetch:* fields it reads.
	for _, tt := range []struct {
		goos string
		base http.RoundTripper
		want bool
	}{
		{"linux", &http.Transport{}, true},
		{"darwin", &http.Transport{}, true},
		{"js", &http.Transport{}, false},
		{"linux", roundTripFunc(func(*http.Request) (*http.Response, error) { return nil, nil }), false},
		{"linux", struct{ *http.Transport }{&http.Transport{}}, false},
	} {
		assert.Equal(t, tt.want, readsHeaderOnly(tt.goos, tt.base), "%s %T", tt.goos, tt.base)
	}
}

// A base transport may answer with a nil Response.Body: many fakes in
// tests do, and http.Client accepts it as an empty body. The Transport
// treats it as one too, whether it holds the response for a retry, wraps
// it for an attempt timeout or for an operation's release, or returns it.
func TestBaseResponseWithNilBody(t *testing.T) {
	tests := []struct {
		name      string
		codes     []int // the base's status for each attempt
		opts      []Option
		operation bool
	}{
		{name: "retried 503", codes: []int{503, 200}},
		{name: "attempts exhausted", codes: []int{503, 503}, opts: []Option{WithMaxAttempts(2)}},
		{name: "attempt timeout", codes: []int{200}, opts: []Option{WithAttemptTimeout(time.Minute)}},
		{name: "operation", codes: []int{503, 200}, operation: true},
		{name: "operation with attempt timeout", codes: []int{200}, operation: true,
			opts: []Option{WithAttemptTimeout(time.Minute)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var n int
			base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
				code := tt.codes[min(n, len(tt.codes)-1)]
				n++
				return &http.Response{StatusCode: code, Header: http.Header{}, Request: r}, nil
			})
			store := NewMemoryKeyStore()
			opts := append([]Option{WithBackoff(noWait), WithKeyStore(store)}, tt.opts...)
			tr := NewTransport(base, opts...)
			ctx := context.Background()
			if tt.operation {
				ctx = WithOperation(ctx, "order-1")
			}
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://pay.example/charge", nil)
			require.NoError(t, err)

			var resp *http.Response
			require.NotPanics(t, func() {
				resp, err = tr.RoundTrip(req)
				require.NoError(t, err)
				body, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				assert.Empty(t, body)
				require.NoError(t, resp.Body.Close())
			})
			assert.Equal(t, tt.codes[len(tt.codes)-1], resp.StatusCode)
			assert.Equal(t, len(tt.codes), n)
			if tt.operation {
				pending, err := store.Pending(ctx)
				require.NoError(t, err)
				assert.Empty(t, pending, "a final 200 releases the operation's key")
			}
		})
	}
}
