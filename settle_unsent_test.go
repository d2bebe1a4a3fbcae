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

// A later call of the operation that ends with nothing sent (here its
// context ended before the KeyStore gave it the key) supersedes a held
// outcome all the same: its caller may have sent the key in an earlier
// call whose outcome it never learnt, and calls again for that reason.
// Were the held outcome's Settle to release the key, that caller's next
// call would go out under a new key and be charged a second time.
func TestSettleAfterALaterCallThatSentNothingKeepsTheKey(t *testing.T) {
	var executions atomic.Int32
	pay := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		executions.Add(1)
		io.WriteString(w, "paid")
	}))
	srv := httptest.NewServer(pay)
	t.Cleanup(srv.Close)
	base := losingMarked(newBaseTransport(t))
	store := NewMemoryKeyStore()
	tr := NewTransport(base, WithKeyStore(store), WithMaxAttempts(1))
	op := func() context.Context { return WithOperation(context.Background(), "order-1") }

	// One part of the program pays; the response is lost.
	lost := post(t, op(), srv.URL, "charge")
	lost.Header.Set(faultHeader, "lost")
	_, err := tr.RoundTrip(lost)
	require.Error(t, err)

	// Another pays with HoldKey, gets the replay and saves it.
	held, err := tr.RoundTrip(post(t, heldCtx(), srv.URL, "charge"))
	require.NoError(t, err)
	require.Equal(t, "paid", readAll(t, held))

	// The first calls again, but its context has ended: nothing is sent.
	ctx, cancel := context.WithCancel(op())
	cancel()
	_, err = tr.RoundTrip(post(t, ctx, srv.URL, "charge"))
	require.Error(t, err)

	require.NoError(t, Settle(context.Background(), held))
	require.Len(t, pendingKeys(t, store), 1, "the first caller may need the key still")

	// It calls again, and gets the replay.
	resp, err := tr.RoundTrip(post(t, op(), srv.URL, "charge"))
	require.NoError(t, err)
	assert.Equal(t, "paid", readAll(t, resp))
	assert.EqualValues(t, 1, executions.Load(), "charged once")
}
