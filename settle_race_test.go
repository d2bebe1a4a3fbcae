package idemhttp

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// Workers call a few operations at once, with HoldKey, through two
// Transports over one FileKeyStore, while responses are lost and bodies
// cut; each saves the outcome it read and settles. A key is forgotten only
// once some caller saved its outcome: whenever a new key of an operation
// reaches the server, every earlier key of it has been saved.
func TestConcurrentHeldOperationsForgetOnlySavedKeys(t *testing.T) {
	const ops, workers = 3, 4
	var (
		mu         sync.Mutex
		saved      = map[string]bool{}     // keys whose outcome a caller saved
		seen       = map[string][]string{} // keys of each operation, in order of arrival
		violations []string
	)
	charge := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "paid")
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		op, key := r.Header.Get("X-Op"), r.Header.Get(DefaultKeyHeader)
		mu.Lock()
		keys := seen[op]
		if len(keys) == 0 || keys[len(keys)-1] != key {
			for _, k := range keys {
				if !saved[k] {
					violations = append(violations, op+": "+key+" sent while "+k+" was not saved")
				}
			}
			seen[op] = append(keys, key)
		}
		mu.Unlock()
		charge.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)

	var n atomic.Int64
	base := newBaseTransport(t)
	faulty := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		resp, err := base.RoundTrip(r)
		if err != nil {
			return nil, err
		}
		switch n.Add(1) % 5 {
		case 1:
			resp.Body = lostBody{resp.Body}
		case 3:
			discard(resp)
			return nil, io.ErrUnexpectedEOF
		}
		return resp, nil
	})
	store := openTestStore(t, filepath.Join(t.TempDir(), "keys"))
	trs := []*Transport{
		NewTransport(faulty, WithKeyStore(store), WithBackoff(noWait), WithMaxAttempts(2)),
		NewTransport(faulty, WithKeyStore(store), WithBackoff(noWait), WithMaxAttempts(2)),
	}

	var wg sync.WaitGroup
	for op := range ops {
		id := string(rune('a' + op))
		for w := range workers {
			tr := trs[w%2]
			wg.Go(func() {
				for range 50 {
					req := post(t, WithOperation(context.Background(), id, HoldKey()), srv.URL, "x")
					req.Header.Set("X-Op", id)
					resp, err := tr.RoundTrip(req)
					if err != nil {
						if errors.Is(err, ErrOperationInFlight) {
							runtime.Gosched()
						}
						continue
					}
					_, err = io.ReadAll(resp.Body)
					resp.Body.Close()
					if err != nil {
						continue
					}
					key := resp.Request.Header.Get(DefaultKeyHeader)
					mu.Lock()
					saved[key] = true
					mu.Unlock()
					for {
						err := Settle(context.Background(), resp)
						if !errors.Is(err, ErrOperationInFlight) {
							assert.NoError(t, err)
							break
						}
						runtime.Gosched()
					}
				}
			})
		}
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	require.Empty(t, violations)
	for op, keys := range seen {
		assert.NotEmpty(t, keys, op)
	}
}
