package idemhttp

import (
	"context"
	"log/slog"
	"net/http"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// recordHandler is a slog.Handler that keeps what it is given.
type recordHandler struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *recordHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *recordHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.records = append(h.records, r)
	return nil
}
func (h *recordHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *recordHandler) WithGroup(string) slog.Handler      { return h }

func attrs(r slog.Record) map[string]string {
	m := map[string]string{}
	r.Attrs(func(a slog.Attr) bool { m[a.Key] = a.Value.String(); return true })
	return m
}

func TestLoggerRetriesAtDebugGiveUpsAtWarn(t *testing.T) {
	srv := newServer(t, status(503))
	h := &recordHandler{}
	tr := NewTransport(newBaseTransport(t), WithLogger(slog.New(h)), WithBackoff(noWait), WithMaxAttempts(3))
	do(t, tr, post(t, WithOperation(context.Background(), "op-7"), srv.URL, "x"))

	require.Len(t, h.records, 3)
	for i, r := range h.records[:2] {
		assert.Equal(t, slog.LevelDebug, r.Level)
		a := attrs(r)
		assert.Equal(t, "503", a["status"])
		assert.Equal(t, "backoff", a["reason"])
		assert.Equal(t, "op-7", a["operation"])
		assert.Equal(t, srv.keys()[0], a["key"])
		assert.Equal(t, []string{"1", "2"}[i], a["attempt"])
		assert.Contains(t, a, "wait")
	}
	last := h.records[2]
	assert.Equal(t, slog.LevelWarn, last.Level)
	assert.Equal(t, "attempts exhausted", attrs(last)["reason"])
}

func TestLoggerQuietOnSuccess(t *testing.T) {
	srv := newServer(t, status(200))
	h := &recordHandler{}
	do(t, NewTransport(newBaseTransport(t), WithLogger(slog.New(h))), post(t, context.Background(), srv.URL, "x"))
	assert.Empty(t, h.records)
}

func TestAttemptHookSeesEveryAttempt(t *testing.T) {
	// The hang-up comes first: on a reused connection net/http would retry
	// a keyed request itself, unseen by the Transport.
	srv := newServer(t, hangUp, status(503), status(200))
	var got []Attempt
	tr := NewTransport(newBaseTransport(t), WithBackoff(noWait),
		WithAttemptHook(func(a Attempt) { got = append(got, a) }))
	req := post(t, WithOperation(context.Background(), "op-1"), srv.URL, "x")

	do(t, tr, req)

	require.Len(t, got, 3)
	key := srv.keys()[0]
	for i, a := range got {
		assert.Equal(t, i+1, a.Number)
		assert.Equal(t, http.MethodPost, a.Method)
		assert.Equal(t, req.URL.Host, a.Host)
		assert.Equal(t, key, a.Key)
		assert.Equal(t, "op-1", a.Operation)
	}
	assert.Zero(t, got[0].StatusCode)
	assert.Error(t, got[0].Err)
	assert.True(t, got[0].Retrying())
	assert.Equal(t, 503, got[1].StatusCode)
	assert.NoError(t, got[1].Err)
	assert.True(t, got[1].Retrying())
	assert.Equal(t, 200, got[2].StatusCode)
	assert.Equal(t, ReasonSuccess, got[2].Reason)
	assert.False(t, got[2].Retrying())
	assert.Zero(t, got[2].Wait)
}

func TestAttemptElapsedCoversTheAttempt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// The base transport takes 30 ms, then 70 ms: each attempt's
		// Elapsed is its own time up to the response.
		delays := []time.Duration{30 * time.Millisecond, 70 * time.Millisecond}
		statuses := []int{503, 200}
		n := 0
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			time.Sleep(delays[n])
			code := statuses[n]
			n++
			return &http.Response{StatusCode: code, Header: http.Header{}, Body: http.NoBody, Request: r}, nil
		})
		var got []time.Duration
		tr := NewTransport(base, WithBackoff(noWait),
			WithAttemptHook(func(a Attempt) { got = append(got, a.Elapsed) }))
		req, err := http.NewRequest(http.MethodGet, "http://example.com/", nil)
		require.NoError(t, err)

		resp, err := tr.RoundTrip(req)
		require.NoError(t, err)
		resp.Body.Close()

		assert.Equal(t, delays, got)
	})
}
