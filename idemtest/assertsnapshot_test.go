package idemtest

import (
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestAssertExactlyOnceWhileADuplicateEnds checks that AssertExactlyOnce
// reads the ledger at one instant: a key's second run that ends while the
// assertion is being made must show either as a run in progress or as a
// duplicate, never as neither. Each round asserts over and over while the
// duplicate run ends.
func TestAssertExactlyOnceWhileADuplicateEnds(t *testing.T) {
	for round := range 100 {
		duplicateEnds(t, round)
	}
}

func duplicateEnds(t *testing.T, round int) {
	var runs atomic.Int32
	release := make(chan struct{})
	releaseOnce := sync.OnceFunc(func() { close(release) })
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if runs.Add(1) == 2 {
			<-release
		}
		w.WriteHeader(http.StatusCreated)
	})
	// The store forgets keys: the second request with the key runs the
	// handler again.
	srv := NewServer(h, WithStore(forgetfulStore{}))
	defer srv.Close()
	client := rawClient()
	defer client.CloseIdleConnections()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer releaseOnce()

	require.Equal(t, http.StatusCreated, post(t.Context(), client, srv.URL, "k").status)
	wg.Go(func() { post(t.Context(), client, srv.URL, "k") })
	require.Eventually(t, func() bool { return runs.Load() == 2 }, 10*time.Second, time.Millisecond)
	releaseOnce()
	for {
		rec := &recordingTB{TB: t}
		require.False(t, srv.AssertExactlyOnce(rec, 1), "round %d: the assertion passed while key k ran twice", round)
		if _, n := srv.ledger.inProgress(); n == 0 && srv.Executions()["k"] == 2 {
			return
		}
	}
}
