package idemtest

import (
	"context"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// unrenewingStore is a store whose leases cannot be extended: a handler
// that runs longer than its lease loses its key to a takeover.
type unrenewingStore struct{ idemserver.Store }

func (unrenewingStore) Extend(context.Context, idemserver.Key, string, time.Time) error {
	return idemserver.ErrLeaseLost
}

// TestLedgerCountsRunsAfterATakeover checks that a run whose key was taken
// over while it ran is counted: a handler that ignores its cancelled
// context and acts anyway, while the request that took its key over acts
// too, executed twice, which the assertion must show.
func TestLedgerCountsRunsAfterATakeover(t *testing.T) {
	for _, tt := range []struct {
		name   string
		answer bool // the first run answers 201; else it returns silently
	}{
		{"answers", true},
		{"returns without answering", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var runs atomic.Int32
			taken := make(chan struct{})
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				if runs.Add(1) == 1 {
					<-r.Context().Done() // the lease is lost
					<-taken              // and the key taken over
					if !tt.answer {
						return
					}
				}
				w.WriteHeader(http.StatusCreated)
			})
			srv := NewServer(h, WithStore(unrenewingStore{memoryStore(t, nil)}),
				WithMiddleware(idemserver.WithLease(50*time.Millisecond)))
			defer srv.Close()
			client := rawClient()
			defer client.CloseIdleConnections()
			var wg sync.WaitGroup
			defer wg.Wait()
			wg.Go(func() { post(t.Context(), client, srv.URL, "k") })
			require.Eventually(t, func() bool { return runs.Load() == 1 }, 10*time.Second, time.Millisecond)
			time.Sleep(100 * time.Millisecond) // the lease lapses
			require.Equal(t, http.StatusCreated, post(t.Context(), client, srv.URL, "k").status)
			require.Equal(t, int32(2), runs.Load(), "the second request took the key over")
			close(taken)
			wg.Wait()
			rec := &recordingTB{TB: t}
			assert.False(t, srv.AssertExactlyOnce(rec, 1))
			assert.Equal(t, map[string]int{"k": 2}, srv.Executions())
		})
	}
}
