package idemserver

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeClock is a clock that moves only when told to.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// countingHandler counts its calls and answers with a fixed response that
// names the call, so a replay is told apart from a second execution.
type countingHandler struct {
	calls  atomic.Int64
	status int
	body   string
}

func (h *countingHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := h.calls.Add(1)
	_, _ = io.Copy(io.Discard, r.Body)
	status := h.status
	if status == 0 {
		status = http.StatusCreated
	}
	w.Header().Set("Content-Type", "text/plain")
	w.Header().Set("X-Call", itoa(n))
	w.WriteHeader(status)
	_, _ = io.WriteString(w, h.body+"call "+itoa(n))
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// newRequest builds a keyed request; an empty key sends no key header.
func newRequest(method, target, key, body string) *http.Request {
	r := httptest.NewRequest(method, target, strings.NewReader(body))
	if key != "" {
		r.Header.Set(DefaultKeyHeader, key)
	}
	return r
}

func serve(h http.Handler, r *http.Request) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// decodeProblem checks that w holds a problem document of type typ and
// returns it.
func decodeProblem(t *testing.T, w *httptest.ResponseRecorder, typ string, status int) problem {
	t.Helper()
	require.Equal(t, status, w.Code, "body: %s", w.Body)
	assert.Equal(t, "application/problem+json", w.Header().Get("Content-Type"))
	var p problem
	require.NoError(t, json.Unmarshal(w.Body.Bytes(), &p), "body: %s", w.Body)
	assert.Equal(t, typ, p.Type)
	assert.Equal(t, status, p.Status)
	assert.NotEmpty(t, p.Title)
	return p
}

// stubStore is a Store whose methods can be replaced one by one; the
// others go to a MemoryStore. It holds the MemoryStore in a named field
// rather than embedding it, so that it does not get the MemoryStore's
// PackedStore methods, which would bypass its own: the middleware sees a
// plain Store.
type stubStore struct {
	MemoryStore *MemoryStore
	claim       func(context.Context, Claim) (ClaimResult, error)
	takeOver    func(context.Context, Claim, string) (ClaimResult, error)
	complete    func(context.Context, Key, string, *Response, time.Time) error
	release     func(context.Context, Key, string) error
	extend      func(context.Context, Key, string, time.Time) error
}

func newStubStore() *stubStore { return &stubStore{MemoryStore: NewMemoryStore()} }

func (s *stubStore) Claim(ctx context.Context, c Claim) (ClaimResult, error) {
	if s.claim != nil {
		return s.claim(ctx, c)
	}
	return s.MemoryStore.Claim(ctx, c)
}

func (s *stubStore) TakeOver(ctx context.Context, c Claim, token string) (ClaimResult, error) {
	if s.takeOver != nil {
		return s.takeOver(ctx, c, token)
	}
	return s.MemoryStore.TakeOver(ctx, c, token)
}

func (s *stubStore) Complete(ctx context.Context, k Key, token string, resp *Response, expires time.Time) error {
	if s.complete != nil {
		return s.complete(ctx, k, token, resp, expires)
	}
	return s.MemoryStore.Complete(ctx, k, token, resp, expires)
}

func (s *stubStore) Len() int { return s.MemoryStore.Len() }

func (s *stubStore) Release(ctx context.Context, k Key, token string) error {
	if s.release != nil {
		return s.release(ctx, k, token)
	}
	return s.MemoryStore.Release(ctx, k, token)
}

func (s *stubStore) Extend(ctx context.Context, k Key, token string, leaseExpires time.Time) error {
	if s.extend != nil {
		return s.extend(ctx, k, token, leaseExpires)
	}
	return s.MemoryStore.Extend(ctx, k, token, leaseExpires)
}

// assertReplayed checks that the second of two requests with one key, w,
// was a replay and the handler ran once, or was not and the handler ran
// twice.
func assertReplayed(t *testing.T, replayed bool, w *httptest.ResponseRecorder, h *countingHandler) {
	t.Helper()
	assert.Equal(t, replayed, w.Header().Get(ReplayedHeader) == "true", "replayed")
	want := int64(2)
	if replayed {
		want = 1
	}
	assert.Equal(t, want, h.calls.Load(), "handler runs")
}
