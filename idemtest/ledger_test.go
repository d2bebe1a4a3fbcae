package idemtest

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

// firstThenCreated serves its first request with first, and answers 201 to
// the others.
func firstThenCreated(first http.HandlerFunc) http.Handler {
	var calls atomic.Int32
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			first(w, r)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
}

// TestLedgerSkips499 checks that a run answered 499, after which the
// middleware releases the key as it does after 408, 425 and 429, is not an
// execution: the retry that runs the handler again is what the middleware
// promises, not a duplicate.
func TestLedgerSkips499(t *testing.T) {
	srv := NewServer(firstThenCreated(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(499)
	}))
	defer srv.Close()
	client := rawClient()
	defer client.CloseIdleConnections()

	assert.Equal(t, outcome{status: 499}, post(t.Context(), client, srv.URL, "k"))
	assert.Equal(t, outcome{status: http.StatusCreated}, post(t.Context(), client, srv.URL, "k"))
	assert.Equal(t, outcome{status: http.StatusCreated, replayed: true}, post(t.Context(), client, srv.URL, "k"))
	assert.Equal(t, map[string]int{"k": 1}, srv.Executions())
	assert.True(t, srv.AssertExactlyOnce(t, 1))
}

// TestLedgerCountsSilentRunAfterClientLeft checks that a run that returns
// without a status once its client has gone is counted: the middleware
// takes it not to have acted and runs the retry, so a handler that did act
// and relied on the implicit 200 executes twice, and the ledger must say so.
func TestLedgerCountsSilentRunAfterClientLeft(t *testing.T) {
	entered, left := make(chan struct{}), make(chan struct{})
	srv := NewServer(firstThenCreated(func(w http.ResponseWriter, r *http.Request) {
		defer close(left)
		close(entered)
		<-r.Context().Done() // acts, and leaves its status to the implicit 200
	}))
	defer srv.Close()
	client := rawClient()
	defer client.CloseIdleConnections()

	ctx, giveUp := context.WithCancel(t.Context())
	go func() { <-entered; giveUp() }()
	assert.True(t, post(ctx, client, srv.URL, "k").err)
	<-left
	var o outcome
	for o = post(t.Context(), client, srv.URL, "k"); o.status == http.StatusConflict; {
		o = post(t.Context(), client, srv.URL, "k") // the release may still be on its way
	}
	require.Equal(t, outcome{status: http.StatusCreated}, o)
	assert.Equal(t, []string{"k"}, srv.Duplicates())
}

// TestAssertExactlyOnceRunInFlight checks that the assertion does not pass
// while a run of the handler is still going: the ledger counts a run when it
// ends, so a run whose client gave up, and whose operation was then sent
// again under a second key, would otherwise be missed.
func TestAssertExactlyOnceRunInFlight(t *testing.T) {
	entered, released := make(chan struct{}), make(chan struct{})
	srv := NewServer(firstThenCreated(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-released // a slow handler that acts whether or not its client waits
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	release := sync.OnceFunc(func() { close(released) })
	defer release() // before Close, which waits for the run
	client := rawClient()
	defer client.CloseIdleConnections()

	ctx, giveUp := context.WithCancel(t.Context())
	go func() { <-entered; giveUp() }()
	assert.True(t, post(ctx, client, srv.URL, "first-key").err)
	// The same operation, sent again under a new key: two executions.
	require.Equal(t, outcome{status: http.StatusCreated}, post(t.Context(), client, srv.URL, "second-key"))

	rec := &recordingTB{TB: t}
	assert.False(t, srv.AssertExactlyOnce(rec, 1), "a run of first-key is in flight")
	require.Len(t, rec.errors, 1)
	assert.Contains(t, rec.errors[0], "1 run of the handler still in progress: first-key")

	release()
	srv.Close() // waits for the run
	assert.Equal(t, map[string]int{"first-key": 1, "second-key": 1}, srv.Executions())
	assert.False(t, srv.AssertExactlyOnce(rec, 1), "two keys for one operation")
}

// TestLedgerFollows409Rule checks that the ledger judges a 409 as the
// middleware does, by its header fields when the status was written: with
// Retry-After it is released (the retry runs the handler again, which is
// not a duplicate), without it it is stored, and an execution.
func TestLedgerFollows409Rule(t *testing.T) {
	for _, tt := range []struct {
		name  string
		first http.HandlerFunc
		runs  int // executions of the key after the first request and its retry
	}{
		{"409 with Retry-After", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusConflict)
		}, 1},
		{"Retry-After set after the 409", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusConflict)
			w.Header().Set("Retry-After", "1")
		}, 1},
		{"Retry-After removed after the 409", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusConflict)
			w.Header().Del("Retry-After")
		}, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := NewServer(firstThenCreated(tt.first))
			defer srv.Close()
			client := rawClient()
			defer client.CloseIdleConnections()

			assert.Equal(t, http.StatusConflict, post(t.Context(), client, srv.URL, "k").status)
			post(t.Context(), client, srv.URL, "k")
			assert.Equal(t, map[string]int{"k": tt.runs}, srv.Executions())
			assert.Empty(t, srv.Duplicates())
		})
	}
}

