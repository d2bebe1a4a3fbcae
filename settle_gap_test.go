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

// payHeld pays operation "order-1" with HoldKey through client, as a
// program does: read the outcome, save it, settle, and call again when
// Settle says the outcome was not final. It returns the body it saved.
func payHeld(t *testing.T, client *http.Client, url string) string {
	t.Helper()
	for range 3 {
		resp, err := client.Do(post(t, heldCtx(), url, "charge"))
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			continue
		}
		err = Settle(context.Background(), resp)
		if err == nil {
			return string(body)
		}
		require.ErrorIs(t, err, ErrNotFinal)
	}
	t.Fatal("never settled")
	return ""
}

// Another call of an operation made with HoldKey runs whole in the gap
// between a redirect of the first call and the request that follows it,
// and settles the key. The first call's outcome is final all the same
// (the server's answer to the key), but must release nothing: the key is
// the other call's. Settle says so with nil. Were it to answer ErrNotFinal,
// the caller would call again, under a new key since the other call
// settled, and be charged a second time.
func TestSettleOfACallThatSharedItsKeyInARedirectsGap(t *testing.T) {
	for _, code := range []int{http.StatusSeeOther, http.StatusTemporaryRedirect} {
		t.Run(http.StatusText(code), func(t *testing.T) {
			var executions atomic.Int32
			charge := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				executions.Add(1)
				w.Header().Set("Location", "/receipt")
				w.WriteHeader(code)
			}))
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/receipt" {
					_, _ = io.Copy(io.Discard, r.Body)
					io.WriteString(w, "paid")
					return
				}
				charge.ServeHTTP(w, r)
			}))
			t.Cleanup(srv.Close)
			store := NewMemoryKeyStore()
			tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithMaxAttempts(1))

			var other string
			first := &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error {
				if other == "" {
					// Another part of the program pays the order now, and
					// settles.
					other = payHeld(t, &http.Client{Transport: tr}, srv.URL+"/charge")
				}
				return nil
			}}
			assert.Equal(t, "paid", payHeld(t, first, srv.URL+"/charge"))
			assert.Equal(t, "paid", other)
			assert.EqualValues(t, 1, executions.Load(), "charged once")
			assert.Empty(t, pendingKeys(t, store))
		})
	}
}

// When the other call's outcome is lost, the first call's Settle leaves
// the key pending for it: its next call gets the server's replay.
func TestSettleOfACallThatSharedItsKeyLeavesItPending(t *testing.T) {
	var executions atomic.Int32
	charge := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		executions.Add(1)
		w.Header().Set("Location", "/receipt")
		w.WriteHeader(http.StatusSeeOther)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/receipt" {
			io.WriteString(w, "paid")
			return
		}
		charge.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	base := losingMarked(newBaseTransport(t))
	store := NewMemoryKeyStore()
	tr := NewTransport(base, WithKeyStore(store), WithMaxAttempts(1))

	var otherErr error
	first := &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error {
		if otherErr == nil {
			req := post(t, heldCtx(), srv.URL+"/charge", "charge")
			req.Header.Set(faultHeader, "lost")
			_, otherErr = (&http.Client{Transport: tr}).Do(req)
		}
		return nil
	}}
	assert.Equal(t, "paid", payHeld(t, first, srv.URL+"/charge"))
	require.ErrorIs(t, otherErr, io.ErrUnexpectedEOF)
	pending := pendingKeys(t, store)
	require.Len(t, pending, 1, "the other call's caller has no outcome: the key stays pending")

	assert.Equal(t, "paid", payHeld(t, &http.Client{Transport: tr}, srv.URL+"/charge"), "its next call gets the replay")
	assert.EqualValues(t, 1, executions.Load(), "charged once")
	assert.Empty(t, pendingKeys(t, store))
}
