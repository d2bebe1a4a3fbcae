package idemhttp

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// A 307 or 308 is not the end of a keyed request: http.Client sends it
// again to the new location, and that request carries the same key, whether
// the key is the Transport's own or an operation's. An operation's key stays
// pending through the redirect and is released with the final response.
func TestRedirectedRequestKeepsItsKey(t *testing.T) {
	tests := []struct {
		name       string
		hops       []int // the redirect statuses in front of the final handler
		operation  bool
		structured bool
	}{
		{"307", []int{307}, false, false},
		{"308", []int{308}, false, false},
		{"307 then 308", []int{307, 308}, false, false},
		{"307 structured key", []int{307}, false, true},
		{"307 operation", []int{307}, true, false},
		{"308 operation", []int{308}, true, false},
		{"307 then 308 operation", []int{307, 308}, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			store := NewMemoryKeyStore()
			var seen recorder[string] // the key each hop saw
			var executions atomic.Int32
			var pendingInHandler atomic.Pointer[map[string]string]
			final := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				executions.Add(1)
				body, _ := io.ReadAll(r.Body)
				assert.Equal(t, "charge", string(body), "the body followed the redirect")
				p := pendingKeys(t, store)
				pendingInHandler.Store(&p)
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, "created")
			}))
			next := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				seen.add(r.Header.Get("Idempotency-Key"))
				final.ServeHTTP(w, r)
			}))
			t.Cleanup(next.Close)
			for i := len(tt.hops) - 1; i >= 0; i-- {
				code, location := tt.hops[i], next.URL+"/hop"
				hop := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					seen.add(r.Header.Get("Idempotency-Key"))
					_, _ = io.Copy(io.Discard, r.Body)
					http.Redirect(w, r, location, code)
				}))
				t.Cleanup(hop.Close)
				next = hop
			}

			opts := []Option{WithKeyStore(store)}
			if tt.structured {
				opts = append(opts, WithStructuredKey())
			}
			client := &http.Client{Transport: NewTransport(newBaseTransport(t), opts...)}
			ctx := context.Background()
			if tt.operation {
				ctx = WithOperation(ctx, "order-7")
			}
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, next.URL, strings.NewReader("charge"))
			require.NoError(t, err)

			resp, err := client.Do(req)
			require.NoError(t, err)
			assert.Equal(t, http.StatusCreated, resp.StatusCode)
			keys := seen.all()
			require.Len(t, keys, len(tt.hops)+1)
			require.NotEmpty(t, keys[0])
			for i, k := range keys {
				assert.Equal(t, keys[0], k, "hop %d", i)
			}
			assert.Equal(t, int32(1), executions.Load())
			if tt.structured {
				assert.True(t, strings.HasPrefix(keys[0], `"`), "sent as a structured string: %s", keys[0])
			}

			if tt.operation {
				assert.Equal(t, map[string]string{"order-7": keys[0]}, *pendingInHandler.Load(),
					"pending, with the key sent, while the redirected request runs")
				assert.Equal(t, map[string]string{"order-7": keys[0]}, pendingKeys(t, store),
					"pending until the final response is read")
			}
			_, err = io.ReadAll(resp.Body)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Empty(t, pendingKeys(t, store), "released with the final response")
		})
	}
}

// The key follows a 307 through a base transport that, unlike
// http.Transport, leaves Response.Request unset, as fakes and recording
// transports often do: the Transport's response names the attempt sent.
func TestRedirectKeepsKeyOverBaseWithoutResponseRequest(t *testing.T) {
	var seen recorder[string]
	final := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen.add(r.Header.Get("Idempotency-Key"))
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(final.Close)
	hop := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen.add(r.Header.Get("Idempotency-Key"))
		_, _ = io.Copy(io.Discard, r.Body)
		http.Redirect(w, r, final.URL, http.StatusTemporaryRedirect)
	}))
	t.Cleanup(hop.Close)
	http1 := newBaseTransport(t)
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		resp, err := http1.RoundTrip(r)
		if resp != nil {
			resp.Request = nil
		}
		return resp, err
	})
	client := &http.Client{Transport: NewTransport(base)}

	resp, err := client.Do(post(t, context.Background(), hop.URL, "charge"))
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()

	assert.Equal(t, http.StatusCreated, resp.StatusCode)
	keys := seen.all()
	require.Len(t, keys, 2)
	require.NotEmpty(t, keys[0])
	assert.Equal(t, keys[0], keys[1], "the redirected request carries the same key")
}