// memoryStore returns a memory store, closed when the test ends, wrapped
// in wrap unless it is nil.
func memoryStore(t *testing.T, wrap func(idemserver.Store) idemserver.Store) idemserver.Store {
	mem := idemserver.NewMemoryStore()
	t.Cleanup(func() { _ = mem.Close() })
	if wrap == nil {
		return mem
	}
	return wrap(mem)
}

// storeOutcomeOnRelease is a broken store: it keeps an empty 200 as the
// outcome of a claim the middleware releases, as a middleware that stored
// the implicit 200 of a handler that gave up would.
type storeOutcomeOnRelease struct{ idemserver.Store }

func (s storeOutcomeOnRelease) Release(ctx context.Context, key idemserver.Key, token string) error {
	return s.Complete(ctx, key, token, &idemserver.Response{Status: http.StatusOK}, time.Now().Add(time.Hour))
}

// tamperingStore is a broken store: it replays every stored response with
// its status or body changed.
type tamperingStore struct {
	idemserver.Store
	change func(*idemserver.Response)
}

func (s tamperingStore) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	res, err := s.Store.Claim(ctx, c)
	if err == nil && !res.Claimed && res.Record.Completed() {
		changed := *res.Record.Response
		s.change(&changed)
		res.Record.Response = &changed
	}
	return res, err
}

// TestWrongReplaysCaught checks that the assertion fails when a retry is
// told something other than the handler's first answer, including a
// success for a run that never acted, and that honest replays of responses
// the middleware changes on purpose pass.
func TestWrongReplaysCaught(t *testing.T) {
	// gaveUp answers nothing to its first request, whose client has gone:
	// it did not act. The others act and answer 201.
	gaveUp := func(entered chan<- struct{}) http.Handler {
		return firstThenCreated(func(w http.ResponseWriter, r *http.Request) {
			close(entered)
			<-r.Context().Done()
		})
	}
	for _, tt := range []struct {
		name    string
		handler func(entered chan<- struct{}) http.Handler
		store   func(idemserver.Store) idemserver.Store
		opts    []Option
		wrong   string // in the assertion's message; empty when it passes
	}{
		{name: "empty 200 stored for a run that gave up", handler: gaveUp,
			store: func(s idemserver.Store) idemserver.Store { return storeOutcomeOnRelease{s} },
			wrong: "k (replayed 200 with a 0-byte body e3b0c442 and header fields e3b0c442; the handler gave no answer to keep)"},
		{name: "run that gave up, released", handler: gaveUp},
		{name: "different body",
			store: func(s idemserver.Store) idemserver.Store {
				return tamperingStore{s, func(r *idemserver.Response) { r.Body = []byte("other") }}
			},
			wrong: "k (replayed 201 with a 5-byte body"},
		{name: "different status",
			store: func(s idemserver.Store) idemserver.Store {
				return tamperingStore{s, func(r *idemserver.Response) { r.Status = http.StatusOK }}
			},
			wrong: "the handler answered 201 with a 7-byte body"},
		{name: "different body, replay lost",
			store: func(s idemserver.Store) idemserver.Store {
				return tamperingStore{s, func(r *idemserver.Response) { r.Body = nil }}
			},
			opts:  []Option{WithFaults(Faults{LoseResponse: 1})},
			wrong: "k (replayed 201 with a 0-byte body"},
		{name: "response too large to keep",
			opts: []Option{WithMiddleware(idemserver.WithMaxResponseBytes(3))}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			store := memoryStore(t, tt.store)
			entered := make(chan struct{})
			h := http.Handler(created)
			if tt.handler != nil {
				h = tt.handler(entered)
			} else {
				close(entered)
			}
			srv := NewServer(h, append(tt.opts, WithStore(store))...)
			defer srv.Close()
			client := rawClient()
			defer client.CloseIdleConnections()

			first := t.Context()
			if tt.handler != nil {
				ctx, giveUp := context.WithCancel(t.Context())
				go func() { <-entered; giveUp() }()
				first = ctx
			}
			post(first, client, srv.URL, "k")
			var o outcome
			for o = post(t.Context(), client, srv.URL, "k"); o.status == http.StatusConflict; {
				o = post(t.Context(), client, srv.URL, "k") // a release may still be on its way
			}
			post(t.Context(), client, srv.URL, "k")
			srv.Close()

			rec := &recordingTB{TB: t}
			ok := srv.AssertExactlyOnce(rec, 1)
			if tt.wrong == "" {
				assert.Empty(t, srv.WrongReplays())
				if tt.handler == nil {
					assert.True(t, ok, "%v", rec.errors)
				} // else the silent run counts (TestLedgerCountsSilentRunAfterClientLeft)
				return
			}
			assert.False(t, ok)
			require.Len(t, rec.errors, 1)
			assert.Contains(t, rec.errors[0], "replays were not the handler's answer: ")
			assert.Contains(t, rec.errors[0], tt.wrong)
			assert.NotEmpty(t, srv.WrongReplays())
		})
	}
}

