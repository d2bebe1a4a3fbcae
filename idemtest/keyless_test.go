package idemtest

import (
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// TestKeyDroppedOnRetryCaught is a client bug the ledger must not hide: a
// retry loop that sends the key on the first attempt only executes an
// operation whose response was lost a second time, without a key. The
// second run is no key's, yet it is an execution of the operation.
func TestKeyDroppedOnRetryCaught(t *testing.T) {
	var runs atomic.Int32
	srv := NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		created.ServeHTTP(w, r)
	}), WithSeed(13), WithFaults(Faults{LoseResponse: .5}))
	defer srv.Close()
	client := rawClient()
	defer client.CloseIdleConnections()
	send := func(key string) error {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/charges", strings.NewReader("{}"))
		require.NoError(t, err)
		if key != "" {
			req.Header.Set(idemserver.DefaultKeyHeader, key)
		}
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		return resp.Body.Close()
	}
	const operations = 8
	for i := range operations {
		key := fmt.Sprintf("op-%d", i)
		for send(key) != nil {
			key = "" // the bug: the retry goes without the key
		}
	}
	require.Positive(t, srv.Stats().LostResponses)
	require.Greater(t, int(runs.Load()), operations, "the bug ran no operation twice")
	rec := &recordingTB{TB: t}
	assert.False(t, srv.AssertExactlyOnce(rec, operations), "executions %v", srv.Executions())
	require.Len(t, rec.errors, 1)
	assert.Contains(t, rec.errors[0], "without an idempotency key")
}

// TestKeylessSafeRequestsNotCounted checks that requests a client need not
// key, such as GETs, leave the assertion alone.
func TestKeylessSafeRequestsNotCounted(t *testing.T) {
	srv := NewServer(created)
	defer srv.Close()
	client := rawClient()
	defer client.CloseIdleConnections()
	for _, method := range []string{http.MethodGet, http.MethodHead, http.MethodPut, http.MethodDelete, http.MethodOptions} {
		req, err := http.NewRequestWithContext(t.Context(), method, srv.URL+"/charges", strings.NewReader("x"))
		require.NoError(t, err)
		resp, err := client.Do(req)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
	}
	require.Equal(t, http.StatusCreated, post(t.Context(), client, srv.URL, "k").status)
	assert.True(t, srv.AssertExactlyOnce(t, 1))
}
