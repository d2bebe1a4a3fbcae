package idemtest

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemhttp/idemhttp"
)

func TestNewProxyErrors(t *testing.T) {
	tests := []struct {
		name, target string
		f            Faults
		want         string
	}{
		{"invalid faults", "http://127.0.0.1:1", Faults{ResetBefore: 1, Stall: .5}, "add up to 1.5"},
		{"empty target", "", Faults{}, `proxy target "" is not an http or https URL with a host`},
		{"no scheme", "127.0.0.1:8080", Faults{}, "proxy target"},
		{"other scheme", "ftp://example.com", Faults{}, `proxy target "ftp://example.com" is not an http`},
		{"no host", "http:///path", Faults{}, "is not an http or https URL with a host"},
		{"unparsable", "http://[::1", Faults{}, "proxy target: parse"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := NewProxy(tt.target, tt.f, 1)
			require.Error(t, err)
			assert.Nil(t, p)
			assert.Contains(t, err.Error(), tt.want)
		})
	}
	_, err := NewProxy("http://127.0.0.1:1", Faults{Latency: -1}, 1)
	assert.ErrorIs(t, err, ErrInvalidFaults)
}

// TestProxyTargetDown checks that a proxy whose target is down answers 502,
// which clients retry, and keeps serving.
func TestProxyTargetDown(t *testing.T) {
	srv := NewServer(created)
	url := srv.URL
	srv.Close()
	p, err := NewProxy(url, Faults{}, 1)
	require.NoError(t, err)
	defer p.Close()
	client := rawClient()
	for range 2 {
		assert.Equal(t, outcome{status: http.StatusBadGateway}, post(t.Context(), client, p.URL(), "k"))
	}
	assert.Equal(t, 2, p.Stats().Requests)
}

// TestProxyLosesResponsesAndCountsReplays runs an idemhttp client through a
// proxy that drops half the responses: every operation executes once, and
// the proxy counts the replays that came back through it.
func TestProxyLosesResponsesAndCountsReplays(t *testing.T) {
	srv := NewServer(created)
	defer srv.Close()
	p, err := NewProxy(srv.URL, Faults{LoseResponse: .5}, 11)
	require.NoError(t, err)
	defer p.Close()
	client := srv.Client(idemhttp.WithMaxAttempts(30), idemhttp.WithBudget(nil), idemhttp.WithoutBreaker(),
		idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, time.Millisecond)))
	defer client.CloseIdleConnections()
	const operations = 20
	for i := range operations {
		ctx := idemhttp.WithOperation(t.Context(), fmt.Sprint(i))
		require.Equal(t, http.StatusCreated, post(ctx, client, p.URL(), fmt.Sprint(i)).status)
	}
	srv.AssertExactlyOnce(t, operations)
	st := p.Stats()
	assert.Positive(t, st.LostResponses)
	// Each lost response was retried until one got through; every attempt
	// after the first execution was a replay.
	assert.Equal(t, st.Requests-operations, st.Replayed)
}

// TestProxyCloseEndsStalls checks that Close ends a stall whose client would
// wait for ever, and that no goroutine outlives Close.
func TestProxyCloseEndsStalls(t *testing.T) {
	srv := NewServer(created)
	defer srv.Close()
	p, err := NewProxy(srv.URL, Faults{Stall: 1}, 1)
	require.NoError(t, err)
	client := rawClient()
	done := make(chan outcome)
	go func() { done <- post(context.Background(), client, p.URL(), "k") }()
	require.Eventually(t, func() bool { return p.Stats().Stalled == 1 }, 10*time.Second, time.Millisecond)
	select {
	case o := <-done:
		t.Fatalf("stalled request answered: %+v", o)
	default:
	}
	require.NoError(t, p.Close())
	assert.Equal(t, outcome{err: true}, <-done)
	require.NoError(t, p.Close()) // idempotent
	srv.Close()
	goleak.VerifyNone(t)
	assert.Empty(t, srv.Executions())
}
