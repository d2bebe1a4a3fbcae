package idemtest

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// within6Sigma reports the bounds that a binomial count of n trials with
// probability p stays within but for a chance of about 1e-9.
func within6Sigma(n int, p float64) (lo, hi int) {
	mean := float64(n) * p
	sd := math.Sqrt(float64(n) * p * (1 - p))
	return int(math.Floor(mean - 6*sd)), int(math.Ceil(mean + 6*sd))
}

// assertRate checks that count is a plausible binomial count.
func assertRate(t *testing.T, name string, count, n int, p float64) {
	t.Helper()
	lo, hi := within6Sigma(n, p)
	assert.True(t, count >= lo && count <= hi, "%s fired %d times in %d, want %d..%d for p=%v", name, count, n, lo, hi, p)
}

func TestFaultsValidate(t *testing.T) {
	tests := []struct {
		name string
		f    Faults
		want string // "" means valid
	}{
		{"zero", Faults{}, ""},
		{"all faults", Faults{ResetBefore: .2, LoseResponse: .2, Unavailable: .2, TooManyRequests: .2, Stall: .2,
			Latency: 1, MinLatency: time.Millisecond, MaxLatency: time.Second, RetryAfter: time.Second}, ""},
		{"negative", Faults{ResetBefore: -0.1}, "ResetBefore = -0.1 is not a probability"},
		{"above one", Faults{Latency: 1.5}, "Latency = 1.5 is not a probability"},
		{"NaN", Faults{Stall: math.NaN()}, "Stall = NaN is not a probability"},
		{"sum above one", Faults{ResetBefore: .5, LoseResponse: .3, Unavailable: .3}, "add up to 1.1"},
		{"negative Retry-After", Faults{RetryAfter: -time.Second}, "RetryAfter = -1s is negative"},
		{"inverted latency", Faults{MinLatency: time.Second, MaxLatency: time.Millisecond}, "latency range [1s, 1ms]"},
		{"negative latency", Faults{MinLatency: -time.Second}, "latency range [-1s, 0s]"},
		{"latency of nothing", Faults{Latency: .5}, "Latency = 0.5 with MaxLatency = 0 delays nothing"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.f.validate()
			if tt.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrInvalidFaults)
			assert.Contains(t, err.Error(), tt.want)
		})
	}
}

// TestDecideRates checks the decisions themselves: over 2000 identities each
// fault is chosen at its probability, and delays fall in their range.
func TestDecideRates(t *testing.T) {
	f := Faults{ResetBefore: .05, LoseResponse: .1, Unavailable: .15, TooManyRequests: .2, Stall: .25,
		Latency: .3, MinLatency: 10 * time.Millisecond, MaxLatency: 20 * time.Millisecond}
	const n = 2000
	for _, attempt := range []uint64{1, 2, 7} {
		counts := map[fault]int{}
		delayed := 0
		var minDelay, maxDelay time.Duration = math.MaxInt64, 0
		for i := range n {
			d := decide(&f, 42, fmt.Sprintf("key k-%d", i), attempt)
			counts[d.fault]++
			if d.delay > 0 {
				delayed++
				minDelay, maxDelay = min(minDelay, d.delay), max(maxDelay, d.delay)
			}
		}
		assertRate(t, "ResetBefore", counts[faultResetBefore], n, f.ResetBefore)
		assertRate(t, "LoseResponse", counts[faultLoseResponse], n, f.LoseResponse)
		assertRate(t, "Unavailable", counts[faultUnavailable], n, f.Unavailable)
		assertRate(t, "TooManyRequests", counts[faultTooManyRequests], n, f.TooManyRequests)
		assertRate(t, "Stall", counts[faultStall], n, f.Stall)
		assertRate(t, "none", counts[faultNone], n, .25)
		assertRate(t, "Latency", delayed, n, f.Latency)
		assert.GreaterOrEqual(t, minDelay, f.MinLatency)
		assert.LessOrEqual(t, maxDelay, f.MaxLatency)
		assert.Less(t, minDelay, 11*time.Millisecond, "delays spread over the range")
		assert.Greater(t, maxDelay, 19*time.Millisecond, "delays spread over the range")
	}
}

// TestDecideIndependentAttempts checks that the faults of one identity's
// attempts are drawn independently: a fault on attempt 1 does not make one
// on attempt 2 more or less likely.
func TestDecideIndependentAttempts(t *testing.T) {
	f := Faults{ResetBefore: .5}
	const n = 4000
	both := 0
	for i := range n {
		id := fmt.Sprintf("key k-%d", i)
		if decide(&f, 1, id, 1).fault != faultNone && decide(&f, 1, id, 2).fault != faultNone {
			both++
		}
	}
	assertRate(t, "faults on attempts 1 and 2", both, n, .25)
}

func TestDecideSameSeedSameSequence(t *testing.T) {
	f := Faults{ResetBefore: .1, LoseResponse: .1, Unavailable: .1, TooManyRequests: .1, Stall: .1,
		Latency: .5, MaxLatency: time.Second}
	sequence := func(seed int64) []decision {
		var s []decision
		for i := range 200 {
			for attempt := range uint64(3) {
				s = append(s, decide(&f, seed, fmt.Sprintf("key k-%d", i), attempt+1))
			}
		}
		return s
	}
	assert.Equal(t, sequence(7), sequence(7))
	assert.NotEqual(t, sequence(7), sequence(8))
}
