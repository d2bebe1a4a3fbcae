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
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemhttp/idemhttp"
	"github.com/idemhttp/idemhttp/idemserver"
)

// created answers 201, like a handler that made something.
var created = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.WriteHeader(http.StatusCreated)
	_, _ = io.WriteString(w, "created")
})

// rawClient sends each request on a new connection, without retries of any
// kind, so that every request meets the injector exactly once.
func rawClient() *http.Client {
	return &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
}

// outcome is what a client saw of one request.
type outcome struct {
	err        bool
	status     int
	retryAfter string
	replayed   bool
	bodyErr    bool // the body could not be read to its end
}

// post sends one keyed POST to url and reports what came back.
func post(ctx context.Context, c *http.Client, url, key string) outcome {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/charges", strings.NewReader(`{"amount":100}`))
	if err != nil {
		panic(err)
	}
	req.Header.Set(idemserver.DefaultKeyHeader, key)
	resp, err := c.Do(req)
	if err != nil {
		return outcome{err: true}
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return outcome{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"),
		replayed: resp.Header.Get(idemserver.ReplayedHeader) == "true", bodyErr: err != nil}
}

// faulty is a server or proxy under test: where to send requests, and what
// its injector and the ledger behind it saw.
type faulty struct {
	url   string
	stats func() Stats
	runs  func() map[string]int
}

// servers returns constructors of the two fault injectors: a Server, and a
// Proxy in front of a Server without faults.
func servers() map[string]func(t *testing.T, f Faults, seed int64) faulty {
	return map[string]func(t *testing.T, f Faults, seed int64) faulty{
		"server": func(t *testing.T, f Faults, seed int64) faulty {
			srv := NewServer(created, WithFaults(f), WithSeed(seed))
			t.Cleanup(srv.Close)
			return faulty{url: srv.URL, stats: srv.Stats, runs: srv.Executions}
		},
		"proxy": func(t *testing.T, f Faults, seed int64) faulty {
			srv := NewServer(created)
			t.Cleanup(srv.Close)
			p, err := NewProxy(srv.URL, f, seed)
			require.NoError(t, err)
			t.Cleanup(func() { assert.NoError(t, p.Close()) })
			assert.Equal(t, seed, p.Seed())
			assert.Equal(t, "http://"+p.Addr(), p.URL())
			return faulty{url: p.URL(), stats: p.Stats, runs: srv.Executions}
		},
	}
}

// TestFaultsFireAtTheirRates sends 2000 requests with distinct keys, each
// once, through a Server and through a Proxy, and checks that every request
// meets the fault decided for it, as the client and the ledger see it, and
// that each fault fires at its rate.
func TestFaultsFireAtTheirRates(t *testing.T) {
	for name, start := range servers() {
		t.Run(name, func(t *testing.T) { testFaultsFireAtTheirRates(t, start) })
	}
}

func testFaultsFireAtTheirRates(t *testing.T, start func(*testing.T, Faults, int64) faulty) {
	f := Faults{ResetBefore: .08, LoseResponse: .08, Unavailable: .08, TooManyRequests: .08, Stall: .08,
		CutBody: .08, RetryAfter: 1500 * time.Millisecond, Latency: .2, MaxLatency: time.Millisecond}
	const n, seed = 2000, 20240601
	srv := start(t, f, seed)
	want := map[fault]int{}
	delayed := 0
	decisions := make([]decision, n)
	for i := range decisions {
		decisions[i] = decide(&f, seed, fmt.Sprintf("key k-%d", i), 1)
		want[decisions[i].fault]++
		if decisions[i].delay > 0 {
			delayed++
		}
	}
	assertRate(t, "ResetBefore", want[faultResetBefore], n, f.ResetBefore)
	assertRate(t, "LoseResponse", want[faultLoseResponse], n, f.LoseResponse)
	assertRate(t, "Unavailable", want[faultUnavailable], n, f.Unavailable)
	assertRate(t, "TooManyRequests", want[faultTooManyRequests], n, f.TooManyRequests)
	assertRate(t, "Stall", want[faultStall], n, f.Stall)
	assertRate(t, "CutBody", want[faultCutBody], n, f.CutBody)
	assertRate(t, "Latency", delayed, n, f.Latency)

	client := rawClient()
	defer client.CloseIdleConnections()
	outcomes := make([]outcome, n)
	stallCtx, giveUp := context.WithCancel(t.Context())
	defer giveUp()
	var stalls, others sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range n {
		if decisions[i].fault == faultStall {
			stalls.Go(func() { outcomes[i] = post(stallCtx, client, srv.url, fmt.Sprintf("k-%d", i)) })
			continue
		}
		sem <- struct{}{}
		others.Go(func() {
			defer func() { <-sem }()
			outcomes[i] = post(t.Context(), client, srv.url, fmt.Sprintf("k-%d", i))
		})
	}
	others.Wait()
	// Every stalled request is held until its client gives up.
	require.Eventually(t, func() bool { return srv.stats().Stalled == want[faultStall] },
		10*time.Second, time.Millisecond)
	for i, d := range decisions {
		if d.fault == faultStall {
			assert.Zero(t, outcomes[i], "stalled request %d answered before its client gave up", i)
		}
	}
	giveUp()
	stalls.Wait()

	runs := srv.runs()
	for i, d := range decisions {
		key := fmt.Sprintf("k-%d", i)
		got := outcomes[i]
		switch d.fault {
		case faultResetBefore, faultStall:
			assert.True(t, got.err, "request %d: %+v", i, got)
			assert.Zero(t, runs[key], "request %d ran the handler", i)
		case faultLoseResponse:
			assert.True(t, got.err, "request %d: %+v", i, got)
			assert.Equal(t, 1, runs[key], "request %d did not run the handler", i)
		case faultUnavailable:
			assert.Equal(t, outcome{status: 503}, got, "request %d", i)
			assert.Zero(t, runs[key], "request %d ran the handler", i)
		case faultTooManyRequests:
			assert.Equal(t, outcome{status: 429, retryAfter: "2"}, got, "request %d", i)
			assert.Zero(t, runs[key], "request %d ran the handler", i)
		case faultCutBody:
			assert.Equal(t, outcome{status: 201, bodyErr: true}, got, "request %d", i)
			assert.Equal(t, 1, runs[key], "request %d did not run the handler", i)
		default:
			assert.Equal(t, outcome{status: 201}, got, "request %d", i)
			assert.Equal(t, 1, runs[key], "request %d", i)
		}
	}
	assert.Equal(t, Stats{
		Requests: n, Delayed: delayed,
		ResetBefore: want[faultResetBefore], LostResponses: want[faultLoseResponse],
		Unavailable: want[faultUnavailable], TooManyRequests: want[faultTooManyRequests], Stalled: want[faultStall],
		CutBodies: want[faultCutBody],
	}, srv.stats())
}

// TestSameSeedSameOutcomes sends three attempts of each of 150 keys, keys
// in parallel, to servers (and proxies) with the same and with different
// seeds: the same seed gives each attempt the same fate whatever the
// scheduling.
func TestSameSeedSameOutcomes(t *testing.T) {
	for name, start := range servers() {
		t.Run(name, func(t *testing.T) { testSameSeedSameOutcomes(t, start) })
	}
}

func testSameSeedSameOutcomes(t *testing.T, start func(*testing.T, Faults, int64) faulty) {
	f := Faults{ResetBefore: .15, LoseResponse: .15, Unavailable: .15, TooManyRequests: .15,
		Latency: .3, MaxLatency: 2 * time.Millisecond}
	run := func(seed int64) map[string][3]outcome {
		srv := start(t, f, seed)
		client := rawClient()
		defer client.CloseIdleConnections()
		var mu sync.Mutex
		got := map[string][3]outcome{}
		var wg sync.WaitGroup
		sem := make(chan struct{}, 12)
		for i := range 150 {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				key := fmt.Sprintf("k-%d", i)
				var o [3]outcome
				for a := range o {
					o[a] = post(t.Context(), client, srv.url, key)
				}
				mu.Lock()
				got[key] = o
				mu.Unlock()
			})
		}
		wg.Wait()
		return got
	}
	first := run(99)
	assert.Equal(t, first, run(99))
	assert.NotEqual(t, first, run(100))
}

