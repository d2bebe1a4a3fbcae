package idemtest

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLedgerSkipsReleasedRuns checks the runs after which the middleware
// releases the key although the handler answered below 500: a 499 (the
// client went away), and a return without a status once the request's
// context ended. The retry that runs the handler again is what the
// middleware promises, not a duplicate.
func TestLedgerSkipsReleasedRuns(t *testing.T) {
	var calls atomic.Int32
	entered, left := make(chan struct{}), make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch calls.Add(1) {
		case 1:
			w.WriteHeader(499)
		case 2:
			defer close(left)
			close(entered)
			<-r.Context().Done() // gives up without acting
		default:
			w.WriteHeader(http.StatusCreated)
		}
	})
	srv := NewServer(h)
	defer srv.Close()
	client := rawClient()
	defer client.CloseIdleConnections()

	assert.Equal(t, outcome{status: 499}, post(t.Context(), client, srv.URL, "k"))
	ctx, giveUp := context.WithCancel(t.Context())
	go func() { <-entered; giveUp() }()
	assert.True(t, post(ctx, client, srv.URL, "k").err)
	<-left
	var o outcome
	for o = post(t.Context(), client, srv.URL, "k"); o.status == http.StatusConflict; {
		o = post(t.Context(), client, srv.URL, "k") // the release may still be on its way
	}
	require.Equal(t, outcome{status: http.StatusCreated}, o)
	assert.Equal(t, outcome{status: http.StatusCreated, replayed: true}, post(t.Context(), client, srv.URL, "k"))

	assert.Equal(t, map[string]int{"k": 1}, srv.Executions())
	assert.Empty(t, srv.Duplicates())
	assert.True(t, srv.AssertExactlyOnce(t, 1))
}