// scopeBlindStore is a broken store: it ignores the scope of keys, so one
// tenant's response is replayed to another that sent the same key.
type scopeBlindStore struct{ idemserver.Store }

func unscoped(k idemserver.Key) idemserver.Key { return idemserver.Key{Key: k.Key} }

func (s scopeBlindStore) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	c.Key = unscoped(c.Key)
	return s.Store.Claim(ctx, c)
}

func (s scopeBlindStore) TakeOver(ctx context.Context, c idemserver.Claim, expired string) (idemserver.ClaimResult, error) {
	c.Key = unscoped(c.Key)
	return s.Store.TakeOver(ctx, c, expired)
}

func (s scopeBlindStore) Complete(ctx context.Context, k idemserver.Key, token string, r *idemserver.Response, expires time.Time) error {
	return s.Store.Complete(ctx, unscoped(k), token, r, expires)
}

func (s scopeBlindStore) Release(ctx context.Context, k idemserver.Key, token string) error {
	return s.Store.Release(ctx, unscoped(k), token)
}

func (s scopeBlindStore) Extend(ctx context.Context, k idemserver.Key, token string, lease time.Time) error {
	return s.Store.Extend(ctx, unscoped(k), token, lease)
}

// TestLedgerScopes checks that the ledger counts per scope and key, as the
// middleware deduplicates: two tenants that send the same key make two
// operations, each executed once, and a store that replays one tenant's
// response to the other leaves an operation unexecuted.
func TestLedgerScopes(t *testing.T) {
	for _, tt := range []struct {
		name  string
		blind bool
		runs  map[string]int
	}{
		{"scoped store", false, map[string]int{`"a" k`: 1, `"b" k`: 1}},
		{"store ignores the scope", true, map[string]int{`"a" k`: 1}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var wrap func(idemserver.Store) idemserver.Store
			if tt.blind {
				wrap = func(s idemserver.Store) idemserver.Store { return scopeBlindStore{s} }
			}
			store := memoryStore(t, wrap)
			srv := NewServer(created, WithStore(store), WithMiddleware(idemserver.WithScope(
				func(r *http.Request) string { return r.Header.Get("Tenant") })))
			defer srv.Close()
			client := rawClient()
			defer client.CloseIdleConnections()
			for _, tenant := range []string{"a", "b", "a", "b"} {
				status, _ := postAs(t, client, srv.URL, tenant, "k")
				assert.Equal(t, http.StatusCreated, status)
			}
			assert.Equal(t, tt.runs, srv.Executions())
			assert.Empty(t, srv.Duplicates())
			rec := &recordingTB{TB: t}
			assert.Equal(t, !tt.blind, srv.AssertExactlyOnce(rec, 2), "%v", rec.errors)
		})
	}
}