// A 301, 302 or 303 that http.Client follows is not the outcome the caller
// gets: the caller gets the outcome of the GET that follows it. If that GET
// fails (a 5xx after the retries, an error, the context ending), the
// caller has learnt nothing of the charge, and calling again with the same
// operation id must send the same key, so that the server replays the
// redirect instead of charging twice. The key is released once the
// followed request's final outcome reaches the caller.
func TestFollowedRedirectKeepsTheOperationPending(t *testing.T) {
	tests := []struct {
		name string
		hops []int // the POST's redirect, then those of the GETs that follow
	}{
		{"301", []int{301}},
		{"302", []int{302}},
		{"303", []int{303}},
		{"303 then 302", []int{303, 302}},
		{"303 then 307", []int{303, 307}},
		{"307 then 303", []int{307, 303}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var executions, pages atomic.Int32
			charge := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				executions.Add(1)
				_, _ = io.Copy(io.Discard, r.Body)
				http.Redirect(w, r, "/hop/1", tt.hops[0])
			}))
			store := NewMemoryKeyStore()
			var keys recorder[string]
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				hop := 0
				fmt.Sscanf(r.URL.Path, "/hop/%d", &hop)
				if hop == 0 {
					keys.add(r.Header.Get("Idempotency-Key"))
					charge.ServeHTTP(w, r)
					return
				}
				assert.Len(t, pendingKeys(t, store), 1, "pending while the redirect is followed")
				if hop < len(tt.hops) {
					_, _ = io.Copy(io.Discard, r.Body)
					http.Redirect(w, r, fmt.Sprintf("/hop/%d", hop+1), tt.hops[hop])
					return
				}
				assert.Equal(t, http.MethodGet, r.Method)
				if pages.Add(1) == 1 {
					w.WriteHeader(http.StatusServiceUnavailable) // the charge's page is down
					return
				}
				io.WriteString(w, "charge 1: paid")
			}))
			t.Cleanup(srv.Close)
			client := &http.Client{Transport: NewTransport(newBaseTransport(t),
				WithKeyStore(store), WithMaxAttempts(1))}
			ctx := WithOperation(context.Background(), "order-9")

			resp, err := client.Do(post(t, ctx, srv.URL, "charge"))
			require.NoError(t, err)
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
			assert.Len(t, pendingKeys(t, store), 1, "the caller has not seen the outcome")

			// The caller tries the operation again, as a 503 invites.
			resp, err = client.Do(post(t, ctx, srv.URL, "charge"))
			require.NoError(t, err)
			assert.Len(t, pendingKeys(t, store), 1, "pending until the body is read")
			body, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, "charge 1: paid", string(body))

			sent := keys.all()
			require.NotEmpty(t, sent)
			for _, k := range sent {
				assert.Equal(t, sent[0], k, "every POST sends the first call's key")
			}
			assert.Equal(t, int32(1), executions.Load(), "charged once")
			assert.Empty(t, pendingKeys(t, store), "released with the followed request's final outcome")
		})
	}
}

