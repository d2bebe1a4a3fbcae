package idemtest

import (
	"context"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStatsCountOnlyInjectedFaults checks that a fault is counted only when
// it was injected: a request whose client gives up during its delay meets
// no fault (the handler does not run, no response is lost), so a test that
// checks Stats to prove it exercised lost responses cannot pass on faults
// that never happened.
func TestStatsCountOnlyInjectedFaults(t *testing.T) {
	for _, tt := range []struct {
		name   string
		faults Faults
	}{
		{"lost response", Faults{LoseResponse: 1}},
		{"reset before", Faults{ResetBefore: 1}},
		{"cut body", Faults{CutBody: 1}},
		{"unavailable", Faults{Unavailable: 1}},
		{"too many requests", Faults{TooManyRequests: 1}},
		{"stall", Faults{Stall: 1}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := tt.faults
			f.Latency, f.MinLatency, f.MaxLatency = 1, time.Hour, time.Hour
			var runs atomic.Int32
			srv := NewServer(countRuns(created, &runs), WithFaults(f), WithSeed(1))
			defer srv.Close()
			client := rawClient()
			defer client.CloseIdleConnections()
			// The client gives up once the request is being delayed.
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			sent := make(chan outcome, 1)
			go func() { sent <- post(ctx, client, srv.URL, "k") }()
			require.Eventually(t, func() bool { return srv.Stats().Requests == 1 }, 10*time.Second, time.Millisecond)
			cancel()
			require.True(t, (<-sent).err)
			srv.Close() // waits for the request to end
			assert.Zero(t, runs.Load())
			assert.Equal(t, Stats{Requests: 1, Delayed: 1}, srv.Stats(),
				"the client left during the delay: no fault was injected")
		})
	}
}

// countRuns counts the runs of h in runs.
func countRuns(h http.Handler, runs *atomic.Int32) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		h.ServeHTTP(w, r)
	})
}

// TestCutBodyWithoutBodyCountsALostResponse checks that a response that
// cannot have a body, which the injector loses whole instead of cutting,
// is counted as a lost response, not as a cut body that never happened.
func TestCutBodyWithoutBodyCountsALostResponse(t *testing.T) {
	for _, tt := range []struct {
		name   string
		method string
		status int
	}{
		{"204", http.MethodPost, http.StatusNoContent},
		{"HEAD", http.MethodHead, http.StatusCreated},
		{"201", http.MethodPost, http.StatusCreated},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(tt.status)
				_, _ = w.Write([]byte("body"))
			})
			srv := NewServer(h, WithFaults(Faults{CutBody: 1}), WithSeed(1))
			defer srv.Close()
			client := rawClient()
			defer client.CloseIdleConnections()
			req, err := http.NewRequestWithContext(t.Context(), tt.method, srv.URL+"/x", nil)
			require.NoError(t, err)
			req.Header.Set("Idempotency-Key", "k")
			resp, err := client.Do(req)
			if err == nil {
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			require.Error(t, err)
			want := Stats{Requests: 1, CutBodies: 1}
			if !bodyAllowed(tt.status) || tt.method == http.MethodHead {
				want = Stats{Requests: 1, LostResponses: 1}
			}
			assert.Equal(t, want, srv.Stats())
		})
	}
}