// postAs sends a POST with key for tenant (in the Tenant header field) and
// returns the status and body of the answer.
func postAs(t *testing.T, client *http.Client, url, tenant, key string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, url, strings.NewReader("{}"))
	require.NoError(t, err)
	req.Header.Set(idemserver.DefaultKeyHeader, key)
	req.Header.Set("Tenant", tenant)
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// discardingStore holds responses, as a store that commits the handler's
// work with the outcome does, and discards the first run of each request
// it is given: it releases the claim, as a rolled-back transaction would,
// and asks the middleware to run the request again.
type discardingStore struct {
	idemserver.Store
	discards atomic.Int32 // how many more Completes to discard
	// cause is what a discarded Complete reports, wrapped; nil means
	// idemserver.ErrRetryRequest.
	cause error
}

func (s *discardingStore) HoldResponses() bool { return true }

// Claim and TakeOver say to hold each claim's response, as a store that
// commits the handler's work with the outcome does.
func (s *discardingStore) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	res, err := s.Store.Claim(ctx, c)
	res.Hold = res.Claimed
	return res, err
}

func (s *discardingStore) TakeOver(ctx context.Context, c idemserver.Claim, expiredToken string) (idemserver.ClaimResult, error) {
	res, err := s.Store.TakeOver(ctx, c, expiredToken)
	res.Hold = res.Claimed
	return res, err
}

// tracedStore wraps a store as a tracing wrapper does: it passes on the
// Store methods and their results, and hides every other method of the
// store, idemserver.ResponseHolder among them.
type tracedStore struct{ s idemserver.Store }

func (t tracedStore) Claim(ctx context.Context, c idemserver.Claim) (idemserver.ClaimResult, error) {
	return t.s.Claim(ctx, c)
}

func (t tracedStore) TakeOver(ctx context.Context, c idemserver.Claim, expiredToken string) (idemserver.ClaimResult, error) {
	return t.s.TakeOver(ctx, c, expiredToken)
}

func (t tracedStore) Complete(ctx context.Context, key idemserver.Key, token string, r *idemserver.Response, expires time.Time) error {
	return t.s.Complete(ctx, key, token, r, expires)
}

func (t tracedStore) Release(ctx context.Context, key idemserver.Key, token string) error {
	return t.s.Release(ctx, key, token)
}

func (t tracedStore) Extend(ctx context.Context, key idemserver.Key, token string, leaseExpires time.Time) error {
	return t.s.Extend(ctx, key, token, leaseExpires)
}

func (s *discardingStore) Complete(ctx context.Context, key idemserver.Key, token string, r *idemserver.Response, expires time.Time) error {
	if err := s.discard(ctx, key, token); err != nil {
		return err
	}
	return s.Store.Complete(ctx, key, token, r, expires)
}

// discard releases the claim and reports why, while Completes are to be
// discarded, and returns nil after.
func (s *discardingStore) discard(ctx context.Context, key idemserver.Key, token string) error {
	if s.discards.Add(-1) < 0 {
		return nil
	}
	if err := s.Store.Release(ctx, key, token); err != nil {
		return err
	}
	cause := s.cause
	if cause == nil {
		cause = idemserver.ErrRetryRequest
	}
	return fmt.Errorf("serialization failure: %w", cause)
}

// discardingPackedStore is a discardingStore over a memory store that the
// middleware reaches through its packed methods.
type discardingPackedStore struct {
	*discardingStore
	packed *idemserver.MemoryStore
}

func (s discardingPackedStore) ClaimPacked(ctx context.Context, c idemserver.PackedClaim) (idemserver.PackedClaimResult, error) {
	return s.packed.ClaimPacked(ctx, c)
}

func (s discardingPackedStore) CompletePacked(ctx context.Context, c idemserver.PackedCompletion) error {
	if err := s.discard(ctx, c.Key, c.Token); err != nil {
		return err
	}
	return s.packed.CompletePacked(ctx, c)
}

// countingServer returns a Server over store whose handler answers 201 and
// counts its runs in calls, and a client of it; both close when the test
// ends.
func countingServer(t *testing.T, store idemserver.Store, calls *atomic.Int32) (*Server, *http.Client) {
	srv := NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		created(w, r)
	}), WithStore(store))
	t.Cleanup(srv.Close)
	client := rawClient()
	t.Cleanup(client.CloseIdleConnections)
	return srv, client
}