// The key of an operation whose followed redirect's GET is cut short by the
// caller's context stays pending too, and one whose redirect is not
// followed (CheckRedirect returns ErrUseLastResponse) is returned pending,
// as a 307 or 308 that is not followed is.
func TestFollowedRedirectEndedOrNotFollowed(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			http.Redirect(w, r, "/charges/1", http.StatusSeeOther)
			return
		}
		<-r.Context().Done() // the charge's page hangs
	}))
	t.Cleanup(srv.Close)

	t.Run("context ends during the GET", func(t *testing.T) {
		store := NewMemoryKeyStore()
		client := &http.Client{Transport: NewTransport(newBaseTransport(t), WithKeyStore(store))}
		ctx, cancel := context.WithCancel(WithOperation(context.Background(), "order-10"))
		base := client.Transport
		client.Transport = roundTripFunc(func(r *http.Request) (*http.Response, error) {
			if r.Method == http.MethodGet {
				cancel() // the caller gives up while the GET runs
			}
			return base.RoundTrip(r)
		})
		_, err := client.Do(post(t, ctx, srv.URL, "charge"))
		require.ErrorIs(t, err, context.Canceled)
		assert.Len(t, pendingKeys(t, store), 1)
	})
	t.Run("not followed", func(t *testing.T) {
		store := NewMemoryKeyStore()
		client := &http.Client{
			Transport:     NewTransport(newBaseTransport(t), WithKeyStore(store)),
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		}
		resp, err := client.Do(post(t, WithOperation(context.Background(), "order-11"), srv.URL, "charge"))
		require.NoError(t, err)
		_, err = io.ReadAll(resp.Body)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusSeeOther, resp.StatusCode)
		assert.Len(t, pendingKeys(t, store), 1)
	})
}

// A request built from a response's Request still points at the redirect
// that response followed, but it is not a follow-up of that redirect: it
// must neither take on the first operation's key, and release it (which
// would let the next call of that operation charge again with a new key),
// nor leave its own operation without a pending key.
func TestRequestBuiltFromFollowedResponseIsNotAFollowUp(t *testing.T) {
	tests := []struct {
		name      string
		method    string
		operation string // of the request built, or ""
	}{
		{"DELETE without operation", http.MethodDelete, ""},
		{"POST of another operation", http.MethodPost, "refund-1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var executions, pages atomic.Int32
			charge := idemserver.Middleware(idemserver.NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				executions.Add(1)
				http.Redirect(w, r, "/charges/1", http.StatusSeeOther)
			}))
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				switch {
				case r.URL.Path == "/charges":
					charge.ServeHTTP(w, r)
				case r.Method == http.MethodGet && pages.Add(1) == 1:
					w.WriteHeader(http.StatusServiceUnavailable) // the charge's page is down
				case r.Method == http.MethodGet:
					io.WriteString(w, "charge 1: paid")
				case r.Method == http.MethodDelete:
					w.WriteHeader(http.StatusNoContent)
				default: // the refund fails
					w.WriteHeader(http.StatusServiceUnavailable)
				}
			}))
			t.Cleanup(srv.Close)
			store := NewMemoryKeyStore()
			client := &http.Client{Transport: NewTransport(newBaseTransport(t), WithKeyStore(store), WithMaxAttempts(1))}
			ctx := WithOperation(context.Background(), "charge-1")

			resp, err := client.Do(post(t, ctx, srv.URL+"/charges", "charge"))
			require.NoError(t, err)
			_, _ = io.ReadAll(resp.Body)
			resp.Body.Close()
			require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
			pending := pendingKeys(t, store)
			require.Contains(t, pending, "charge-1")

			other := context.Background()
			if tt.operation != "" {
				other = WithOperation(other, tt.operation)
			}
			built := resp.Request.Clone(other)
			built.Method = tt.method
			built.Body, built.GetBody, built.ContentLength = http.NoBody, nil, 0
			resp, err = client.Do(built)
			require.NoError(t, err)
			_, _ = io.ReadAll(resp.Body)
			resp.Body.Close()
			after := pendingKeys(t, store)
			assert.Equal(t, pending["charge-1"], after["charge-1"], "the charge's key is still pending")
			if tt.operation != "" {
				assert.Contains(t, after, tt.operation, "the failed request's key is pending under its own id")
			}

			// The charge, called again, is replayed, not run again.
			resp, err = client.Do(post(t, ctx, srv.URL+"/charges", "charge"))
			require.NoError(t, err)
			body, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, "charge 1: paid", string(body))
			assert.Equal(t, int32(1), executions.Load(), "charged once")
		})
	}
}

