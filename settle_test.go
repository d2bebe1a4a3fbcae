package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"

	"github.com/idemhttp/idemhttp/idemserver"
)

// heldCtx names operation "order-1", made with HoldKey.
func heldCtx() context.Context {
	return WithOperation(context.Background(), "order-1", HoldKey())
}

// readAll reads resp's body to its end and closes it, and returns it.
func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	return string(body)
}

// With HoldKey, no outcome releases the key by itself, and Settle releases
// it exactly where the Transport would have without HoldKey: the rules of
// TestOperationKeyLifecycle, row by row.
func TestSettleFollowsTheKeyLifecycle(t *testing.T) {
	for _, tt := range lifecycleCases() {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, tt.reply...)
			store := NewMemoryKeyStore()
			tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithBackoff(noWait), WithMaxAttempts(2))

			resp, err := tr.RoundTrip(post(t, heldCtx(), srv.URL, "x"))
			want := map[string]string{"order-1": srv.keys()[0]}
			if err != nil {
				require.True(t, tt.wantPending, "only an outcome that keeps the key ends in an error: %v", err)
				assert.Equal(t, want, pendingKeys(t, store))
				return
			}
			readAll(t, resp)
			assert.Equal(t, want, pendingKeys(t, store), "held once the body is read")

			err = Settle(context.Background(), resp)
			if tt.wantPending {
				require.ErrorIs(t, err, ErrNotFinal)
				assert.Equal(t, want, pendingKeys(t, store), "a refused Settle releases nothing")
				return
			}
			require.NoError(t, err)
			assert.Empty(t, pendingKeys(t, store), "released by Settle")
		})
	}
}