// TestServerLossyClientExactlyOnce runs an idemhttp client through a lossy
// server: every operation succeeds and the ledger holds one key executed
// once per operation.
func TestServerLossyClientExactlyOnce(t *testing.T) {
	srv := NewServer(created, WithFaults(Faults{ResetBefore: .1, LoseResponse: .15, Unavailable: .1,
		TooManyRequests: .1, Stall: .05, Latency: .2, MaxLatency: 2 * time.Millisecond}))
	defer srv.Close()
	client := srv.Client(idemhttp.WithMaxAttempts(20), idemhttp.WithBudget(nil), idemhttp.WithoutBreaker(),
		idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, 5*time.Millisecond)),
		idemhttp.WithAttemptTimeout(200*time.Millisecond))
	defer client.CloseIdleConnections()

	const operations = 60
	var wg sync.WaitGroup
	var failed atomic.Int32
	for i := range operations {
		wg.Go(func() {
			ctx := idemhttp.WithOperation(t.Context(), fmt.Sprintf("order-%d", i))
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/charges", strings.NewReader(`{}`))
			if !assert.NoError(t, err) {
				return
			}
			resp, err := client.Do(req)
			if err != nil || resp.StatusCode != http.StatusCreated {
				failed.Add(1)
				t.Errorf("order-%d: %v (seed %d)", i, err, srv.Seed())
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		})
	}
	wg.Wait()
	require.Zero(t, failed.Load())
	assert.True(t, srv.AssertExactlyOnce(t, operations))
	st := srv.Stats()
	assert.Positive(t, st.LostResponses, "the test exercises lost responses (seed %d)", srv.Seed())
	assert.Positive(t, st.Replayed, "lost responses were replayed (seed %d)", srv.Seed())
}