// A redirect may lead to a host that a different Transport serves, when the
// client's RoundTripper routes hosts to Transports of their own, each with
// its own KeyStore. The operation's key lives in the KeyStore of the
// Transport that sent the redirected request, and that is where the
// request that follows must release it once the final outcome has reached
// the caller, and where it must stay pending until then.
func TestFollowedRedirectThroughAnotherTransport(t *testing.T) {
	tests := []struct {
		name string
		code int
	}{
		{"303", http.StatusSeeOther},
		{"302", http.StatusFound},
		{"307", http.StatusTemporaryRedirect},
		{"308", http.StatusPermanentRedirect},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			apiStore, pageStore := NewMemoryKeyStore(), NewMemoryKeyStore()
			var pendingDuringPage atomic.Pointer[map[string]string]
			var pageKeys recorder[string]
			page := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				pageKeys.add(r.Header.Get("Idempotency-Key"))
				p := pendingKeys(t, apiStore)
				pendingDuringPage.Store(&p)
				io.WriteString(w, "charge 1: paid")
			}))
			t.Cleanup(page.Close)
			var apiKeys recorder[string]
			api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				apiKeys.add(r.Header.Get("Idempotency-Key"))
				_, _ = io.Copy(io.Discard, r.Body)
				http.Redirect(w, r, page.URL+"/charges/1", tt.code)
			}))
			t.Cleanup(api.Close)
			apiTransport := NewTransport(newBaseTransport(t), WithKeyStore(apiStore))
			pageTransport := NewTransport(newBaseTransport(t), WithKeyStore(pageStore))
			apiHost := strings.TrimPrefix(api.URL, "http://")
			client := &http.Client{Transport: roundTripFunc(func(r *http.Request) (*http.Response, error) {
				if r.URL.Host == apiHost {
					return apiTransport.RoundTrip(r)
				}
				return pageTransport.RoundTrip(r)
			})}

			resp, err := client.Do(post(t, WithOperation(context.Background(), "order-12"), api.URL, "charge"))
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, resp.StatusCode)
			sent := apiKeys.all()
			require.Len(t, sent, 1)
			assert.Equal(t, map[string]string{"order-12": sent[0]}, *pendingDuringPage.Load(),
				"pending in the redirected request's KeyStore while the redirect is followed")
			if tt.code == http.StatusTemporaryRedirect || tt.code == http.StatusPermanentRedirect {
				assert.Equal(t, sent, pageKeys.all(), "the resent request carries the operation's key")
			}
			assert.Equal(t, map[string]string{"order-12": sent[0]}, pendingKeys(t, apiStore),
				"pending until the final response is read")
			_, err = io.ReadAll(resp.Body)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Empty(t, pendingKeys(t, apiStore), "released with the final outcome, where it was pending")
			assert.Empty(t, pendingKeys(t, pageStore), "nothing left in the other Transport's KeyStore")
		})
	}
}

// When GET is among the keyed methods, the GET that follows a 301, 302 or
// 303 is a request of its own and carries a key of its own: sending it the
// operation's key would present one key with two different requests, which
// an idempotent server refuses (422) instead of answering the GET. The
// operation's key stays pending until the GET's outcome reaches the caller.
func TestKeyedGetFollowingRedirectHasItsOwnKey(t *testing.T) {
	var executions atomic.Int32
	var keys recorder[string]
	var pendingDuringGet atomic.Pointer[map[string]string]
	store := NewMemoryKeyStore()
	mw := idemserver.Middleware(idemserver.NewMemoryStore(), idemserver.WithMethods(http.MethodPost, http.MethodGet))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys.add(r.Header.Get("Idempotency-Key"))
		mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost {
				executions.Add(1)
				http.Redirect(w, r, "/charges/1", http.StatusSeeOther)
				return
			}
			p := pendingKeys(t, store)
			pendingDuringGet.Store(&p)
			io.WriteString(w, "charge 1: paid")
		})).ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	client := &http.Client{Transport: NewTransport(newBaseTransport(t),
		WithKeyStore(store), WithKeyedMethods(http.MethodPost, http.MethodGet))}

	resp, err := client.Do(post(t, WithOperation(context.Background(), "order-13"), srv.URL, "charge"))
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body.Close()

	assert.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	assert.Equal(t, "charge 1: paid", string(body))
	sent := keys.all()
	require.Len(t, sent, 2)
	assert.NotEmpty(t, sent[1], "the GET is keyed")
	assert.NotEqual(t, sent[0], sent[1], "the GET has a key of its own")
	assert.Equal(t, map[string]string{"order-13": sent[0]}, *pendingDuringGet.Load(),
		"the operation's key is pending while the GET runs")
	assert.Empty(t, pendingKeys(t, store), "released with the GET's outcome")
	assert.Equal(t, int32(1), executions.Load())
}

