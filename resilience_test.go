package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"
)

// fakeHost is a base transport answering every attempt with its current
// status (or error) and counting the attempts that reached it. It needs no
// network, so it works inside a synctest bubble.
type fakeHost struct {
	mu     sync.Mutex
	status int
	err    error
	hits   atomic.Int32
}

func newFakeHost(status int) *fakeHost { return &fakeHost{status: status} }

func (h *fakeHost) set(status int, err error) {
	h.mu.Lock()
	h.status, h.err = status, err
	h.mu.Unlock()
}

func (h *fakeHost) RoundTrip(r *http.Request) (*http.Response, error) {
	h.hits.Add(1)
	if r.Body != nil {
		r.Body.Close()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.err != nil {
		return nil, h.err
	}
	return okResponse(r, h.status), nil
}

func get(t *testing.T, ctx context.Context, rawURL string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, rawURL, nil)
	require.NoError(t, err)
	return req
}

// roundTrip sends req and closes the response, returning its status or the
// error.
func roundTrip(rt http.RoundTripper, req *http.Request) (int, error) {
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

// hookRecorder collects what the attempt hook was given.
type hookRecorder struct{ recorder[Attempt] }

func (h *hookRecorder) hook(a Attempt) { h.add(a) }

func (h *hookRecorder) reasons() []Reason {
	var rs []Reason
	for _, a := range h.all() {
		rs = append(rs, a.Reason)
	}
	return rs
}

func (h *hookRecorder) changes() []BreakerChange {
	var cs []BreakerChange
	for _, a := range h.all() {
		cs = append(cs, a.BreakerChanges...)
	}
	return cs
}

func TestResilienceDefaults(t *testing.T) {
	tests := []struct {
		name                         string
		opts                         []Option
		budget, breakers, rateLimits bool
	}{
		{"defaults: budget and breaker on, rate limit off", nil, true, true, false},
		{"no budget", []Option{WithBudget(nil)}, false, true, false},
		{"no breaker", []Option{WithoutBreaker()}, true, false, false},
		{"rate limit", []Option{WithRateLimit(10, 1)}, true, true, true},
		{"rate of zero is off", []Option{WithRateLimit(0, 1)}, true, true, false},
		{"breaker settings", []Option{WithoutBreaker(), WithBreaker(BreakerSettings{OpenTimeout: time.Minute})}, true, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := NewTransport(nil, tt.opts...)
			assert.Equal(t, tt.budget, tr.cfg.budget != nil, "budget")
			assert.Equal(t, tt.breakers, tr.breakers != nil, "breakers")
			assert.Equal(t, tt.rateLimits, tr.limiters != nil, "rate limits")
		})
	}
	tr := NewTransport(nil, WithBreaker(BreakerSettings{OpenTimeout: time.Minute}))
	assert.Equal(t, time.Minute, tr.breakers.settings.OpenTimeout)
	assert.Equal(t, uint32(DefaultBreakerConsecutiveFailures), tr.breakers.settings.ConsecutiveFailures)

	limited := NewTransport(nil, WithHostLimits(10, time.Second), WithHostLimits(0, -1))
	assert.Equal(t, 10, limited.cfg.maxHosts, "zero or less keeps the value")
	assert.Equal(t, time.Second, limited.cfg.idleHost)
	assert.Equal(t, DefaultMaxHosts, NewTransport(nil).cfg.maxHosts)
	assert.Equal(t, DefaultIdleHostTimeout, NewTransport(nil).cfg.idleHost)

	shared := NewBudget()
	a, b := NewTransport(nil, WithBudget(shared)), NewTransport(nil, WithBudget(shared))
	assert.Same(t, a.cfg.budget, b.cfg.budget)
	assert.NotSame(t, NewTransport(nil).cfg.budget, NewTransport(nil).cfg.budget, "one budget per Transport by default")
}

func TestHostKey(t *testing.T) {
	for raw, want := range map[string]string{
		"http://a.example/x":         "http://a.example:80",
		"http://a.example:80/y":      "http://a.example:80",
		"HTTPS://A.Example/":         "https://a.example:443",
		"https://a.example:8443/":    "https://a.example:8443",
		"http://[::1]:9000/":         "http://[::1]:9000",
		"http://user@127.0.0.1/path": "http://127.0.0.1:80",
		// A zone names an interface, whose name is case-sensitive: only
		// the address is folded.
		"http://[FE80::1%25eth0]:8080/": "http://[fe80::1%eth0]:8080",
		"http://[fe80::1%25ETH0]:8080/": "http://[fe80::1%ETH0]:8080",
	} {
		u, err := url.Parse(raw)
		require.NoError(t, err)
		assert.Equal(t, want, hostKey(u), raw)
	}
}