// Settle refuses, releasing nothing, every response whose outcome the
// caller has not received in full or that holds no key for it; and a key
// it may release is released only in its turn.
func TestSettleRefusals(t *testing.T) {
	type setup struct {
		tr    *Transport
		store *MemoryKeyStore
		srv   *server
	}
	newSetup := func(t *testing.T, base func(http.RoundTripper) http.RoundTripper, reply ...func(http.ResponseWriter, *http.Request)) setup {
		srv := newServer(t, reply...)
		store := NewMemoryKeyStore()
		var rt http.RoundTripper = newBaseTransport(t)
		if base != nil {
			rt = base(rt)
		}
		return setup{NewTransport(rt, WithKeyStore(store), WithBackoff(noWait), WithMaxAttempts(1)), store, srv}
	}
	tests := []struct {
		name string
		// run makes the call, and whatever else the case needs, and
		// returns the response to settle and the keys that must be pending
		// after a refused Settle.
		run     func(t *testing.T) (resp *http.Response, s setup, pending map[string]string)
		wantErr error
	}{
		{"nil response", func(t *testing.T) (*http.Response, setup, map[string]string) {
			return nil, newSetup(t, nil, status(200)), map[string]string{}
		}, ErrNotHeld},
		{"a response not from a Transport", func(t *testing.T) (*http.Response, setup, map[string]string) {
			s := newSetup(t, nil, status(200))
			resp, err := newBaseTransport(t).RoundTrip(post(t, heldCtx(), s.srv.URL, "x"))
			require.NoError(t, err)
			readAll(t, resp)
			return resp, s, map[string]string{}
		}, ErrNotHeld},
		{"an operation without HoldKey, released by its body as always", func(t *testing.T) (*http.Response, setup, map[string]string) {
			s := newSetup(t, nil, status(200))
			resp, err := s.tr.RoundTrip(post(t, WithOperation(context.Background(), "order-1"), s.srv.URL, "x"))
			require.NoError(t, err)
			assert.Len(t, pendingKeys(t, s.store), 1, "pending until the body is read")
			readAll(t, resp)
			assert.Empty(t, pendingKeys(t, s.store), "released at the end of the body")
			return resp, s, map[string]string{}
		}, ErrNotHeld},
		{"a call without an operation", func(t *testing.T) (*http.Response, setup, map[string]string) {
			s := newSetup(t, nil, status(200))
			resp, err := s.tr.RoundTrip(post(t, context.Background(), s.srv.URL, "x"))
			require.NoError(t, err)
			readAll(t, resp)
			return resp, s, map[string]string{}
		}, ErrNotHeld},
		{"a body not yet read", func(t *testing.T) (*http.Response, setup, map[string]string) {
			s := newSetup(t, nil, status(200))
			resp, err := s.tr.RoundTrip(post(t, heldCtx(), s.srv.URL, "x"))
			require.NoError(t, err)
			t.Cleanup(func() { resp.Body.Close() })
			return resp, s, map[string]string{"order-1": s.srv.keys()[0]}
		}, ErrNotFinal},
		{"a body cut in transit", func(t *testing.T) (*http.Response, setup, map[string]string) {
			s := newSetup(t, func(rt http.RoundTripper) http.RoundTripper {
				return roundTripFunc(func(r *http.Request) (*http.Response, error) {
					resp, err := rt.RoundTrip(r)
					if err == nil {
						resp.Body = lostBody{resp.Body}
					}
					return resp, err
				})
			}, status(200))
			resp, err := s.tr.RoundTrip(post(t, heldCtx(), s.srv.URL, "x"))
			require.NoError(t, err)
			_, err = io.ReadAll(resp.Body)
			require.Error(t, err)
			resp.Body.Close()
			return resp, s, map[string]string{"order-1": s.srv.keys()[0]}
		}, ErrNotFinal},
		{"retries run out", func(t *testing.T) (*http.Response, setup, map[string]string) {
			s := newSetup(t, nil, status(503))
			resp, err := s.tr.RoundTrip(post(t, heldCtx(), s.srv.URL, "x"))
			require.NoError(t, err)
			readAll(t, resp)
			return resp, s, map[string]string{"order-1": s.srv.keys()[0]}
		}, ErrNotFinal},
		{"the budget refuses the retry", func(t *testing.T) (*http.Response, setup, map[string]string) {
			srv := newServer(t, status(503))
			store := NewMemoryKeyStore()
			tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithBackoff(noWait),
				WithBudget(NewBudget(BudgetRatio(0), BudgetMinRetriesPerSecond(0))))
			resp, err := tr.RoundTrip(post(t, heldCtx(), srv.URL, "x"))
			require.NoError(t, err)
			readAll(t, resp)
			return resp, setup{tr, store, srv}, map[string]string{"order-1": srv.keys()[0]}
		}, ErrNotFinal},
		{"the rate limit refuses the retry", func(t *testing.T) (*http.Response, setup, map[string]string) {
			srv := newServer(t, status(503))
			store := NewMemoryKeyStore()
			tr := NewTransport(newBaseTransport(t), WithKeyStore(store), WithBackoff(noWait),
				WithRateLimit(rate.Every(time.Hour), 1))
			ctx, cancel := context.WithTimeout(heldCtx(), time.Minute)
			t.Cleanup(cancel)
			// The retry would wait past the deadline: the 503 is returned.
			resp, err := tr.RoundTrip(post(t, ctx, srv.URL, "x"))
			require.NoError(t, err)
			readAll(t, resp)
			require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
			return resp, setup{tr, store, srv}, map[string]string{"order-1": srv.keys()[0]}
		}, ErrNotFinal},
		{"a 4xx to a key sent before, not replayed", func(t *testing.T) (*http.Response, setup, map[string]string) {
			s := newSetup(t, nil, status(503), status(401))
			resp, err := s.tr.RoundTrip(post(t, heldCtx(), s.srv.URL, "x"))
			require.NoError(t, err)
			readAll(t, resp) // the 503: the key stays pending, and is sent again
			resp, err = s.tr.RoundTrip(post(t, heldCtx(), s.srv.URL, "x"))
			require.NoError(t, err)
			readAll(t, resp)
			require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
			return resp, s, map[string]string{"order-1": s.srv.keys()[0]}
		}, ErrNotFinal},
		{"another call of the operation in flight", func(t *testing.T) (*http.Response, setup, map[string]string) {
			s := newSetup(t, nil, status(200))
			resp, err := s.tr.RoundTrip(post(t, heldCtx(), s.srv.URL, "x"))
			require.NoError(t, err)
			readAll(t, resp)
			second, err := s.tr.RoundTrip(post(t, heldCtx(), s.srv.URL, "x"))
			require.NoError(t, err, "the first call's flight ended with its body")
			t.Cleanup(func() { second.Body.Close() }) // in flight until then
			return resp, s, map[string]string{"order-1": s.srv.keys()[0]}
		}, ErrOperationInFlight},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, s, pending := tt.run(t)
			err := Settle(context.Background(), resp)
			require.ErrorIs(t, err, tt.wantErr)
			assert.Equal(t, pending, pendingKeys(t, s.store), "a refused Settle releases nothing")
		})
	}
}

