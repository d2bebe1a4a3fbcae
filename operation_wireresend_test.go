package idemhttp

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// net/http sends a request carrying an Idempotency-Key again by itself,
// on a new connection, when a reused one is closed before any byte of the
// response: the server may have read the request and acted on it. The
// Transport sees one attempt, but the key has reached the server before
// the send that is answered, so a 4xx that is not the server's replay
// (a layer in front of the server's idempotency refusing the resend) is
// not the key's outcome: the key stays pending, and the next call gets
// the replay of what the first send did.
func TestKeyResentByNetHTTPKeepsA4xxPending(t *testing.T) {
	for _, body := range []string{"charge", ""} {
		name := "with a body"
		if body == "" {
			name = "without a body"
		}
		t.Run(name, func(t *testing.T) {
			var (
				mu         sync.Mutex
				arrivals   = map[string]int{}
				executions atomic.Int32
			)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				if r.URL.Path == "/warm" {
					return
				}
				key := r.Header.Get(DefaultKeyHeader)
				mu.Lock()
				arrivals[key]++
				n := arrivals[key]
				mu.Unlock()
				if n == 1 {
					// The charge runs, and the connection dies before
					// the response is written.
					executions.Add(1)
					conn, _, err := http.NewResponseController(w).Hijack()
					if err == nil {
						conn.Close()
					}
					return
				}
				// The resend is refused by a layer in front of the
				// server's idempotency.
				w.WriteHeader(http.StatusUnauthorized)
			}))
			t.Cleanup(srv.Close)
			base := newBaseTransport(t)
			warm, err := base.RoundTrip(httptestGet(t, srv.URL+"/warm"))
			require.NoError(t, err)
			_, _ = io.Copy(io.Discard, warm.Body)
			warm.Body.Close()

			store := NewMemoryKeyStore()
			tr := NewTransport(base, WithKeyStore(store), WithMaxAttempts(1))
			resp := do(t, tr, post(t, WithOperation(context.Background(), "order-1"), srv.URL+"/charge", body))
			require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
			mu.Lock()
			require.Len(t, arrivals, 1)
			for k, n := range arrivals {
				require.Equal(t, 2, n, "net/http sent the key twice")
				assert.Equal(t, map[string]string{"order-1": k}, pendingKeys(t, store),
					"the key reached the server before the 401: it stays pending")
			}
			mu.Unlock()
			assert.EqualValues(t, 1, executions.Load())
		})
	}
}

func httptestGet(t *testing.T, url string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	return req
}