// An open breaker fails fast and sends nothing: the server counts no hits.
func TestOpenBreakerSendsNothing(t *testing.T) {
	srv := newServer(t, status(503))
	rec := &hookRecorder{}
	tr := NewTransport(newBaseTransport(t), WithBackoff(noWait), WithBudget(nil), WithAttemptHook(rec.hook),
		WithBreaker(BreakerSettings{ConsecutiveFailures: 3, OpenTimeout: time.Hour}))

	// The third failure opens the breaker: no fourth attempt, and the
	// request ends with the last response.
	code, err := roundTrip(tr, post(t, context.Background(), srv.URL, "x"))
	require.NoError(t, err)
	assert.Equal(t, 503, code)
	assert.EqualValues(t, 3, srv.hits.Load())
	assert.Equal(t, []Reason{ReasonBackoff, ReasonBackoff, ReasonCircuitOpen}, rec.reasons())

	for range 10 {
		body := newTrackedBody("y")
		req, err := http.NewRequest(http.MethodPost, srv.URL, body)
		require.NoError(t, err)
		_, err = roundTrip(tr, req)
		require.ErrorIs(t, err, ErrCircuitOpen)
		var re *RetryError
		require.ErrorAs(t, err, &re)
		assert.Equal(t, 0, re.Attempts)
		assert.Equal(t, ReasonCircuitOpen, re.Reason)
		assert.EqualValues(t, 1, body.closes.Load(), "the caller's body is closed even though nothing was sent")
	}
	assert.EqualValues(t, 3, srv.hits.Load(), "nothing sent while open")
	assert.Equal(t, BreakerOpen, tr.breakers.state(hostKey(mustURL(t, srv.URL))))
}

func mustURL(t *testing.T, raw string) *url.URL {
	u, err := url.Parse(raw)
	require.NoError(t, err)
	return u
}

// 4xx responses, 429 included, never trip the breaker; 5xx and network
// errors do.
func TestWhatTripsTheBreaker(t *testing.T) {
	tests := []struct {
		name  string
		reply func(http.ResponseWriter, *http.Request)
		trips bool
		// Requests that fail with ErrCircuitOpen: the 17 refused outright,
		// and the one the breaker cut short if it ended with an error.
		wantOpen int
	}{
		{"400", status(400), false, 0},
		{"404", status(404), false, 0},
		{"409 with Retry-After", status(409, "Retry-After", "0"), false, 0},
		{"422", status(422), false, 0},
		{"429", status(429), false, 0},
		{"200", status(200), false, 0},
		{"500", status(500), true, 17},
		{"503", status(503), true, 17},
		{"connection dropped", hangUp, true, 18},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, tt.reply)
			tr := NewTransport(newBaseTransport(t), WithBackoff(noWait), WithBudget(nil),
				WithMaxAttempts(2), WithBreaker(BreakerSettings{ConsecutiveFailures: 5, OpenTimeout: time.Hour}))
			var open int
			for range 20 {
				_, err := roundTrip(tr, post(t, context.Background(), srv.URL, "x"))
				if errors.Is(err, ErrCircuitOpen) {
					open++
				}
			}
			state := tr.breakers.state(hostKey(mustURL(t, srv.URL)))
			if tt.trips {
				assert.Equal(t, BreakerOpen, state)
				assert.EqualValues(t, 5, srv.hits.Load(), "five failures, then nothing")
				assert.Equal(t, tt.wantOpen, open, "two requests of two attempts, one cut short, then refusals")
			} else {
				assert.Equal(t, BreakerClosed, state)
				assert.Zero(t, open)
				assert.GreaterOrEqual(t, srv.hits.Load(), int32(20), "every request reached the server")
			}
		})
	}
}

// The caller's own cancellation says nothing about the host.
func TestCallerCancellationDoesNotTrip(t *testing.T) {
	tr := NewTransport(roundTripFunc(func(r *http.Request) (*http.Response, error) {
		<-r.Context().Done()
		return nil, r.Context().Err()
	}), WithBreaker(BreakerSettings{ConsecutiveFailures: 1}))
	for range 10 {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := roundTrip(tr, get(t, ctx, "http://a.example/"))
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, ErrCircuitOpen)
	}
	assert.Equal(t, BreakerClosed, tr.breakers.state("http://a.example:80"))
}

