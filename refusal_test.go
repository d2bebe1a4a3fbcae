package idemhttp

import (
	"context"
	"errors"
	"io"
	"math"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A retry refused before it is sent ends the request with the outcome of
// the attempt before it, body included, as when retries run out.
func TestRefusedRetryReturnsLastOutcome(t *testing.T) {
	t.Run("rate-limit wait past the deadline", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			host := newFakeHost(503)
			var attempts []Attempt
			tr := NewTransport(host, WithRateLimit(1, 1), WithBackoff(noWait),
				WithAttemptHook(func(a Attempt) { attempts = append(attempts, a) }))
			ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
			defer cancel()

			code, err := roundTrip(tr, get(t, ctx, "http://a.example/"))

			require.NoError(t, err)
			assert.Equal(t, 503, code)
			assert.EqualValues(t, 1, host.hits.Load())
			require.Len(t, attempts, 2)
			assert.False(t, attempts[1].Sent)
			assert.Equal(t, ReasonWaitPastDeadline, attempts[1].Reason)
		})
	})
	t.Run("breaker opened during the backoff", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			host := newFakeHost(503)
			tr := NewTransport(host, WithBudget(nil),
				WithBackoff(backoffFunc(func(int) time.Duration { return time.Second })),
				WithBreaker(BreakerSettings{ConsecutiveFailures: 2, OpenTimeout: time.Hour}))
			var (
				wg   sync.WaitGroup
				code int
				err  error
			)
			wg.Go(func() { code, err = roundTrip(tr, get(t, context.Background(), "http://a.example/")) })
			time.Sleep(500 * time.Millisecond) // the first request waits before its retry
			_, _ = roundTrip(tr, get(t, context.Background(), "http://a.example/"))
			wg.Wait()

			require.NoError(t, err)
			assert.Equal(t, 503, code)
			assert.EqualValues(t, 2, host.hits.Load(), "the refused retry was not sent")
		})
	})
	t.Run("breaker refusal after an error keeps the error", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			calls := 0
			base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
				calls++
				return nil, io.ErrUnexpectedEOF
			})
			tr := NewTransport(base, WithBudget(nil), WithBackoff(noWait), WithMaxAttempts(5),
				WithBreaker(BreakerSettings{ConsecutiveFailures: 2, OpenTimeout: time.Hour}))

			_, err := tr.RoundTrip(get(t, context.Background(), "http://a.example/"))

			assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
			assert.ErrorIs(t, err, ErrCircuitOpen)
			var re *RetryError
			require.ErrorAs(t, err, &re)
			assert.Equal(t, 2, re.Attempts)
			assert.Equal(t, 2, calls)
		})
	})
}

// stallingBody sends a little, then blocks until closed, like a server that
// stops mid-body.
type stallingBody struct {
	once   sync.Once
	closed chan struct{}
	sent   bool
}

func (b *stallingBody) Read(p []byte) (int, error) {
	if !b.sent {
		b.sent = true
		return copy(p, "partial"), nil
	}
	<-b.closed
	return 0, errors.New("read on closed body")
}

func (b *stallingBody) Close() error {
	b.once.Do(func() { close(b.closed) })
	return nil
}

func TestStalledDiscardedBodyDoesNotBlockRetry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		calls := 0
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			calls++
			if calls == 1 {
				resp := okResponse(r, 503)
				resp.Body = &stallingBody{closed: make(chan struct{})}
				return resp, nil
			}
			return okResponse(r, 200), nil
		})
		start := time.Now()

		code, err := roundTrip(NewTransport(base, WithBackoff(noWait)), get(t, context.Background(), "http://a.example/"))

		require.NoError(t, err)
		assert.Equal(t, 200, code)
		assert.Equal(t, maxDrainTime, time.Since(start), "the stalled body was given up after maxDrainTime")
	})
}

func TestResponseTooLongToHoldIsDroppedNotTruncated(t *testing.T) {
	big := strings.Repeat("x", maxDrain+1)
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		resp := okResponse(r, 503)
		resp.Body = io.NopCloser(strings.NewReader(big))
		return resp, nil
	})
	// The retry is refused (its body cannot be rewound). The 503 before it
	// was too long to hold, so the request ends with an error naming it
	// rather than with a truncated body.
	req := post(t, context.Background(), "http://a.example/", "x")
	req.GetBody = func() (io.ReadCloser, error) { return nil, errors.New("cannot rewind") }

	resp, err := NewTransport(base, WithBackoff(noWait)).RoundTrip(req)

	assert.Nil(t, resp)
	assert.ErrorIs(t, err, ErrBodyNotReplayable)
	assert.ErrorContains(t, err, "503 response dropped")
}

func TestBufferingBodyHonoursContext(t *testing.T) {
	pr, pw := io.Pipe()
	defer pw.Close()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, "POST", "http://a.example/", pr)
	require.NoError(t, err)
	calls := 0
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) { calls++; return okResponse(r, 200), nil })

	done := make(chan error, 1)
	go func() {
		_, err := NewTransport(base).RoundTrip(req)
		done <- err
	}()
	_, _ = pw.Write([]byte("some")) // the body is being read when the caller gives up
	cancel()
	err = <-done
	assert.ErrorIs(t, err, context.Canceled)
	assert.Zero(t, calls)
	_, werr := pw.Write([]byte("more"))
	assert.ErrorIs(t, werr, io.ErrClosedPipe, "the caller's body was closed")
}

func TestHugeBufferLimitKeepsBody(t *testing.T) {
	srv := newServer(t, status(503), status(200))
	req, err := http.NewRequest("POST", srv.URL, io.MultiReader(strings.NewReader("payload")))
	require.NoError(t, err)
	do(t, NewTransport(newBaseTransport(t), WithBodyBufferLimit(math.MaxInt64), WithBackoff(noWait)), req)
	got := srv.received()
	require.Len(t, got, 2)
	assert.Equal(t, "payload", string(got[0].Body))
	assert.Equal(t, "payload", string(got[1].Body))
}

func TestNilURLIsAnError(t *testing.T) {
	body := newTrackedBody("x")
	req := &http.Request{Method: "POST", Header: http.Header{}, Body: body}
	resp, err := NewTransport(roundTripFunc(nil)).RoundTrip(req)
	assert.Nil(t, resp)
	assert.Error(t, err)
	assert.Equal(t, int32(1), body.closes.Load())
}
