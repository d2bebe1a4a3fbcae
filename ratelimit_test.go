package idemhttp

import (
	"context"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"
)

const rlHost = "http://a.example:80"

func TestAdaptiveRate(t *testing.T) {
	tests := []struct {
		name     string
		statuses []int
		want     rate.Limit
	}{
		{"starts at the configured rate", nil, 100},
		{"a 429 halves it", []int{429}, 50},
		{"each 429 halves it again", []int{429, 429, 429}, 12.5},
		{"never below a hundredth", []int{429, 429, 429, 429, 429, 429, 429, 429, 429, 429}, 1},
		{"a success adds a hundredth back", []int{429, 429, 200}, 26},
		{"redirects count as success", []int{429, 304, 302}, 52},
		{"never above the configured rate", []int{429, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200}, 100},
		{"other statuses and errors change nothing", []int{429, 500, 503, 404, 400, 0}, 50},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := newLimiters(100, 1, 8, time.Minute)
			for _, s := range tt.statuses {
				l.observe(rlHost, s)
			}
			assert.InDelta(t, float64(tt.want), float64(l.current(rlHost)), 1e-9)
			assert.InDelta(t, float64(tt.want), float64(l.hosts.Get(rlHost, time.Now()).lim.Limit()), 1e-9)
			assert.Equal(t, rate.Limit(100), l.current("http://other.example:80"), "hosts adapt separately")
		})
	}
}

// The limiter paces attempts in (fake) time, and a lowered rate paces them
// further apart.
func TestRateLimitWaitPaces(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := newLimiters(10, 1, 8, time.Minute)
		ctx := t.Context()
		start := time.Now()
		for range 5 {
			require.NoError(t, l.wait(ctx, rlHost))
		}
		assert.Equal(t, 400*time.Millisecond, time.Since(start), "one at once, then one per 100ms")

		l.observe(rlHost, 429) // 5 per second
		start = time.Now()
		for range 3 {
			require.NoError(t, l.wait(ctx, rlHost))
		}
		assert.Equal(t, 600*time.Millisecond, time.Since(start))
	})
}

func TestRateLimitWaitRespectsContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := newLimiters(1, 1, 8, time.Minute)
		require.NoError(t, l.wait(t.Context(), rlHost)) // takes the only token

		// The next token is 1s away: a deadline sooner than that fails at once.
		ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
		defer cancel()
		start := time.Now()
		err := l.wait(ctx, rlHost)
		require.ErrorIs(t, err, ErrWaitPastDeadline)
		assert.Zero(t, time.Since(start), "gave up without waiting")

		// Canceled while waiting: returns the context's error and gives the
		// token back, so the next waiter is not pushed back.
		ctx, cancel = context.WithCancel(t.Context())
		go func() {
			time.Sleep(300 * time.Millisecond)
			cancel()
		}()
		require.ErrorIs(t, l.wait(ctx, rlHost), context.Canceled)
		assert.Equal(t, 300*time.Millisecond, time.Since(start))
		require.NoError(t, l.wait(t.Context(), rlHost))
		assert.Equal(t, time.Second, time.Since(start), "the canceled reservation was returned")

		// An already ended context fails without touching the limiter.
		require.ErrorIs(t, l.wait(ctx, rlHost), context.Canceled)
	})
}

func TestRateLimitersBoundedAndConcurrent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := newLimiters(1000, 10, 4, time.Minute)
		var wg sync.WaitGroup
		for g := range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				host := []string{"http://a:80", "http://b:80", "http://c:80", "http://d:80", "http://e:80", "http://f:80"}[g%6]
				for i := range 50 {
					assert.NoError(t, l.wait(t.Context(), host))
					l.observe(host, []int{200, 429}[i%2])
				}
			}()
		}
		wg.Wait()
		assert.Equal(t, 4, l.hosts.Len(time.Now()))
		time.Sleep(time.Minute + time.Nanosecond)
		assert.Equal(t, 0, l.hosts.Len(time.Now()), "idle hosts are forgotten")
	})
}