// Through the Transport: closed, open, half-open, then closed again or open
// again, with every change reaching the hook and the logger.
func TestBreakerLifecycleThroughTransport(t *testing.T) {
	for _, recovered := range []bool{true, false} {
		name := map[bool]string{true: "probes succeed", false: "probe fails"}[recovered]
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				host := newFakeHost(503)
				rec := &hookRecorder{}
				var logs bytes.Buffer
				tr := NewTransport(host, WithMaxAttempts(1), WithAttemptHook(rec.hook),
					WithLogger(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))),
					WithBreaker(BreakerSettings{ConsecutiveFailures: 2, HalfOpenProbes: 2, OpenTimeout: 3 * time.Second}))
				const u = "http://a.example/"
				for range 2 {
					code, err := roundTrip(tr, get(t, t.Context(), u))
					require.NoError(t, err)
					require.Equal(t, 503, code)
				}
				_, err := roundTrip(tr, get(t, t.Context(), u))
				require.ErrorIs(t, err, ErrCircuitOpen)

				time.Sleep(3*time.Second + time.Nanosecond)
				if recovered {
					host.set(200, nil)
				} else {
					host.set(0, syscall.ECONNREFUSED)
				}
				_, _ = roundTrip(tr, get(t, t.Context(), u))
				_, err = roundTrip(tr, get(t, t.Context(), u))
				h := "http://a.example:80"
				want := []BreakerChange{
					{h, BreakerClosed, BreakerOpen},
					{h, BreakerOpen, BreakerHalfOpen},
				}
				if recovered {
					require.NoError(t, err)
					want = append(want, BreakerChange{h, BreakerHalfOpen, BreakerClosed})
				} else {
					require.ErrorIs(t, err, ErrCircuitOpen)
					want = append(want, BreakerChange{h, BreakerHalfOpen, BreakerOpen})
				}
				assert.Equal(t, want, rec.changes())
				assert.Equal(t, []Reason{ReasonAttemptsExhausted, ReasonAttemptsExhausted, ReasonCircuitOpen}, rec.reasons()[:3])
				assert.Contains(t, logs.String(), `level=WARN msg="idemhttp: circuit breaker open" host=http://a.example:80 from=closed to=open`)
				assert.Contains(t, logs.String(), `level=INFO msg="idemhttp: circuit breaker half-open"`)
				assert.NotContains(t, logs.String(), `reason="circuit open"`, "refusals are logged at Debug only")
				assert.EqualValues(t, map[bool]int32{true: 4, false: 3}[recovered], host.hits.Load())
			})
		})
	}
}

func TestBudgetRefusesRetries(t *testing.T) {
	t.Run("response: the last one is returned", func(t *testing.T) {
		srv := newServer(t, status(503))
		rec := &hookRecorder{}
		budget := NewBudget(BudgetRatio(0.5), BudgetMinRetriesPerSecond(0))
		tr := NewTransport(newBaseTransport(t), WithBackoff(noWait), WithoutBreaker(),
			WithBudget(budget), WithAttemptHook(rec.hook))

		// First request: 1 first attempt allows floor(0.5) = 0 retries.
		code, err := roundTrip(tr, post(t, context.Background(), srv.URL, "x"))
		require.NoError(t, err)
		assert.Equal(t, 503, code)
		// Second: 2 first attempts allow one retry, then refuse.
		code, err = roundTrip(tr, post(t, context.Background(), srv.URL, "x"))
		require.NoError(t, err)
		assert.Equal(t, 503, code)

		assert.EqualValues(t, 3, srv.hits.Load())
		assert.Equal(t, []Reason{ReasonBudgetExhausted, ReasonBackoff, ReasonBudgetExhausted}, rec.reasons())
		assert.Equal(t, BudgetStats{FirstAttempts: 2, Retries: 1, Refused: 2}, budget.Stats())
	})
	t.Run("error: wraps ErrBudgetExhausted and the last error", func(t *testing.T) {
		host := newFakeHost(0)
		host.set(0, syscall.ECONNREFUSED)
		tr := NewTransport(host, WithBackoff(noWait), WithoutBreaker(),
			WithBudget(NewBudget(BudgetMinRetriesPerSecond(0))))
		_, err := roundTrip(tr, get(t, context.Background(), "http://a.example/"))
		require.ErrorIs(t, err, ErrBudgetExhausted)
		require.ErrorIs(t, err, syscall.ECONNREFUSED)
		var re *RetryError
		require.ErrorAs(t, err, &re)
		assert.Equal(t, 1, re.Attempts)
		assert.Contains(t, err.Error(), "1 attempt, budget exhausted")
	})
}