// TestLedgerDiscardedRunIsNoExecution checks that a run whose work a store
// that holds responses discarded, and which the middleware then ran again
// in the same request, is not counted, while two requests that both run
// the handler through such a store still make a duplicate.
func TestLedgerDiscardedRunIsNoExecution(t *testing.T) {
	for _, tt := range []struct {
		name     string
		discards int32
		store    func(idemserver.Store) idemserver.Store
		runs     int
	}{
		{"first run discarded", 1, nil, 1},
		{"two runs discarded", 2, nil, 1},
		{"store forgets the key", 0, func(s idemserver.Store) idemserver.Store { return forgetfulStore{s} }, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			store := &discardingStore{Store: memoryStore(t, tt.store)}
			store.discards.Store(tt.discards)
			var calls atomic.Int32
			srv, client := countingServer(t, store, &calls)

			assert.Equal(t, outcome{status: http.StatusCreated}, post(t.Context(), client, srv.URL, "k"))
			second := post(t.Context(), client, srv.URL, "k")
			assert.Equal(t, http.StatusCreated, second.status)
			assert.Equal(t, tt.discards+int32(tt.runs), calls.Load(), "the handler's runs")
			assert.Equal(t, map[string]int{"k": tt.runs}, srv.Executions())
			rec := &recordingTB{TB: t}
			assert.Equal(t, tt.runs == 1, srv.AssertExactlyOnce(rec, 1), "%v", rec.errors)
			assert.Empty(t, srv.WrongReplays())
		})
	}
}

// TestLedgerDiscardedRunBehindAWrapper checks that a store that holds
// responses is known for one by its claims, which say so, when a wrapper
// hides its idemserver.ResponseHolder method: the run it discarded, and
// the middleware ran again, is not counted either.
func TestLedgerDiscardedRunBehindAWrapper(t *testing.T) {
	store := &discardingStore{Store: memoryStore(t, nil)}
	store.discards.Store(1)
	var calls atomic.Int32
	srv, client := countingServer(t, tracedStore{store}, &calls)

	assert.Equal(t, outcome{status: http.StatusCreated}, post(t.Context(), client, srv.URL, "k"))
	assert.Equal(t, int32(2), calls.Load(), "the discarded run and the one that ran again")
	assert.Equal(t, map[string]int{"k": 1}, srv.Executions())
	rec := &recordingTB{TB: t}
	assert.True(t, srv.AssertExactlyOnce(rec, 1), "%v", rec.errors)
}

// TestLedgerRolledBackRunIsNoExecution checks that a run whose work a store
// that holds responses discarded is not counted when the middleware does
// not run it again, but answers 503: the store rolled it back, or asked
// for more reruns than the middleware makes. The client's retry runs the
// handler once more, which is the key's one execution, not a duplicate.
func TestLedgerRolledBackRunIsNoExecution(t *testing.T) {
	for _, tt := range []struct {
		name     string
		discards int32
		cause    error
	}{
		{"rolled back", 1, idemserver.ErrRolledBack},
		{"every rerun discarded", idemserver.MaxReruns + 1, idemserver.ErrRetryRequest},
	} {
		for _, packed := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/packed=%v", tt.name, packed), func(t *testing.T) {
				mem := idemserver.NewMemoryStore()
				t.Cleanup(func() { _ = mem.Close() })
				discarding := &discardingStore{Store: mem, cause: tt.cause}
				discarding.discards.Store(tt.discards)
				var store idemserver.Store = discarding
				if packed {
					store = discardingPackedStore{discarding, mem}
				}
				var calls atomic.Int32
				srv, client := countingServer(t, store, &calls)

				first := post(t.Context(), client, srv.URL, "k")
				assert.Equal(t, http.StatusServiceUnavailable, first.status, "the store kept nothing of the first request")
				assert.Empty(t, srv.Executions(), "a run the store discarded")
				assert.Equal(t, outcome{status: http.StatusCreated}, post(t.Context(), client, srv.URL, "k"))
				assert.Equal(t, outcome{status: http.StatusCreated, replayed: true}, post(t.Context(), client, srv.URL, "k"))
				assert.Equal(t, tt.discards+1, calls.Load(), "the handler's runs")
				assert.Equal(t, map[string]int{"k": 1}, srv.Executions())
				rec := &recordingTB{TB: t}
				assert.True(t, srv.AssertExactlyOnce(rec, 1), "%v", rec.errors)
			})
		}
	}
}
