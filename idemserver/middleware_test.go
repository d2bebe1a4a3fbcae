package idemserver

import (
	"context"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// claimCounter counts Claim calls and closes reached once n were made.
type claimCounter struct {
	Store
	n       int64
	calls   atomic.Int64
	reached chan struct{}
}

func (s *claimCounter) Claim(ctx context.Context, c Claim) (ClaimResult, error) {
	if s.calls.Add(1) == s.n {
		close(s.reached)
	}
	return s.Store.Claim(ctx, c)
}

func TestConcurrentSameKeyRunsHandlerOnce(t *testing.T) {
	const n = 200
	for _, tt := range []struct {
		name string
		opts []Option
	}{
		{name: "refuse in flight"},
		{name: "wait in flight", opts: []Option{WithWaitInFlight(time.Minute)}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			store := &claimCounter{Store: NewMemoryStore(), n: n, reached: make(chan struct{})}
			var calls atomic.Int64
			h := Middleware(store, tt.opts...)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				// Hold the claim until every request has asked for it.
				select {
				case <-store.reached:
				case <-r.Context().Done():
				}
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Location", "/orders/1")
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, `{"id":1}`)
			}))

			replies := make([]*httptest.ResponseRecorder, n)
			var wg sync.WaitGroup
			for i := range n {
				wg.Go(func() {
					replies[i] = serve(h, newRequest(http.MethodPost, "/orders", "k1", `{"item":"book"}`))
				})
			}
			wg.Wait()

			assert.EqualValues(t, 1, calls.Load(), "handler runs")
			var original *httptest.ResponseRecorder
			var replayed, conflicts int
			for _, w := range replies {
				switch {
				case w.Code == http.StatusConflict:
					conflicts++
					assert.NotEmpty(t, w.Header().Get("Retry-After"))
				case w.Header().Get(ReplayedHeader) == "true":
					replayed++
				default:
					require.Nil(t, original, "two originals")
					original = w
				}
			}
			require.NotNil(t, original)
			assert.Equal(t, http.StatusCreated, original.Code)
			assert.Equal(t, n-1, replayed+conflicts)
			if len(tt.opts) > 0 {
				assert.Zero(t, conflicts, "waiting requests replay")
			}
			for _, w := range replies {
				if w.Header().Get(ReplayedHeader) != "true" {
					continue
				}
				assert.Equal(t, original.Code, w.Code)
				assert.Equal(t, original.Body.Bytes(), w.Body.Bytes())
				h := w.Header().Clone()
				h.Del(ReplayedHeader)
				assert.Equal(t, original.Header(), h)
			}
		})
	}
}

