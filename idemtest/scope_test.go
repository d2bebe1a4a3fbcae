package idemtest

import (
	"context"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// crossScopeStore is a broken store: it claims and completes per scope and
// key, but replays the response last stored for the key in any scope, so
// that one tenant's retry is told another tenant's outcome.
type crossScopeStore struct {
	store idemserver.Store

	mu   sync.Mutex
	last map[string]*idemserver.Response // per bare key
}

func (s *crossScopeStore) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	res, err := s.store.Claim(ctx, c)
	if err == nil && res.Record.Completed() {
		s.mu.Lock()
		res.Record.Response = s.last[c.Key.Key]
		s.mu.Unlock()
	}
	return res, err
}

func (s *crossScopeStore) TakeOver(ctx context.Context, c idemserver.Claim, expired string) (idemserver.ClaimResult, error) {
	return s.store.TakeOver(ctx, c, expired)
}

func (s *crossScopeStore) Complete(ctx context.Context, k idemserver.Key, token string, r *idemserver.Response, expires time.Time) error {
	err := s.store.Complete(ctx, k, token, r, expires)
	if err == nil {
		s.mu.Lock()
		s.last[k.Key] = r
		s.mu.Unlock()
	}
	return err
}

func (s *crossScopeStore) Release(ctx context.Context, k idemserver.Key, token string) error {
	return s.store.Release(ctx, k, token)
}

func (s *crossScopeStore) Extend(ctx context.Context, k idemserver.Key, token string, lease time.Time) error {
	return s.store.Extend(ctx, k, token, lease)
}

// TestReplayFromAnotherScopeCaught checks that a replay is judged against
// the answers given in its own scope: two tenants that use the same key
// make two operations, and a retry of one told the other's outcome (the
// leak scopes exist to prevent) is a wrong replay, although the handler
// did give that answer, to the other tenant.
func TestReplayFromAnotherScopeCaught(t *testing.T) {
	for _, tt := range []struct {
		name   string
		broken bool
	}{
		{"scoped store", false},
		{"store replays across scopes", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var store idemserver.Store = memoryStore(t, nil)
			if tt.broken {
				store = &crossScopeStore{store: store, last: make(map[string]*idemserver.Response)}
			}
			receipt := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, "receipt of tenant "+r.Header.Get("Tenant"))
			})
			srv := NewServer(receipt, WithStore(store), WithMiddleware(idemserver.WithScope(
				func(r *http.Request) string { return r.Header.Get("Tenant") })))
			defer srv.Close()
			client := rawClient()
			defer client.CloseIdleConnections()
			bodies := make(map[string][]string)
			for _, tenant := range []string{"a", "b", "a", "b"} {
				status, body := postAs(t, client, srv.URL, tenant, "k")
				assert.Equal(t, http.StatusCreated, status)
				bodies[tenant] = append(bodies[tenant], body)
			}
			assert.Equal(t, map[string]int{`"a" k`: 1, `"b" k`: 1}, srv.Executions())
			rec := &recordingTB{TB: t}
			ok := srv.AssertExactlyOnce(rec, 2)
			if !tt.broken {
				assert.True(t, ok, "%v", rec.errors)
				assert.Empty(t, srv.WrongReplays())
				return
			}
			require.Equal(t, []string{"receipt of tenant a", "receipt of tenant b"}, bodies["a"], "the broken store leaks")
			assert.False(t, ok)
			wrong := srv.WrongReplays()
			require.Len(t, wrong, 1)
			assert.Contains(t, wrong[0], `"a" k (replayed 201`)
		})
	}
}
