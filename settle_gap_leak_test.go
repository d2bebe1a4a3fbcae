package idemhttp

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// Another call of an operation made with HoldKey runs whole in the gap
// between a redirect of the first call and the request that follows it,
// and its caller saves the outcome but settles only once the first call
// is through. The request that follows shares the key and supersedes the
// other call's outcome while it may still need the key; once its own
// outcome has reached its caller, it needs it no more, and the other
// caller's Settle releases the key. Were both Settles to leave it to the
// other, the key would stay pending with no one left to release it.
func TestSettleAfterARedirectsGapReleasesTheKey(t *testing.T) {
	for _, tc := range []struct {
		name string
		code int
		hold bool // the first call's operation is made with HoldKey too
	}{
		{"See Other", http.StatusSeeOther, true},
		{"Temporary Redirect", http.StatusTemporaryRedirect, true},
		{"See Other without HoldKey", http.StatusSeeOther, false},
		{"Temporary Redirect without HoldKey", http.StatusTemporaryRedirect, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, executions, _ := gapServer(t, tc.code)
			store := NewMemoryKeyStore()
			tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithMaxAttempts(1))

			var other *http.Response
			first := &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error {
				if other == nil {
					other = payInGap(t, tr, srv.URL)
				}
				return nil
			}}
			if tc.hold {
				assert.Equal(t, "paid", payHeld(t, first, srv.URL+"/charge"))
			} else {
				ctx := WithOperation(context.Background(), "order-1")
				resp, err := first.Do(post(t, ctx, srv.URL+"/charge", "charge"))
				require.NoError(t, err)
				assert.Equal(t, "paid", readAll(t, resp))
			}
			require.NotNil(t, other)
			require.NoError(t, Settle(context.Background(), other))
			assert.EqualValues(t, 1, executions.Load(), "charged once")
			assert.Empty(t, pendingKeys(t, store), "both callers settled: no one is left to release the key")
		})
	}
}

// When the outcome of the request that follows the redirect is cut in
// transit, the other caller's Settle still leaves the key pending: the
// first caller's next call gets the server's replay, not a second charge.
func TestSettleAfterARedirectsGapKeepsTheKeyOfACutFollower(t *testing.T) {
	srv, executions, cut := gapServer(t, http.StatusTemporaryRedirect)
	store := NewMemoryKeyStore()
	tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithMaxAttempts(1))

	var other *http.Response
	first := &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error {
		if other == nil {
			other = payInGap(t, tr, srv.URL)
			cut.Store(true) // the first call's receipt is cut
		}
		return nil
	}}
	resp, err := first.Do(post(t, heldCtx(), srv.URL+"/charge", "charge"))
	require.NoError(t, err)
	_, err = io.ReadAll(resp.Body)
	require.Error(t, err)
	resp.Body.Close()
	require.ErrorIs(t, Settle(context.Background(), resp), ErrNotFinal)

	require.NoError(t, Settle(context.Background(), other))
	require.Len(t, pendingKeys(t, store), 1, "the first caller has no outcome: the key stays pending")
	cut.Store(false)
	assert.Equal(t, "paid", payHeld(t, &http.Client{Transport: tr}, srv.URL+"/charge"))
	assert.EqualValues(t, 1, executions.Load(), "charged once")
	assert.Empty(t, pendingKeys(t, store))
}

// gapServer charges at /charge, answering with a redirect of code to
// /receipt, whose body it cuts while cut is set.
func gapServer(t *testing.T, code int) (srv *httptest.Server, executions *atomic.Int32, cut *atomic.Bool) {
	executions, cut = new(atomic.Int32), new(atomic.Bool)
	charge := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		executions.Add(1)
		w.Header().Set("Location", "/receipt")
		w.WriteHeader(code)
	}))
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/receipt" {
			charge.ServeHTTP(w, r)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		if cut.Load() {
			w.Header().Set("Content-Length", "4")
			io.WriteString(w, "pa")
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}
		io.WriteString(w, "paid")
	}))
	t.Cleanup(srv.Close)
	return srv, executions, cut
}

// payInGap pays operation "order-1" with HoldKey through tr, as another
// part of the program does in a redirect's gap: it reads the outcome in
// full and returns the response, to settle later.
func payInGap(t *testing.T, tr *Transport, url string) *http.Response {
	t.Helper()
	resp, err := (&http.Client{Transport: tr}).Do(post(t, heldCtx(), url+"/charge", "charge"))
	require.NoError(t, err)
	require.Equal(t, "paid", readAll(t, resp))
	return resp
}