// Two Transports sharing a Budget draw on one allowance.
func TestSharedBudget(t *testing.T) {
	host := newFakeHost(503)
	budget := NewBudget(BudgetMinRetriesPerSecond(0), BudgetRatio(1))
	a := NewTransport(host, WithBackoff(noWait), WithoutBreaker(), WithBudget(budget), WithMaxAttempts(3))
	b := NewTransport(host, WithBackoff(noWait), WithoutBreaker(), WithBudget(budget), WithMaxAttempts(3))
	_, _ = roundTrip(a, get(t, context.Background(), "http://a.example/")) // 1 first: 1 retry
	_, _ = roundTrip(b, get(t, context.Background(), "http://a.example/")) // 2 firsts: 1 more retry
	assert.EqualValues(t, 4, host.hits.Load())
	assert.Equal(t, BudgetStats{FirstAttempts: 2, Retries: 2, Refused: 2}, budget.Stats())
}

// A request the budget or the breaker refuses leaves its operation's key
// pending, so the next call for the operation sends the same key.
func TestRefusedOperationKeepsItsKey(t *testing.T) {
	tests := []struct {
		name    string
		opts    []Option
		wantErr error // of the second call, nil if it gets the 503
	}{
		{"budget refuses", []Option{WithoutBreaker(), WithBudget(NewBudget(BudgetMinRetriesPerSecond(0)))}, nil},
		{"breaker refuses", []Option{WithBudget(nil), WithBreaker(BreakerSettings{ConsecutiveFailures: 1, OpenTimeout: time.Hour})}, ErrCircuitOpen},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, status(503))
			store := NewMemoryKeyStore()
			tr := NewTransport(newBaseTransport(t), append(tt.opts, WithBackoff(noWait), WithKeyStore(store))...)
			ctx := WithOperation(context.Background(), "order-1")

			code, err := roundTrip(tr, post(t, ctx, srv.URL, "x"))
			require.NoError(t, err)
			assert.Equal(t, 503, code)
			code, err = roundTrip(tr, post(t, ctx, srv.URL, "x"))
			if tt.wantErr != nil {
				require.ErrorIs(t, err, tt.wantErr)
			} else {
				require.NoError(t, err)
				assert.Equal(t, 503, code)
			}

			pending, err := store.Pending(context.Background())
			require.NoError(t, err)
			require.Len(t, pending, 1)
			assert.Equal(t, "order-1", pending[0].Operation)
			for _, k := range srv.keys() {
				assert.Equal(t, pending[0].Key, k, "every attempt sent the pending key")
			}
		})
	}
}

func TestRateLimitThroughTransport(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		host := newFakeHost(200)
		tr := NewTransport(host, WithRateLimit(10, 1), WithMaxAttempts(1))
		const u = "http://a.example/"
		start := time.Now()
		for range 5 {
			code, err := roundTrip(tr, get(t, t.Context(), u))
			require.NoError(t, err)
			require.Equal(t, 200, code)
		}
		assert.Equal(t, 400*time.Millisecond, time.Since(start), "one at once, then one per 100ms")

		// A 429 halves the rate: the next attempt comes 200ms later.
		host.set(429, nil)
		_, _ = roundTrip(tr, get(t, t.Context(), u))
		host.set(200, nil)
		start = time.Now()
		_, _ = roundTrip(tr, get(t, t.Context(), u))
		assert.Equal(t, 200*time.Millisecond, time.Since(start))

		// Retries wait for the limiter too.
		host.set(503, nil)
		retrying := NewTransport(host, WithRateLimit(10, 1), WithBackoff(noWait), WithMaxAttempts(3))
		start = time.Now()
		_, _ = roundTrip(retrying, get(t, t.Context(), u))
		assert.Equal(t, 200*time.Millisecond, time.Since(start))

		// A wait that would pass the deadline is not started; nothing is sent.
		_, _ = roundTrip(tr, get(t, t.Context(), u))
		hits := host.hits.Load()
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Millisecond)
		defer cancel()
		_, err := roundTrip(tr, get(t, ctx, u))
		require.ErrorIs(t, err, ErrWaitPastDeadline)
		assert.Equal(t, hits, host.hits.Load())
		assert.Equal(t, BreakerClosed, tr.breakers.state("http://a.example:80"), "the refused wait is not a failure")
	})
}