// A Settle refused because the body was not yet read succeeds once it
// has been, and one whose KeyStore failed to release succeeds when tried
// again. Once the key is released, Settle again does nothing.
func TestSettleAgain(t *testing.T) {
	t.Run("after the body is read", func(t *testing.T) {
		srv := newServer(t, status(201))
		store := NewMemoryKeyStore()
		tr := NewTransport(newBaseTransport(t), WithKeyStore(store))
		resp, err := tr.RoundTrip(post(t, heldCtx(), srv.URL, "x"))
		require.NoError(t, err)
		require.ErrorIs(t, Settle(context.Background(), resp), ErrNotFinal)
		readAll(t, resp)
		require.NoError(t, Settle(context.Background(), resp))
		assert.Empty(t, pendingKeys(t, store))
		require.NoError(t, Settle(context.Background(), resp), "settled already")
	})
	t.Run("after the KeyStore failed", func(t *testing.T) {
		srv := newServer(t, status(201))
		store := &flakyRelease{MemoryKeyStore: NewMemoryKeyStore()}
		store.fail.Store(true)
		tr := NewTransport(newBaseTransport(t), WithKeyStore(store))
		resp, err := tr.RoundTrip(post(t, heldCtx(), srv.URL, "x"))
		require.NoError(t, err)
		readAll(t, resp)
		err = Settle(context.Background(), resp)
		require.ErrorIs(t, err, errReleaseFailed)
		assert.Len(t, pendingKeys(t, store), 1)

		store.fail.Store(false)
		require.NoError(t, Settle(context.Background(), resp))
		assert.Empty(t, pendingKeys(t, store))
	})
	t.Run("after the KeyStore failed and the operation was called again", func(t *testing.T) {
		srv := newServer(t, status(201))
		store := &flakyRelease{MemoryKeyStore: NewMemoryKeyStore()}
		store.fail.Store(true)
		tr := NewTransport(newBaseTransport(t), WithKeyStore(store))
		resp, err := tr.RoundTrip(post(t, heldCtx(), srv.URL, "x"))
		require.NoError(t, err)
		readAll(t, resp)
		require.ErrorIs(t, Settle(context.Background(), resp), errReleaseFailed)

		// The failed Settle ended its flight: the operation can be called.
		resp2, err := tr.RoundTrip(post(t, heldCtx(), srv.URL, "x"))
		require.NoError(t, err)
		readAll(t, resp2)
		assert.Equal(t, srv.keys()[0], srv.keys()[1], "the held key sent again")

		store.fail.Store(false)
		require.NoError(t, Settle(context.Background(), resp))
		assert.Len(t, pendingKeys(t, store), 1, "the call made since holds the key now")
		require.NoError(t, Settle(context.Background(), resp2))
		assert.Empty(t, pendingKeys(t, store))
	})
}

var errReleaseFailed = errors.New("release failed")

// flakyRelease is a MemoryKeyStore whose Release fails while fail is set.
type flakyRelease struct {
	*MemoryKeyStore
	fail atomic.Bool
}

func (s *flakyRelease) Release(ctx context.Context, op, key string) error {
	if s.fail.Load() {
		return errReleaseFailed
	}
	return s.MemoryKeyStore.Release(ctx, op, key)
}

// A Settle that comes after the operation was released and started anew
// under another key leaves the new key pending.
func TestStaleSettleKeepsANewerKey(t *testing.T) {
	srv := newServer(t, status(201))
	store := NewMemoryKeyStore()
	tr := NewTransport(newBaseTransport(t), WithKeyStore(store))
	held := do(t, tr, post(t, heldCtx(), srv.URL, "x"))
	// A part of the program that does not hold the key calls the
	// operation: it sends the held key and releases it.
	do(t, tr, post(t, WithOperation(context.Background(), "order-1"), srv.URL, "x"))
	require.Empty(t, pendingKeys(t, store))
	// The operation starts anew, and holds its new key.
	do(t, tr, post(t, heldCtx(), srv.URL, "x"))
	keys := srv.keys()
	require.Equal(t, keys[0], keys[1])
	require.NotEqual(t, keys[0], keys[2])

	require.NoError(t, Settle(context.Background(), held))
	assert.Equal(t, map[string]string{"order-1": keys[2]}, pendingKeys(t, store), "the newer key is kept")
}