// recordingTB captures the failures an assertion reports.
type recordingTB struct {
	testing.TB
	errors []string
}

func (r *recordingTB) Helper() {}
func (r *recordingTB) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

// forgetfulStore is a broken store: every claim succeeds, so every request
// runs the handler.
type forgetfulStore struct{ idemserver.Store }

func (forgetfulStore) Claim(context.Context, idemserver.Claim) (idemserver.ClaimResult, error) {
	return idemserver.ClaimResult{Claimed: true}, nil
}

func (forgetfulStore) Complete(context.Context, idemserver.Key, string, *idemserver.Response, time.Time) error {
	return nil
}

func (forgetfulStore) Release(context.Context, idemserver.Key, string) error { return nil }

func (forgetfulStore) Extend(context.Context, idemserver.Key, string, time.Time) error { return nil }

// TestDuplicatesDetected checks that the ledger catches servers that do not
// keep the promise: the assertion a user relies on must fail when it should.
func TestDuplicatesDetected(t *testing.T) {
	tests := []struct {
		name string
		opts []Option
	}{
		{"middleware does not cover POST", []Option{WithMiddleware(idemserver.WithMethods(http.MethodPut))}},
		{"store forgets keys", []Option{WithStore(forgetfulStore{})}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := NewServer(created, append(tt.opts, WithSeed(5), WithFaults(Faults{LoseResponse: .5}))...)
			defer srv.Close()
			client := srv.Client(idemhttp.WithMaxAttempts(10), idemhttp.WithBudget(nil), idemhttp.WithoutBreaker(),
				idemhttp.WithBackoff(idemhttp.FullJitter(time.Millisecond, time.Millisecond)))
			defer client.CloseIdleConnections()
			for i := range 10 {
				o := post(idemhttp.WithOperation(t.Context(), fmt.Sprint(i)), client, srv.URL, fmt.Sprintf("k-%d", i))
				require.Equal(t, http.StatusCreated, o.status)
			}
			dups := srv.Duplicates()
			require.NotEmpty(t, dups)
			for _, k := range dups {
				assert.Greater(t, srv.Executions()[k], 1, k)
			}
			rec := &recordingTB{TB: t}
			assert.False(t, srv.AssertExactlyOnce(rec, 10))
			require.Len(t, rec.errors, 1)
			assert.Contains(t, rec.errors[0], "(seed 5)")
			assert.Contains(t, rec.errors[0], fmt.Sprintf("%d keys executed more than once: %s (%d executions)",
				len(dups), dups[0], srv.Executions()[dups[0]]))
		})
	}
}

func TestAssertExactlyOnceCountsKeys(t *testing.T) {
	srv := NewServer(created)
	defer srv.Close()
	client := rawClient()
	defer client.CloseIdleConnections()
	for _, key := range []string{"a", "b", "b"} { // b's second request is replayed
		require.Equal(t, http.StatusCreated, post(t.Context(), client, srv.URL, key).status)
	}
	assert.Equal(t, map[string]int{"a": 1, "b": 1}, srv.Executions())
	assert.True(t, srv.AssertExactlyOnce(t, 2))

	for _, ops := range []int{1, 3} {
		rec := &recordingTB{TB: t}
		assert.False(t, srv.AssertExactlyOnce(rec, ops))
		require.Len(t, rec.errors, 1)
		assert.Contains(t, rec.errors[0], fmt.Sprintf("2 keys executed, want one for each of %d operations", ops))
	}
}

