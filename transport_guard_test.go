package idemhttp

import (
	"context"
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
	synctest.Test(t, func(t *testing.T) {
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			return &http.Response{StatusCode: 200, Body: http.NoBody, Request: r}, nil
		})
		var elapsed []time.Duration
		tr := NewTransport(base,
			WithKeyGenerator(func() (string, error) {
				time.Sleep(2 * time.Second) // a remote ID service
				return "k-1", nil
			}),
			WithAttemptHook(func(a Attempt) { elapsed = append(elapsed, a.Elapsed) }))

		req, err := http.NewRequest(http.MethodPost, "http://pay.example/charge", nil)
		require.NoError(t, err)
		resp, err := tr.RoundTrip(req)
		require.NoError(t, err)
		resp.Body.Close()

		// The attempt itself took no time on the bubble's clock.
		assert.Equal(t, []time.Duration{0}, elapsed)
	})
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
