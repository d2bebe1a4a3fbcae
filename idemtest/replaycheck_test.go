package idemtest

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// TestWrongReplayCheckedBeforeClientSeesIt checks that a replay is checked
// before any of it reaches the client: a client that takes the status of a
// wrong replay and closes its body at once, and a test that asserts as
// soon as the client is done, must see the wrong replay in the assertion.
// A replay too large for the server's buffers reaches the client while
// the middleware is still writing it.
func TestWrongReplayCheckedBeforeClientSeesIt(t *testing.T) {
	big := strings.Repeat("r", 512<<10)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, big)
	})
	store := memoryStore(t, func(s idemserver.Store) idemserver.Store {
		return tamperingStore{s, func(r *idemserver.Response) { r.Body = bytes.ToUpper(r.Body) }}
	})
	srv := NewServer(h, WithStore(store))
	defer srv.Close()
	client := rawClient()
	defer client.CloseIdleConnections()
	require.Equal(t, http.StatusCreated, post(t.Context(), client, srv.URL, "k").status)

	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/charges", strings.NewReader(`{"amount":100}`))
	require.NoError(t, err)
	req.Header.Set(idemserver.DefaultKeyHeader, "k")
	resp, err := client.Do(req)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Equal(t, "true", resp.Header.Get(idemserver.ReplayedHeader))
	resp.Body.Close() // the client takes the status and goes

	rec := &recordingTB{TB: t}
	assert.False(t, srv.AssertExactlyOnce(rec, 1), "the wrong replay reached the client unchecked")
	assert.Len(t, srv.WrongReplays(), 1)
}