// TestLedgerCountsKeptOutcomes checks what counts as an execution: runs
// whose outcome the middleware keeps, not those that ask for a retry.
func TestLedgerCountsKeptOutcomes(t *testing.T) {
	var calls atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch calls.Add(1) {
		case 1:
			w.WriteHeader(http.StatusServiceUnavailable)
		case 2:
			w.WriteHeader(http.StatusTooManyRequests)
		case 3:
			panic(http.ErrAbortHandler)
		default:
			_, _ = io.WriteString(w, "done") // an implicit 200
		}
	})
	srv := NewServer(h)
	defer srv.Close()
	client := rawClient()
	defer client.CloseIdleConnections()
	for _, want := range []outcome{{status: 503}, {status: 429}, {err: true}, {status: 200}, {status: 200, replayed: true}} {
		assert.Equal(t, want, post(t.Context(), client, srv.URL, "k"))
	}
	assert.Equal(t, map[string]int{"k": 1}, srv.Executions())
	assert.Empty(t, srv.Duplicates())

	// Requests without a key are not in the ledger.
	resp, err := client.Post(srv.URL, "text/plain", strings.NewReader("x"))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, map[string]int{"k": 1}, srv.Executions())
}

// TestCloseEndsStalls checks that Close ends a stall whose client would wait
// for ever, and that no goroutine outlives Close.
func TestCloseEndsStalls(t *testing.T) {
	srv := NewServer(created, WithFaults(Faults{Stall: 1}))
	client := srv.Client(idemhttp.WithMaxAttempts(1))
	done := make(chan outcome)
	go func() { done <- post(context.Background(), client, srv.URL, "k") }()
	require.Eventually(t, func() bool { return srv.Stats().Stalled == 1 }, 10*time.Second, time.Millisecond)
	select {
	case o := <-done:
		t.Fatalf("stalled request answered: %+v", o)
	default:
	}
	srv.Close()
	assert.Equal(t, outcome{err: true}, <-done)
	srv.Close() // idempotent
	goleak.VerifyNone(t)

	// A request after Close finds no server.
	assert.True(t, post(t.Context(), rawClient(), srv.URL, "k").err)
}

// TestLatency checks, on a fake clock, that a delayed request waits exactly
// the delay decided for it before it goes on.
func TestLatency(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := Faults{Latency: .5, MinLatency: 10 * time.Millisecond, MaxLatency: 50 * time.Millisecond}
		done := make(chan struct{})
		in := newInjector(created, f, 3, idemserver.DefaultKeyHeader, done, nil)
		var waits []time.Duration
		for i := range 50 {
			req, err := http.NewRequest(http.MethodPost, "/", strings.NewReader("{}"))
			require.NoError(t, err)
			req.Header.Set(idemserver.DefaultKeyHeader, fmt.Sprint(i))
			w := &discardWriter{header: make(http.Header)}
			start := time.Now()
			in.ServeHTTP(w, req)
			want := decide(&f, 3, "key "+fmt.Sprint(i), 1).delay
			assert.Equal(t, want, time.Since(start), "request %d", i)
			if want > 0 {
				waits = append(waits, want)
			}
		}
		assert.Equal(t, len(waits), in.snapshot().Delayed)
		assert.Greater(t, len(waits), 10)
		assert.NotEqual(t, waits[0], waits[1], "delays vary")
	})
}

func TestNewServerPanicsOnInvalidFaults(t *testing.T) {
	defer func() {
		err, _ := recover().(error)
		assert.ErrorIs(t, err, ErrInvalidFaults)
	}()
	NewServer(created, WithFaults(Faults{Stall: 2}))
	t.Fatal("NewServer did not panic")
}

// TestKeyHeaderInAnyCase checks that a key header named in unusual case
// serves the middleware, the ledger and the client alike, and that a name
// no request could carry is refused when the server is made.
func TestKeyHeaderInAnyCase(t *testing.T) {
	s := NewServer(created, WithKeyHeader("x-REQUEST-key"))
	defer s.Close()
	for i := range 2 {
		req, err := http.NewRequest(http.MethodPost, s.URL+"/orders", strings.NewReader("b"))
		require.NoError(t, err)
		req.Header["X-Request-Key"] = []string{"k"}
		resp, err := s.Client().Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		require.NoError(t, resp.Body.Close())
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, i > 0, resp.Header.Get(idemserver.ReplayedHeader) == "true", "attempt %d replayed", i)
	}
	s.AssertExactlyOnce(t, 1)
	assert.Panics(t, func() { NewServer(created, WithKeyHeader("X-Request-Key:")) })
}