// Through a chain of redirects that http.Client follows, the key is held
// until Settle is given the response of the chain's last request; the
// redirects themselves, which CheckRedirect sees, are never final. A call
// made before Settle, through the chain again, sends the same key and is
// answered by the server's replay, and the request that follows a
// redirect through another Transport settles the key in the KeyStore that
// holds it.
func TestSettleAfterFollowedRedirects(t *testing.T) {
	tests := []struct {
		name string
		hops []int // the POST's redirect, then those of the requests that follow
	}{
		{"303", []int{303}},
		{"303 then 302", []int{303, 302}},
		{"307", []int{307}},
		{"308 then 303", []int{308, 303}},
	}
	for _, tt := range tests {
		for _, routed := range []bool{false, true} {
			name := tt.name
			if routed {
				name += "/followed through another Transport"
			}
			t.Run(name, func(t *testing.T) {
				var executions atomic.Int32
				charge := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					executions.Add(1)
					_, _ = io.Copy(io.Discard, r.Body)
					http.Redirect(w, r, "/hop/1", tt.hops[0])
				}))
				var keys recorder[string]
				srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					hop := 0
					fmt.Sscanf(r.URL.Path, "/hop/%d", &hop)
					if hop == 0 {
						keys.add(r.Header.Get(DefaultKeyHeader))
						charge.ServeHTTP(w, r)
						return
					}
					_, _ = io.Copy(io.Discard, r.Body)
					if hop < len(tt.hops) {
						http.Redirect(w, r, fmt.Sprintf("/hop/%d", hop+1), tt.hops[hop])
						return
					}
					io.WriteString(w, "paid")
				}))
				t.Cleanup(srv.Close)
				store := NewMemoryKeyStore()
				first := NewTransport(newBaseTransport(t), WithKeyStore(store), WithMaxAttempts(1))
				var rt http.RoundTripper = first
				if routed {
					// The POST goes through first, every request that
					// follows through a Transport over another store.
					other := NewTransport(newBaseTransport(t), WithMaxAttempts(1))
					rt = roundTripFunc(func(r *http.Request) (*http.Response, error) {
						if r.Response != nil {
							return other.RoundTrip(r)
						}
						return first.RoundTrip(r)
					})
				}
				var redirects []*http.Response
				client := &http.Client{Transport: rt, CheckRedirect: func(req *http.Request, via []*http.Request) error {
					redirects = append(redirects, req.Response)
					return nil
				}}

				call := func() *http.Response {
					resp, err := client.Do(post(t, heldCtx(), srv.URL, "charge"))
					require.NoError(t, err)
					assert.Equal(t, "paid", readAll(t, resp))
					assert.Len(t, pendingKeys(t, store), 1, "held once the chain's last body is read")
					return resp
				}
				resp := call()
				require.Len(t, redirects, len(tt.hops))
				for _, r := range redirects {
					assert.ErrorIs(t, Settle(context.Background(), r), ErrNotFinal, "a redirect of the chain")
				}
				again := call()
				all := keys.all()
				require.Len(t, all, 2)
				assert.Equal(t, all[0], all[1], "the call before Settle sends the held key")
				assert.Equal(t, int32(1), executions.Load(), "and gets the replay")

				require.NoError(t, Settle(context.Background(), resp))
				assert.Len(t, pendingKeys(t, store), 1, "the call made since holds the key now")
				require.NoError(t, Settle(context.Background(), again))
				assert.Empty(t, pendingKeys(t, store), "released by Settle of the chain's last response")
			})
		}
	}
}

// Settles of the responses of one operation, run at once with a call that
// starts it anew, release the held key at most once and never a key taken
// after it: each returns nil or is refused as in flight, and a key the
// new call took is still pending at the end.
func TestConcurrentSettles(t *testing.T) {
	srv := newChargeServer(t)
	store := NewMemoryKeyStore()
	tr := NewTransport(newBaseTransport(t), WithKeyStore(store))
	call := func() (*http.Response, error) {
		resp, err := tr.RoundTrip(post(t, heldCtx(), srv.URL, "x"))
		if err != nil {
			return nil, err
		}
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, err
	}
	first, err := call()
	require.NoError(t, err)
	second, err := call()
	require.NoError(t, err)
	held := srv.keys.all()[0]
	require.Equal(t, held, srv.keys.all()[1])

	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		resp := first
		if i%2 == 1 {
			resp = second
		}
		wg.Go(func() { errs <- Settle(context.Background(), resp) })
	}
	var next string // the key the call made meanwhile sent
	wg.Go(func() {
		for {
			_, err := call()
			if errors.Is(err, ErrOperationInFlight) {
				runtime.Gosched() // a Settle holds the operation
				continue
			}
			assert.NoError(t, err)
			all := srv.keys.all()
			next = all[len(all)-1]
			return
		}
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			assert.ErrorIs(t, err, ErrOperationInFlight)
		}
	}
	pending := pendingKeys(t, store)
	if next != held {
		assert.Equal(t, map[string]string{"order-1": next}, pending, "the new call's key is never released by a stale Settle")
	}
	assert.LessOrEqual(t, len(pending), 1)
	assert.Equal(t, int32(len(distinct(srv.keys.all()))), srv.executions.Load(), "each key charged once")
}

// distinct returns the distinct values of s.
func distinct(s []string) map[string]bool {
	m := map[string]bool{}
	for _, v := range s {
		m[v] = true
	}
	return m
}

func TestOperationFromHeldOperation(t *testing.T) {
	id, ok := OperationFrom(WithOperation(context.Background(), "x", HoldKey()))
	assert.True(t, ok)
	assert.Equal(t, "x", id)
	id, ok = OperationFrom(WithOperation(context.Background(), "y", nil))
	assert.True(t, ok)
	assert.Equal(t, "y", id)
}
