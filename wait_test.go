package idemhttp

import (
	"context"
	"net/http"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// These tests run in a synctest bubble, whose clock advances only when every
// goroutine in it is blocked: waits are exact and take no real time.

func TestRetryAfterSetsTheWait(t *testing.T) {
	tests := []struct {
		name       string
		retryAfter func(now time.Time) string
		opts       []Option
		wantWait   time.Duration
		wantReason Reason
	}{
		{"delta seconds", fixed("5"), nil, 5 * time.Second, ReasonRetryAfter},
		{"IMF-fixdate", date(7*time.Second, http.TimeFormat), nil, 7 * time.Second, ReasonRetryAfter},
		{"RFC 850 date", date(9*time.Second, time.RFC850), nil, 9 * time.Second, ReasonRetryAfter},
		{"asctime date", date(11*time.Second, time.ANSIC), nil, 11 * time.Second, ReasonRetryAfter},
		{"past date uses backoff", date(-time.Hour, http.TimeFormat), nil, time.Second, ReasonBackoff},
		{"shorter than backoff", fixed("0"), nil, time.Second, ReasonBackoff},
		{"garbage ignored", fixed("later"), nil, time.Second, ReasonBackoff},
		{"negative ignored", fixed("-30"), nil, time.Second, ReasonBackoff},
		{"huge capped by default", fixed("86400"), nil, DefaultMaxRetryAfter, ReasonRetryAfter},
		{"huge capped by option", fixed("99999999999"), []Option{WithMaxRetryAfter(20 * time.Second)}, 20 * time.Second, ReasonRetryAfter},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var sent []time.Time
				base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
					sent = append(sent, time.Now())
					if len(sent) == 1 {
						return okResponse(r, 503, "Retry-After", tt.retryAfter(time.Now())), nil
					}
					return okResponse(r, 200), nil
				})
				var attempts []Attempt
				opts := append([]Option{
					WithBackoff(backoffFunc(func(int) time.Duration { return time.Second })),
					WithAttemptHook(func(a Attempt) { attempts = append(attempts, a) }),
				}, tt.opts...)

				resp, err := NewTransport(base, opts...).RoundTrip(post(t, context.Background(), "http://x.invalid", "x"))

				require.NoError(t, err)
				resp.Body.Close()
				require.Len(t, sent, 2)
				assert.Equal(t, tt.wantWait, sent[1].Sub(sent[0]))
				require.Len(t, attempts, 2)
				assert.Equal(t, tt.wantWait, attempts[0].Wait)
				assert.Equal(t, tt.wantReason, attempts[0].Reason)
				assert.Equal(t, ReasonSuccess, attempts[1].Reason)
			})
		})
	}
}

func fixed(v string) func(time.Time) string { return func(time.Time) string { return v } }

func date(offset time.Duration, layout string) func(time.Time) string {
	return func(now time.Time) string { return now.Add(offset).UTC().Format(layout) }
}

func TestWaitPastDeadlineGivesUpAtOnce(t *testing.T) {
	tests := []struct {
		name    string
		reply   func(*http.Request) (*http.Response, error)
		backoff time.Duration
	}{
		{"Retry-After beyond deadline", func(r *http.Request) (*http.Response, error) {
			return okResponse(r, 503, "Retry-After", "10"), nil
		}, 0},
		{"backoff beyond deadline", func(r *http.Request) (*http.Response, error) {
			return okResponse(r, 503), nil
		}, 5 * time.Second},
		{"error with backoff beyond deadline", func(r *http.Request) (*http.Response, error) {
			return nil, timeoutErr{}
		}, 5 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
				defer cancel()
				calls := 0
				base := roundTripFunc(func(r *http.Request) (*http.Response, error) { calls++; return tt.reply(r) })
				start := time.Now()

				resp, err := NewTransport(base, WithBackoff(backoffFunc(func(int) time.Duration { return tt.backoff }))).
					RoundTrip(post(t, ctx, "http://x.invalid", "x"))

				assert.Equal(t, time.Duration(0), time.Since(start), "gave up without waiting")
				assert.Equal(t, 1, calls)
				if resp != nil {
					assert.NoError(t, err)
					assert.Equal(t, 503, resp.StatusCode, "the last outcome is returned")
					resp.Body.Close()
				} else {
					assert.ErrorIs(t, err, ErrWaitPastDeadline)
					assert.ErrorIs(t, err, timeoutErr{})
				}
			})
		})
	}
}

func TestCancelDuringBackoffReturnsPromptly(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		calls := 0
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			calls++
			return okResponse(r, 503), nil
		})
		tr := NewTransport(base, WithBackoff(backoffFunc(func(int) time.Duration { return time.Hour })))
		time.AfterFunc(2*time.Second, cancel)
		start := time.Now()

		resp, err := tr.RoundTrip(post(t, ctx, "http://x.invalid", "x"))

		assert.Nil(t, resp)
		assert.ErrorIs(t, err, context.Canceled)
		assert.Equal(t, 2*time.Second, time.Since(start))
		assert.Equal(t, 1, calls)
		var re *RetryError
		require.ErrorAs(t, err, &re)
		assert.Equal(t, ReasonCanceled, re.Reason)
	})
}

func TestBackoffGrowsBetweenAttempts(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var sent []time.Time
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			sent = append(sent, time.Now())
			return okResponse(r, 503), nil
		})
		var retries []int
		backoff := backoffFunc(func(n int) time.Duration {
			retries = append(retries, n)
			return time.Duration(n) * time.Second
		})
		resp, err := NewTransport(base, WithBackoff(backoff), WithMaxAttempts(4)).
			RoundTrip(post(t, context.Background(), "http://x.invalid", "x"))
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, []int{1, 2, 3}, retries)
		require.Len(t, sent, 4)
		for i := 1; i < 4; i++ {
			assert.Equal(t, time.Duration(i)*time.Second, sent[i].Sub(sent[i-1]))
		}
	})
}
