package idemhttp

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// failingWriteConn is a connection whose writes fail, writing nothing,
// once fail is set.
type failingWriteConn struct {
	net.Conn
	fail *atomic.Bool
}

func (c failingWriteConn) Write(p []byte) (int, error) {
	if c.fail.Load() {
		return 0, errors.New("write refused")
	}
	return c.Conn.Write(p)
}

// net/http also sends a request again by itself when not a byte of it
// could be written to a reused connection. The Transport cannot tell that
// resend from one whose first send reached the server, so a 4xx answering
// it keeps the key pending, as it must for the other. That costs a call,
// not a charge: the next call sends the key again and gets the server's
// replay of the 4xx, which is final.
func TestKeyResentAfterNothingWasWrittenSettlesOnTheReplay(t *testing.T) {
	var executions atomic.Int32
	refuse := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		executions.Add(1)
		w.WriteHeader(http.StatusUnprocessableEntity)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/warm" {
			return
		}
		refuse.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	// Each connection has its own switch; the warm one's is kept.
	var warmFail atomic.Pointer[atomic.Bool]
	base := newBaseTransport(t)
	var dialer net.Dialer
	base.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		fail := new(atomic.Bool)
		warmFail.CompareAndSwap(nil, fail)
		return failingWriteConn{Conn: conn, fail: fail}, nil
	}
	warm, err := base.RoundTrip(httptestGet(t, srv.URL+"/warm"))
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, warm.Body)
	warm.Body.Close()
	warmFail.Load().Store(true)

	store := NewMemoryKeyStore()
	tr := NewTransport(base, WithKeyStore(store), WithMaxAttempts(1))
	call := func() *http.Response {
		return do(t, tr, post(t, WithOperation(context.Background(), "order-1"), srv.URL+"/charge", "charge"))
	}
	resp := call()
	require.Equal(t, http.StatusUnprocessableEntity, resp.StatusCode)
	require.EqualValues(t, 1, executions.Load())
	require.Len(t, pendingKeys(t, store), 1, "the resend's 4xx cannot be told from one after a send that arrived")

	resp = call()
	require.Equal(t, http.StatusUnprocessableEntity, resp.StatusCode)
	assert.Equal(t, "true", resp.Header.Get("Idempotent-Replayed"))
	assert.Empty(t, pendingKeys(t, store), "the replay is final")
	assert.EqualValues(t, 1, executions.Load())
}
