package idemtest

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestResetsReachKeepAliveClient sends keyed requests one after another over
// a keep-alive connection pool, as Server.Client and most clients do. Every
// reset the injector makes must reach the client: net/http sends a request
// that carries an Idempotency-Key again by itself when a reused connection
// fails before the first byte of the response, so a reset without a byte
// of response would never reach the code under test.
func TestResetsReachKeepAliveClient(t *testing.T) {
	for name, start := range servers() {
		t.Run(name, func(t *testing.T) {
			srv := start(t, Faults{ResetBefore: .2, LoseResponse: .2}, 13)
			client := &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
			defer client.CloseIdleConnections()
			seen := 0
			for i := range 40 {
				for post(t.Context(), client, srv.url, fmt.Sprintf("k-%d", i)).err {
					seen++
				}
			}
			st := srv.stats()
			assert.Positive(t, st.ResetBefore)
			assert.Positive(t, st.LostResponses)
			assert.Equal(t, st.ResetBefore+st.LostResponses, seen,
				"resets the client saw, of %d before the handler and %d after it", st.ResetBefore, st.LostResponses)
			assert.Equal(t, st.Requests, 40+seen, "requests sent again without the client's knowledge")
		})
	}
}

// TestNewKeyPerAttemptCaught is the client bug the lost response exists to
// catch: a retry loop that makes a new key for each attempt executes an
// operation whose response was lost a second time.
func TestNewKeyPerAttemptCaught(t *testing.T) {
	srv := NewServer(created, WithSeed(13), WithFaults(Faults{LoseResponse: .3}))
	defer srv.Close()
	client := &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
	defer client.CloseIdleConnections()
	const operations = 5
	for i := range operations {
		for a := 0; post(t.Context(), client, srv.URL, fmt.Sprintf("op-%d-attempt-%d", i, a)).err; a++ {
		}
	}
	assert.Positive(t, srv.Stats().LostResponses)
	rec := &recordingTB{TB: t}
	assert.False(t, srv.AssertExactlyOnce(rec, operations), "executions %v", srv.Executions())
	assert.NotEmpty(t, rec.errors)
}