func TestMalformedKeyIsRefused(t *testing.T) {
	for _, tt := range []struct {
		name   string
		values []string
	}{
		{"empty", []string{""}},
		{"blank", []string{" \t "}},
		{"256 characters", []string{strings.Repeat("k", 256)}},
		{"256 characters quoted", []string{`"` + strings.Repeat("k", 256) + `"`}},
		{"control character", []string{"abc\x01def"}},
		{"control character quoted", []string{"\"abc\x7fdef\""}},
		{"inner space bare", []string{"abc def"}},
		{"non-ASCII", []string{"clé"}},
		{"non-ASCII quoted", []string{`"clé"`}},
		{"unterminated quote", []string{`"abc`}},
		{"stray closing quote", []string{`abc"`}},
		{"text after quote", []string{`"abc"def`}},
		{"parameters", []string{`"abc";a=1`}},
		{"invalid escape", []string{`"ab\c"`}},
		{"dangling escape", []string{`"abc\`}},
		{"empty quoted", []string{`""`}},
		{"two fields", []string{"a", "b"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := &countingHandler{}
			r := newRequest(http.MethodPost, "/x", "", "body")
			r.Header[DefaultKeyHeader] = tt.values
			w := serve(Middleware(nil)(h), r)
			decodeProblem(t, w, ProblemMalformedKey, http.StatusBadRequest)
			assert.Zero(t, h.calls.Load(), "handler runs")
		})
	}
}

func TestKeyForms(t *testing.T) {
	// The bare and the quoted form of one key are the same key.
	h := &countingHandler{}
	mw := Middleware(nil)(h)
	first := serve(mw, newRequest(http.MethodPost, "/x", "a-b_c.1", "body"))
	require.Equal(t, http.StatusCreated, first.Code)
	second := serve(mw, newRequest(http.MethodPost, "/x", `"a-b_c.1"`, "body"))
	assert.Equal(t, "true", second.Header().Get(ReplayedHeader))
	assert.EqualValues(t, 1, h.calls.Load())
}

func TestMissingKey(t *testing.T) {
	for _, tt := range []struct {
		name      string
		require   bool
		method    string
		wantCode  int
		wantCalls int64
	}{
		{"optional POST passes twice", false, http.MethodPost, http.StatusCreated, 2},
		{"optional PATCH passes twice", false, http.MethodPatch, http.StatusCreated, 2},
		{"required POST refused", true, http.MethodPost, http.StatusBadRequest, 0},
		{"required PATCH refused", true, http.MethodPatch, http.StatusBadRequest, 0},
		{"required GET passes", true, http.MethodGet, http.StatusCreated, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var opts []Option
			if tt.require {
				opts = append(opts, RequireKey())
			}
			h := &countingHandler{}
			mw := Middleware(nil, opts...)(h)
			for range 2 {
				w := serve(mw, newRequest(tt.method, "/x", "", "body"))
				assert.Equal(t, tt.wantCode, w.Code)
				assert.Empty(t, w.Header().Get(ReplayedHeader))
				if w.Code == http.StatusBadRequest {
					decodeProblem(t, w, ProblemMissingKey, http.StatusBadRequest)
				}
			}
			assert.Equal(t, tt.wantCalls, h.calls.Load())
		})
	}
}

func TestUnkeyedMethodPassesThrough(t *testing.T) {
	for _, tt := range []struct {
		name    string
		opts    []Option
		method  string
		replays bool
	}{
		{"GET by default", nil, http.MethodGet, false},
		{"PUT by default", nil, http.MethodPut, false},
		{"PUT when keyed", []Option{WithMethods("put")}, http.MethodPut, true},
		{"POST when not keyed", []Option{WithMethods(http.MethodPut)}, http.MethodPost, false},
		{"post in lower case", nil, "post", true},
		{"patch in mixed case", nil, "Patch", true},
		{"put in lower case when keyed", []Option{WithMethods(http.MethodPut)}, "put", true},
		{"get in lower case", nil, "get", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := &countingHandler{}
			mw := Middleware(nil, tt.opts...)(h)
			serve(mw, newRequest(tt.method, "/x", "k", "b"))
			w := serve(mw, newRequest(tt.method, "/x", "k", "b"))
			assertReplayed(t, tt.replays, w, h)
		})
	}
}

// TestKeyedMethodInAnyCase sends a keyed request whose method is spelled in
// lower case, as a browser's fetch sends "patch" and as Go's client sends
// whatever it is given, through a real server: net/http hands the method to
// the handler as sent, and a handler that does not check it acts on it, so
// the middleware must deduplicate it as it does PATCH.
func TestKeyedMethodInAnyCase(t *testing.T) {
	h := &countingHandler{}
	srv := httptest.NewServer(Middleware(nil)(h))
	defer srv.Close()
	for i := range 2 {
		req, err := http.NewRequest("patch", srv.URL+"/orders/1", strings.NewReader("b"))
		require.NoError(t, err)
		req.Header.Set(DefaultKeyHeader, "k")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		require.NoError(t, resp.Body.Close())
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, i == 1, resp.Header.Get(ReplayedHeader) == "true", "attempt %d replayed", i+1)
	}
	assert.Equal(t, int64(1), h.calls.Load(), "handler runs")
}

// TestKeyedMethods checks which methods are keyed, in any case and
// whatever the case they were configured in, and that no other is.
func TestKeyedMethods(t *testing.T) {
	for _, tt := range []struct {
		configured []string
		keyed      []string
		not        []string
	}{
		{nil, []string{"POST", "post", "Post", "pOsT", "PATCH", "patch"}, []string{"GET", "get", "PUT", "HEAD", "POSTS", "pos", ""}},
		{[]string{"delete", "Put"}, []string{"DELETE", "delete", "Delete", "PUT", "put"}, []string{"POST", "post", "PATCH", "GET"}},
	} {
		c := newConfig([]Option{WithMethods(tt.configured...)})
		for _, m := range tt.keyed {
			assert.True(t, c.keyed(m), "%v: %q is keyed", tt.configured, m)
		}
		for _, m := range tt.not {
			assert.False(t, c.keyed(m), "%v: %q is not keyed", tt.configured, m)
		}
	}
}

// TestKeyedHeadInLowerCase keys HEAD and sends it as "head", which HTTP
// and net/http take for a method of its own, one whose response has a
// body: the middleware, which records the response as net/http sends it,
// replays the same answer.
func TestKeyedHeadInLowerCase(t *testing.T) {
	calls := 0
	srv := httptest.NewServer(Middleware(nil, WithMethods(http.MethodHead))(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			calls++
			w.Header().Set("Content-Length", "5")
			if r.Method != http.MethodHead {
				_, _ = io.WriteString(w, "hello")
			}
		})))
	defer srv.Close()
	var first string
	for i := range 2 {
		req, err := http.NewRequest("head", srv.URL+"/x", nil)
		require.NoError(t, err)
		req.Header.Set(DefaultKeyHeader, "k")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		assert.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Equal(t, i == 1, resp.Header.Get(ReplayedHeader) == "true", "attempt %d replayed", i+1)
		if i == 0 {
			first = string(b)
		}
		assert.Equal(t, "hello", string(b))
		assert.Equal(t, first, string(b))
	}
	assert.Equal(t, 1, calls, "handler runs")
}

// TestCustomKeyHeader sends keys in a header named by WithKeyHeader in lower
// case, through a real server, spelled as a client might: net/http
// canonicalises the name it receives, and the middleware the one it is given.
func TestCustomKeyHeader(t *testing.T) {
	h := &countingHandler{}
	srv := httptest.NewServer(Middleware(nil, WithKeyHeader("x-request-key"))(h))
	defer srv.Close()
	for i, name := range []string{"x-request-key", "X-Request-Key", "X-REQUEST-KEY"} {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader("b"))
		require.NoError(t, err)
		req.Header[name] = []string{"k"} // sent as spelled
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		require.NoError(t, resp.Body.Close())
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, i > 0, resp.Header.Get(ReplayedHeader) == "true", "%s replayed", name)
	}
	assert.Equal(t, int64(1), h.calls.Load(), "handler runs")
}

// TestInvalidKeyHeaderPanics checks that a key header name no request can
// carry, such as one copied with its colon, is refused when the middleware
// is made: it would otherwise pass every keyed request to the handler as
// unkeyed, and so run each of its retries again, without a word.
func TestInvalidKeyHeaderPanics(t *testing.T) {
	for _, name := range []string{"Idempotency-Key:", "Idempotency-Key ", "Idempotency Key", "Idempotency-Kéy"} {
		assert.PanicsWithValue(t, "idemserver: WithKeyHeader: "+strconv.Quote(name)+" is not a header field name",
			func() { Middleware(nil, WithKeyHeader(name)) }, "%q", name)
	}
	assert.NotPanics(t, func() { Middleware(nil, WithKeyHeader("")) }, "the default")
}

func TestFingerprintMismatch(t *testing.T) {
	base := struct{ method, target, body string }{http.MethodPost, "/orders?a=1", "one"}
	for _, tt := range []struct {
		name                 string
		method, target, body string
		mismatch             bool
	}{
		{"same request replays", base.method, base.target, base.body, false},
		{"body", base.method, base.target, "two", true},
		{"body prefix", base.method, base.target, "on", true},
		{"path", base.method, "/order?a=1", base.body, true},
		{"query", base.method, "/orders?a=2", base.body, true},
		{"query removed", base.method, "/orders", base.body, true},
		{"path and query split differently", base.method, "/orders%3Fa=1", base.body, true},
		{"method", http.MethodPatch, base.target, base.body, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := &countingHandler{}
			mw := Middleware(nil)(h)
			first := serve(mw, newRequest(base.method, base.target, "k", base.body))
			require.Equal(t, http.StatusCreated, first.Code)
			w := serve(mw, newRequest(tt.method, tt.target, "k", tt.body))
			if tt.mismatch {
				decodeProblem(t, w, ProblemFingerprintMismatch, http.StatusUnprocessableEntity)
			} else {
				assert.Equal(t, "true", w.Header().Get(ReplayedHeader))
				assert.Equal(t, first.Body.String(), w.Body.String())
			}
			assert.EqualValues(t, 1, h.calls.Load())
		})
	}
}

func TestFingerprintMismatchWhileInProgress(t *testing.T) {
	store := NewMemoryStore()
	clock := newFakeClock()
	fp := fingerprint(http.MethodPost, "/x", "", []byte("one"))
	_, err := store.Claim(t.Context(), Claim{Key: Key{Key: "k"}, Fingerprint: fp, Token: "t", Now: clock.Now(), LeaseExpires: clock.Now().Add(time.Minute)})
	require.NoError(t, err)
	h := &countingHandler{}
	mw := Middleware(store, WithClock(clock.Now))(h)

	w := serve(mw, newRequest(http.MethodPost, "/x", "k", "two"))
	decodeProblem(t, w, ProblemFingerprintMismatch, http.StatusUnprocessableEntity)

	// Nor does an expired lease let a different request take the key.
	clock.Advance(2 * time.Minute)
	w = serve(mw, newRequest(http.MethodPost, "/x", "k", "two"))
	decodeProblem(t, w, ProblemFingerprintMismatch, http.StatusUnprocessableEntity)
	assert.Zero(t, h.calls.Load())
}

func TestScopeIsolation(t *testing.T) {
	tenant := func(r *http.Request) string { return r.Header.Get("X-Tenant") }
	req := func(tenantName, body string) *http.Request {
		r := newRequest(http.MethodPost, "/orders", "shared-key", body)
		r.Header.Set("X-Tenant", tenantName)
		return r
	}

	t.Run("completed key of A is not replayed to B", func(t *testing.T) {
		h := &countingHandler{}
		mw := Middleware(nil, WithScope(tenant))(h)
		a := serve(mw, req("A", "a's order"))
		require.Equal(t, http.StatusCreated, a.Code)
		for _, other := range []struct{ tenant, body string }{{"B", "a's order"}, {"C", "c's order"}} {
			w := serve(mw, req(other.tenant, other.body))
			assert.Equal(t, http.StatusCreated, w.Code, "%s runs its own request", other.tenant)
			assert.Empty(t, w.Header().Get(ReplayedHeader), "%s must not see A's response", other.tenant)
			assert.NotEqual(t, a.Body.String(), w.Body.String())
		}
		assert.EqualValues(t, 3, h.calls.Load())
		again := serve(mw, req("A", "a's order"))
		assert.Equal(t, "true", again.Header().Get(ReplayedHeader))
		assert.Equal(t, a.Body.String(), again.Body.String())
	})

	t.Run("in-progress key of A does not block B", func(t *testing.T) {
		entered, release := make(chan struct{}), make(chan struct{})
		var calls atomic.Int64
		mw := Middleware(nil, WithScope(tenant))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			if r.Header.Get("X-Tenant") == "A" {
				close(entered)
				<-release
			}
			w.WriteHeader(http.StatusCreated)
		}))
		done := make(chan *httptest.ResponseRecorder)
		go func() { done <- serve(mw, req("A", "order")) }()
		<-entered
		b := serve(mw, req("B", "order"))
		assert.Equal(t, http.StatusCreated, b.Code)
		a2 := serve(mw, req("A", "order"))
		assert.Equal(t, http.StatusConflict, a2.Code, "A's own retry still waits")
		close(release)
		assert.Equal(t, http.StatusCreated, (<-done).Code)
		assert.EqualValues(t, 2, calls.Load())
	})
}

func TestOutcomeByStatus(t *testing.T) {
	for _, tt := range []struct {
		status int
		stored bool
	}{
		{http.StatusOK, true},
		{http.StatusCreated, true},
		{http.StatusNoContent, true},
		{http.StatusSeeOther, true},
		{http.StatusBadRequest, true},
		{http.StatusNotFound, true},
		{http.StatusConflict, true},
		{http.StatusUnprocessableEntity, true},
		{http.StatusRequestTimeout, false},
		{http.StatusTooEarly, false},
		{http.StatusTooManyRequests, false},
		{http.StatusGone, true},
		{http.StatusInternalServerError, false},
		{http.StatusBadGateway, false},
		{http.StatusServiceUnavailable, false},
		{statusClientClosedRequest, false},
		{599, false},
	} {
		t.Run(http.StatusText(tt.status)+" "+itoa(int64(tt.status)), func(t *testing.T) {
			h := &countingHandler{status: tt.status}
			mw := Middleware(nil)(h)
			first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			require.Equal(t, tt.status, first.Code)
			second := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, tt.status, second.Code)
			if tt.stored {
				assert.EqualValues(t, 1, h.calls.Load())
				assert.Equal(t, "true", second.Header().Get(ReplayedHeader))
				assert.Equal(t, first.Body.String(), second.Body.String())
			} else {
				assert.EqualValues(t, 2, h.calls.Load(), "a released key runs again")
				assert.Empty(t, second.Header().Get(ReplayedHeader))
			}
		})
	}
}

func TestPanicReleasesClaim(t *testing.T) {
	for _, tt := range []struct {
		name  string
		value any
	}{
		{"panic", "boom"},
		{"abort handler", http.ErrAbortHandler},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var events []Event
			store := NewMemoryStore()
			h := &countingHandler{}
			panicking := Middleware(store, WithObserver(func(e Event) { events = append(events, e) }))(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					w.WriteHeader(http.StatusCreated)
					panic(tt.value)
				}))
			assert.PanicsWithValue(t, tt.value, func() {
				serve(panicking, newRequest(http.MethodPost, "/x", "k", "b"))
			})
			assert.Zero(t, store.Len(), "claim released")
			require.Len(t, events, 1)
			assert.Equal(t, OutcomeReleased, events[0].Outcome)
			assert.ErrorIs(t, events[0].Err, ErrHandlerPanicked)

			w := serve(Middleware(store)(h), newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, http.StatusCreated, w.Code)
			assert.EqualValues(t, 1, h.calls.Load())
		})
	}
}

func TestTTLExpiry(t *testing.T) {
	for _, tt := range []struct {
		name    string
		opts    []Option
		ttl     time.Duration
		elapsed time.Duration
		replay  bool
	}{
		{"default TTL, just before", nil, DefaultTTL, DefaultTTL - time.Second, true},
		{"default TTL, at expiry", nil, DefaultTTL, DefaultTTL, false},
		{"short TTL, before", []Option{WithTTL(time.Hour)}, time.Hour, 59 * time.Minute, true},
		{"short TTL, after", []Option{WithTTL(time.Hour)}, time.Hour, time.Hour + time.Second, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			h := &countingHandler{}
			mw := Middleware(nil, append(tt.opts, WithClock(clock.Now))...)(h)
			serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			clock.Advance(tt.elapsed)
			w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assertReplayed(t, tt.replay, w, h)
		})
	}
}

func TestLeaseTakeover(t *testing.T) {
	for _, tt := range []struct {
		name     string
		lease    time.Duration
		elapsed  time.Duration
		takeOver bool
	}{
		{"default lease, not expired", 0, DefaultLease - time.Second, false},
		{"default lease, expired", 0, DefaultLease, true},
		{"short lease, not expired", 10 * time.Second, 9 * time.Second, false},
		{"short lease, expired", 10 * time.Second, 11 * time.Second, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			store := NewMemoryStore()
			lease := tt.lease
			if lease == 0 {
				lease = DefaultLease
			}
			// A claim made as a handler would that then crashed, leaving
			// its record in progress.
			crashedKey, crashedToken := Key{Key: "k"}, "crashed-token"
			res, err := store.Claim(t.Context(), Claim{
				Key: crashedKey, Fingerprint: fingerprint(http.MethodPost, "/x", "", []byte("b")),
				Token: crashedToken, Now: clock.Now(), LeaseExpires: clock.Now().Add(lease),
			})
			require.NoError(t, err)
			require.True(t, res.Claimed)

			h := &countingHandler{}
			mw := Middleware(store, WithClock(clock.Now), WithLease(tt.lease))(h)
			clock.Advance(tt.elapsed)
			w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			if !tt.takeOver {
				decodeProblem(t, w, ProblemInProgress, http.StatusConflict)
				assert.Zero(t, h.calls.Load())
				return
			}
			assert.Equal(t, http.StatusCreated, w.Code)
			assert.EqualValues(t, 1, h.calls.Load())
			// The crashed holder has lost its lease.
			assert.ErrorIs(t, store.Complete(t.Context(), crashedKey, crashedToken, &Response{Status: 200}, clock.Now()), ErrLeaseLost)
			assert.ErrorIs(t, store.Release(t.Context(), crashedKey, crashedToken), ErrLeaseLost)
			again := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, "true", again.Header().Get(ReplayedHeader))
		})
	}
}

func TestWaitInFlight(t *testing.T) {
	for _, tt := range []struct {
		name       string
		wait       time.Duration
		finishesIn time.Duration // zero: never
		cancel     bool
		replay     bool
	}{
		{"first finishes within the wait", time.Second, 300 * time.Millisecond, false, true},
		{"first finishes after the wait", time.Second, 5 * time.Second, false, false},
		{"no wait", 0, 300 * time.Millisecond, false, false},
		{"waiting client goes away", time.Minute, 0, true, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				release := make(chan struct{})
				var calls int
				mw := Middleware(nil, WithWaitInFlight(tt.wait))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					calls++
					<-release
					w.WriteHeader(http.StatusCreated)
					_, _ = io.WriteString(w, "done")
				}))
				firstDone := make(chan *httptest.ResponseRecorder, 1)
				go func() { firstDone <- serve(mw, newRequest(http.MethodPost, "/x", "k", "b")) }()
				synctest.Wait() // the first request holds the claim
				if tt.finishesIn > 0 {
					time.AfterFunc(tt.finishesIn, func() { close(release) })
				}
				ctx, cancel := context.WithCancel(t.Context())
				defer cancel()
				if tt.cancel {
					time.AfterFunc(10*time.Second, cancel)
				}
				start := time.Now()
				w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b").WithContext(ctx))
				if tt.replay {
					assert.Equal(t, http.StatusCreated, w.Code)
					assert.Equal(t, "true", w.Header().Get(ReplayedHeader))
					assert.Equal(t, "done", w.Body.String())
					assert.Less(t, time.Since(start), tt.finishesIn+maxPoll+time.Millisecond, "replays soon after the first finishes")
				} else {
					decodeProblem(t, w, ProblemInProgress, http.StatusConflict)
					assert.LessOrEqual(t, time.Since(start), max(tt.wait, 10*time.Second), "gives up by the bound")
				}
				if tt.finishesIn == 0 {
					close(release)
				}
				<-firstDone
				assert.Equal(t, 1, calls)
			})
		})
	}
}

// TestWaitInFlightAfterRelease has several requests wait for a first that
// then fails with 500, which releases the key: one of the waiters claims it
// and runs the handler, and the others wait on and replay its outcome, so
// the handler acts once, for the one request that got an outcome.
func TestWaitInFlightAfterRelease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		release := make(chan struct{})
		var calls atomic.Int64
		mw := Middleware(nil, WithWaitInFlight(time.Minute))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if calls.Add(1) == 1 {
				<-release
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			time.Sleep(time.Second)
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "done")
		}))
		first := make(chan *httptest.ResponseRecorder, 1)
		go func() { first <- serve(mw, newRequest(http.MethodPost, "/x", "k", "b")) }()
		synctest.Wait() // the first request holds the claim
		var wg sync.WaitGroup
		waiters := make([]*httptest.ResponseRecorder, 8)
		for i := range waiters {
			wg.Go(func() { waiters[i] = serve(mw, newRequest(http.MethodPost, "/x", "k", "b")) })
		}
		time.Sleep(time.Second) // every waiter polls
		close(release)
		wg.Wait()
		assert.Equal(t, http.StatusInternalServerError, (<-first).Code)
		replayed := 0
		for _, w := range waiters {
			assert.Equal(t, http.StatusCreated, w.Code, w.Body.String())
			assert.Equal(t, "done", w.Body.String())
			if w.Header().Get(ReplayedHeader) == "true" {
				replayed++
			}
		}
		assert.Equal(t, len(waiters)-1, replayed, "replays")
		assert.Equal(t, int64(2), calls.Load(), "handler runs")
	})
}

func TestObserver(t *testing.T) {
	var events []Event
	mw := Middleware(nil, RequireKey(), WithObserver(func(e Event) { events = append(events, e) }))(&countingHandler{})
	serve(mw, newRequest("POST", "/x", "k", "b"))
	serve(mw, newRequest("POST", "/x", "k", "b"))
	serve(mw, newRequest("POST", "/x", "k", "c"))
	serve(mw, newRequest("POST", "/x", "", "b"))
	serve(mw, newRequest("POST", "/x", "a b", "b"))
	serve(mw, newRequest("GET", "/x", "k", ""))
	var got []string
	for _, e := range events {
		got = append(got, e.Outcome.String())
		assert.NotNil(t, e.Request)
	}
	assert.Equal(t, []string{"executed", "replayed", "mismatch", "rejected", "rejected"}, got)
	assert.Equal(t, Key{Key: "k"}, events[0].Key)
	assert.Equal(t, 201, events[0].Status)
	assert.Equal(t, "Outcome(99)", Outcome(99).String())
}

// The observer hears of every request with a keyed method once, also of
// one without a key whose handler panicked, before the panic goes on.
func TestObserverHearsOfUnkeyedPanic(t *testing.T) {
	var events []Event
	mw := Middleware(nil, WithObserver(func(e Event) { events = append(events, e) }))(
		http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic("boom") }))
	assert.PanicsWithValue(t, "boom", func() { serve(mw, newRequest(http.MethodPost, "/x", "", "b")) })
	require.Len(t, events, 1)
	assert.Equal(t, OutcomeUnkeyed, events[0].Outcome)
	assert.ErrorIs(t, events[0].Err, ErrHandlerPanicked)
	assert.Zero(t, events[0].Status)
}

// Requests served at once, whose buffers are reused from one request to
// the next, each see their own body and get their own response, also when
// it is replayed; bodies over the pooled size are among them.
func TestConcurrentRequestsKeepTheirBodies(t *testing.T) {
	echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(w, r.Body)
	})
	mw := Middleware(nil)(echo)
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 20 {
				id := itoa(int64(g)) + "-" + itoa(int64(i))
				body := strings.Repeat("<"+id+">", 1+(g*i)%7*2000)
				key := "k-" + id
				for range 2 { // run, then replay
					w := serve(mw, newRequest(http.MethodPost, "/x", key, body))
					if !assert.Equal(t, http.StatusOK, w.Code) || !assert.Equal(t, body, w.Body.String(), key) {
						return
					}
				}
			}
		})
	}
	wg.Wait()
}

// TestReleasesStatus checks the exported rule against what the middleware
// does: a status it releases runs the handler again on the retry, and any
// other is replayed.
func TestReleasesStatus(t *testing.T) {
	for _, tt := range []struct {
		status   int
		releases bool
	}{
		{http.StatusOK, false}, {http.StatusCreated, false}, {http.StatusNoContent, false},
		{http.StatusFound, false}, {http.StatusBadRequest, false}, {http.StatusConflict, false},
		{http.StatusUnprocessableEntity, false}, {http.StatusRequestTimeout, true},
		{http.StatusTooEarly, true}, {http.StatusTooManyRequests, true}, {499, true},
		{http.StatusInternalServerError, true}, {http.StatusServiceUnavailable, true}, {599, true},
	} {
		t.Run(itoa(int64(tt.status)), func(t *testing.T) {
			assert.Equal(t, tt.releases, ReleasesStatus(tt.status))
			h := &countingHandler{status: tt.status}
			mw := Middleware(NewMemoryStore())(h)
			serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assertReplayed(t, !tt.releases, w, h)
		})
	}
}

// TestReleasesResponse checks the exported rule for a response, status and
// header fields, against what the middleware does.
func TestReleasesResponse(t *testing.T) {
	for _, tt := range []struct {
		name       string
		status     int
		retryAfter string
		releases   bool
		field      string // the name the field is set under, not canonicalised; "" for Retry-After
	}{
		{"conflict", http.StatusConflict, "", false, ""},
		{"conflict with Retry-After", http.StatusConflict, "1", true, ""},
		{"created with Retry-After", http.StatusCreated, "1", false, ""},
		{"too many requests", http.StatusTooManyRequests, "", true, ""},
		{"server error with Retry-After", http.StatusServiceUnavailable, "1", true, ""},
		// net/http sends a field set straight into the map under the name
		// it was set by, and a client reads it in any case.
		{"conflict with retry-after set in the map", http.StatusConflict, "1", true, "retry-after"},
		{"conflict with RETRY-AFTER set in the map", http.StatusConflict, "1", true, "RETRY-AFTER"},
		{"conflict with an empty retry-after", http.StatusConflict, "", false, "retry-after"},
		{"conflict with another field set in the map", http.StatusConflict, "1", false, "retry-later"},
		// A value a client ignores makes the 409 a final conflict to it
		// (idemhttp's Transport does not retry it, and releases the
		// operation's key): stored, every retry gets that same answer.
		{"conflict with Retry-After: soon", http.StatusConflict, "soon", false, ""},
		{"conflict with a negative Retry-After", http.StatusConflict, "-1", false, ""},
		{"conflict with a fractional Retry-After", http.StatusConflict, "1.5", false, ""},
		{"conflict with an invalid retry-after set in the map", http.StatusConflict, "0, 1", false, "retry-after"},
		{"conflict with an HTTP-date", http.StatusConflict, "Sun, 06 Nov 1994 08:49:37 GMT", true, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := http.Header{}
			switch {
			case tt.field != "":
				h[tt.field] = []string{tt.retryAfter}
			case tt.retryAfter != "":
				h.Set("Retry-After", tt.retryAfter)
			}
			assert.Equal(t, tt.releases, ReleasesResponse(tt.status, h))
			handler := &countingHandler{status: tt.status}
			mw := Middleware(NewMemoryStore())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				maps.Copy(w.Header(), h)
				handler.ServeHTTP(w, r)
			}))
			serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			w := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, tt.status, w.Code)
			assertReplayed(t, !tt.releases, w, handler)
		})
	}
}