// Many goroutines share a Transport against a failing host: the race
// detector stays quiet, every request ends with a 503 or a refusal, and the
// breaker bounds what reaches the host.
func TestResilienceConcurrent(t *testing.T) {
	srv := newServer(t, status(503))
	budget := NewBudget()
	tr := NewTransport(newBaseTransport(t), WithBackoff(noWait), WithBudget(budget),
		WithBreaker(BreakerSettings{OpenTimeout: time.Hour}), WithRateLimit(rate.Inf, 1))
	var wg sync.WaitGroup
	var refused, failed atomic.Int32
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				code, err := roundTrip(tr, post(t, context.Background(), srv.URL, "x"))
				switch {
				case errors.Is(err, ErrCircuitOpen):
					refused.Add(1)
				case assert.NoError(t, err) && assert.Equal(t, 503, code):
					failed.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	assert.EqualValues(t, 32*20, refused.Load()+failed.Load())
	assert.Greater(t, refused.Load(), int32(32*20-64), "almost all requests refused once open")
	assert.LessOrEqual(t, srv.hits.Load(), int32(5+3*32), "the tripping failures and those in flight")
}

// A client calling many distinct hosts keeps state for a bounded number.
func TestTransportHostStateIsBounded(t *testing.T) {
	budget := NewBudget(BudgetMaxHosts(16))
	tr := NewTransport(newFakeHost(200), WithHostLimits(8, time.Hour), WithRateLimit(rate.Inf, 1), WithBudget(budget))
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 250 {
				u := "http://h" + strconv.Itoa(g) + "-" + strconv.Itoa(i) + ".example/"
				code, err := roundTrip(tr, get(t, context.Background(), u))
				assert.NoError(t, err)
				assert.Equal(t, 200, code)
			}
		}()
	}
	wg.Wait()
	now := time.Now()
	assert.LessOrEqual(t, tr.breakers.hosts.Len(now), 8)
	assert.LessOrEqual(t, tr.limiters.hosts.Len(now), 8)
	assert.LessOrEqual(t, budget.hosts.Len(now), 16)
	assert.EqualValues(t, 2000, budget.Stats().FirstAttempts)
}

// Goroutines switch between many hosts, some failing, on one Transport: each
// host's breaker, budget and rate limiter are its own. A failing host's
// breaker opens once, its change is reported once and named for it, and no
// healthy host is ever refused or charged for another's failures.
func TestPerHostStateUnderConcurrentHostSwitching(t *testing.T) {
	const hosts, goroutines, rounds = 24, 8, 30
	bad := func(host string) bool { n, _ := strconv.Atoi(host[1:3]); return n%3 == 0 }
	var hits [hosts]atomic.Int32
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		n, _ := strconv.Atoi(r.URL.Hostname()[1:3])
		hits[n].Add(1)
		if bad(r.URL.Hostname()) {
			return okResponse(r, 503), nil
		}
		return okResponse(r, 200), nil
	})
	rec := &hookRecorder{}
	budget := NewBudget(BudgetRatio(0), BudgetMinRetriesPerSecond(0))
	tr := NewTransport(base, WithBackoff(noWait), WithBudget(budget), WithAttemptHook(rec.hook),
		WithRateLimit(rate.Inf, 1), WithHostLimits(hosts, time.Hour),
		WithBreaker(BreakerSettings{ConsecutiveFailures: 1, OpenTimeout: time.Hour}))
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range rounds * hosts {
				host := fmt.Sprintf("h%02d.example", (g+i)%hosts)
				code, err := roundTrip(tr, get(t, context.Background(), "http://"+host+"/"))
				if bad(host) {
					if err != nil {
						assert.ErrorIs(t, err, ErrCircuitOpen, host)
					} else {
						assert.Equal(t, 503, code, host)
					}
					continue
				}
				if assert.NoError(t, err, host) {
					assert.Equal(t, 200, code, host)
				}
			}
		}()
	}
	wg.Wait()

	var opened []string
	for _, ch := range rec.changes() {
		assert.Equal(t, BreakerClosed, ch.From, "%+v", ch)
		assert.Equal(t, BreakerOpen, ch.To, "%+v", ch)
		opened = append(opened, ch.Host)
	}
	var wantOpened []string
	for n := range hosts {
		host := fmt.Sprintf("h%02d.example", n)
		state := tr.breakers.state("http://" + host + ":80")
		if bad(host) {
			wantOpened = append(wantOpened, "http://"+host+":80")
			assert.Equal(t, BreakerOpen, state, host)
			assert.LessOrEqual(t, hits[n].Load(), int32(goroutines), "%s: one failure opens it, plus those in flight", host)
		} else {
			assert.Equal(t, BreakerClosed, state, host)
			assert.EqualValues(t, goroutines*rounds, hits[n].Load(), host)
		}
	}
	assert.ElementsMatch(t, wantOpened, opened, "each failing host's opening reported once, under its own name")
	assert.Zero(t, budget.Stats().Retries, "no budget for retries on any host")
}
