package idemserver_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
)

// dyingStore is the store as a process that died sees it: once dead, it
// reaches nothing, so its claims stay as they were.
type dyingStore struct {
	idemserver.Store
	dead *atomic.Bool
}

var errProcessDied = fmt.Errorf("process died: %w", idemserver.ErrClosed)

func (s dyingStore) Complete(ctx context.Context, k idemserver.Key, token string, resp *idemserver.Response, expires time.Time) error {
	if s.dead.Load() {
		return errProcessDied
	}
	return s.Store.Complete(ctx, k, token, resp, expires)
}

func (s dyingStore) Release(ctx context.Context, k idemserver.Key, token string) error {
	if s.dead.Load() {
		return errProcessDied
	}
	return s.Store.Release(ctx, k, token)
}

func (s dyingStore) Extend(ctx context.Context, k idemserver.Key, token string, leaseExpires time.Time) error {
	if s.dead.Load() {
		return errProcessDied
	}
	return s.Store.Extend(ctx, k, token, leaseExpires)
}

// TestEndToEndDownstreamKey runs a shop whose handler charges a payment
// provider, itself behind idemserver, with a key derived from its own, and
// whose first run dies after the provider charged. The client retries with
// the same key, the shop's handler runs again, and the provider replays
// the charge it made: one charge, and the client learns its id.
//
// The first run dies in three ways. The handler aborts (panics with
// http.ErrAbortHandler, as on a bug after the charge): the claim is released
// and the client sees its connection cut. The handler answers 500 (saving
// the order failed): the claim is released. The process dies: nothing ends
// the claim, the client sees its connection cut, and the retry reaches a
// restarted process on the same store, which takes the claim over once its
// lease has lapsed.
func TestEndToEndDownstreamKey(t *testing.T) {
	for _, tt := range []struct {
		name string
		// fail ends the shop's first run after the charge, given the
		// ResponseWriter and a function that kills the process.
		fail func(w http.ResponseWriter, die func())
	}{
		{"handler aborts", func(http.ResponseWriter, func()) { panic(http.ErrAbortHandler) }},
		{"handler answers 500", func(w http.ResponseWriter, _ func()) {
			http.Error(w, "could not save the order", http.StatusInternalServerError)
		}},
		{"process dies", func(_ http.ResponseWriter, die func()) {
			die()
			panic(http.ErrAbortHandler) // the connection goes with the process
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// The provider, with its own ledger of the charges it made.
			charges := &ledger{charges: map[string]int{}}
			var providerReplays atomic.Int64
			provider := httptest.NewServer(idemserver.Middleware(nil, idemserver.RequireKey(),
				idemserver.WithObserver(func(e idemserver.Event) {
					if e.Outcome == idemserver.OutcomeReplayed {
						providerReplays.Add(1)
					}
				}))(charges))
			defer provider.Close()
			providerClient := idemhttp.NewClient(idemhttp.WithBudget(nil), idemhttp.WithoutBreaker())
			defer providerClient.CloseIdleConnections()

			// The shop: two processes, one after the other, on one store
			// and one clock.
			var runs atomic.Int64
			var dead atomic.Bool
			clock := idemserver.NewFakeClock()
			die := func() {
				dead.Store(true)
				clock.Advance(idemserver.DefaultLease) // the restart takes a while
			}
			shop := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := runs.Add(1)
				key, ok := idemserver.KeyFrom(r.Context())
				if !assert.True(t, ok, "the handler has its key") {
					return
				}
				order, err := io.ReadAll(r.Body)
				require.NoError(t, err)
				req, err := http.NewRequestWithContext(r.Context(), http.MethodPost, provider.URL+"/charges",
					bytes.NewReader(order))
				require.NoError(t, err)
				req.Header.Set("Idempotency-Key", key.Derive("charge"))
				resp, err := providerClient.Do(req)
				if err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				defer resp.Body.Close()
				charge, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				if n == 1 {
					tt.fail(w, die)
					return
				}
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write(charge)
			})
			store := idemserver.NewMemoryStore()
			first := idemserver.Middleware(dyingStore{store, &dead}, idemserver.WithClock(clock.Now))(shop)
			restarted := idemserver.Middleware(store, idemserver.WithClock(clock.Now))(shop)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if dead.Load() {
					restarted.ServeHTTP(w, r)
					return
				}
				first.ServeHTTP(w, r)
			}))
			defer srv.Close()

			client := idemhttp.NewClient(
				idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, 5*time.Millisecond)),
				idemhttp.WithBudget(nil),
				idemhttp.WithoutBreaker(),
			)
			defer client.CloseIdleConnections()
			req, err := http.NewRequestWithContext(idemhttp.WithOperation(t.Context(), "order-1"),
				http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"order":"order-1"}`))
			require.NoError(t, err)
			resp, err := client.Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			require.NoError(t, err)

			assert.Equal(t, http.StatusCreated, resp.StatusCode)
			assert.JSONEq(t, `{"order":"order-1","charge":1}`, string(body), "the first charge")
			assert.EqualValues(t, 2, runs.Load(), "the shop's handler ran again")
			charges.mu.Lock()
			defer charges.mu.Unlock()
			assert.Equal(t, map[string]int{"order-1": 1}, charges.charges, "the provider charged once")
			assert.EqualValues(t, 1, providerReplays.Load(), "the provider replayed the charge")
		})
	}
}

// A gateway that deduplicates keyed requests and forwards them, key and
// all, to a service that deduplicates them too. A retry that reaches the
// service while the service still runs the key's first request is told 409
// with Retry-After, "in progress", which the gateway passes on. The gateway
// must not keep that answer as the key's outcome: once the service has
// finished, the client's next retry gets the service's outcome, not an "in
// progress" replayed for as long as the gateway keeps records.
func TestEndToEndGatewayInFrontOfBusyService(t *testing.T) {
	entered, finish := make(chan struct{}), make(chan struct{})
	var charges atomic.Int64
	service := httptest.NewServer(idemserver.Middleware(nil, idemserver.RequireKey())(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n := charges.Add(1)
			if n == 1 {
				close(entered)
				<-finish
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "ch_%d", n)
		})))
	defer service.Close()
	target, err := url.Parse(service.URL)
	require.NoError(t, err)
	gateway := httptest.NewServer(idemserver.Middleware(nil, idemserver.RequireKey())(httputil.NewSingleHostReverseProxy(target)))
	defer gateway.Close()

	post := func(url string) (int, http.Header, string) {
		req, err := http.NewRequest(http.MethodPost, url+"/charges", strings.NewReader(`{"amount":100}`))
		require.NoError(t, err)
		req.Header.Set(idemserver.DefaultKeyHeader, "charge-1")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, resp.Header, string(body)
	}
	// The first attempt reached the service, which is still working on it
	// (the gateway in front of it has given up on it, say).
	first := make(chan string, 1)
	go func() { _, _, body := post(service.URL); first <- body }()
	<-entered

	status, header, _ := post(gateway.URL)
	require.Equal(t, http.StatusConflict, status, "the service is busy with the key")
	require.NotEmpty(t, header.Get("Retry-After"))

	close(finish)
	assert.Equal(t, "ch_1", <-first)
	status, _, body := post(gateway.URL)
	assert.Equal(t, http.StatusCreated, status)
	assert.Equal(t, "ch_1", body, "the retry gets the service's outcome")
	assert.EqualValues(t, 1, charges.Load())
}