// Operations redirected at the same time through one client each keep
// their own key: the GET that follows each 303 releases its own
// operation's key, after a retry of a 503 if need be, and leaves pending
// the key of an operation whose GET kept failing, and no other.
func TestConcurrentRedirectedOperationsKeepTheirOwnKeys(t *testing.T) {
	const operations = 8
	var sent sync.Map // operation -> key its POST carried
	var gets sync.Map // operation -> *atomic.Int32, GETs of its page
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		op := strings.TrimPrefix(r.URL.Path, "/charges/")
		if r.Method == http.MethodPost {
			sent.Store(op, r.Header.Get("Idempotency-Key"))
			http.Redirect(w, r, "/charges/"+op+"/page", http.StatusSeeOther)
			return
		}
		op = strings.TrimSuffix(op, "/page")
		n, _ := gets.LoadOrStore(op, new(atomic.Int32))
		i := 0
		fmt.Sscanf(op, "op-%d", &i)
		// Odd operations' pages stay down; even ones fail once.
		if n.(*atomic.Int32).Add(1) == 1 || i%2 == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "paid "+op)
	}))
	t.Cleanup(srv.Close)
	store := NewMemoryKeyStore()
	client := &http.Client{Transport: NewTransport(newBaseTransport(t), WithKeyStore(store),
		WithBackoff(noWait), WithMaxAttempts(2), WithBudget(nil), WithoutBreaker())}

	var wg sync.WaitGroup
	for i := range operations {
		wg.Go(func() {
			op := fmt.Sprintf("op-%d", i)
			resp, err := client.Do(post(t, WithOperation(context.Background(), op), srv.URL+"/charges/"+op, "charge"))
			if !assert.NoError(t, err) {
				return
			}
			body, err := io.ReadAll(resp.Body)
			assert.NoError(t, err)
			resp.Body.Close()
			if i%2 == 0 {
				assert.Equal(t, "paid "+op, string(body))
			} else {
				assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
			}
		})
	}
	wg.Wait()

	want := map[string]string{}
	for i := 1; i < operations; i += 2 {
		op := fmt.Sprintf("op-%d", i)
		key, ok := sent.Load(op)
		require.True(t, ok)
		want[op] = key.(string)
	}
	assert.Equal(t, want, pendingKeys(t, store))
}

// A chain of redirects that http.Client gives up on ends in an error, not
// in the outcome of the operation: its key stays pending, and the next call
// sends it again.
func TestFollowedRedirectChainThatFailsKeepsThePendingKey(t *testing.T) {
	tests := []struct {
		name     string
		page     http.HandlerFunc // answers the GET that follows the 303
		location string           // of the 303
	}{
		{"too many redirects", func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, r.URL.Path, http.StatusFound)
		}, "/charges/1"},
		{"a Location that does not parse", nil, "http://[::1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var keys recorder[string]
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Method == http.MethodPost {
					keys.add(r.Header.Get("Idempotency-Key"))
					w.Header().Set("Location", tt.location)
					w.WriteHeader(http.StatusSeeOther)
					return
				}
				tt.page(w, r)
			}))
			t.Cleanup(srv.Close)
			store := NewMemoryKeyStore()
			client := &http.Client{Transport: NewTransport(newBaseTransport(t), WithKeyStore(store))}
			ctx := WithOperation(context.Background(), "order-14")

			for range 2 {
				resp, err := client.Do(post(t, ctx, srv.URL, "charge"))
				require.Error(t, err)
				if resp != nil {
					resp.Body.Close()
				}
			}
			sent := keys.all()
			require.Len(t, sent, 2)
			assert.Equal(t, sent[0], sent[1], "the second call sends the first call's key")
			assert.Equal(t, map[string]string{"order-14": sent[0]}, pendingKeys(t, store))
		})
	}
}
