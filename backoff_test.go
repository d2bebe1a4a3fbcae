package idemhttp

import (
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// seeded returns a deterministic, goroutine-safe int64n for fullJitter.
func seeded(seed uint64) func(int64) int64 {
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(seed, seed))
	return func(n int64) int64 {
		mu.Lock()
		defer mu.Unlock()
		return r.Int64N(n)
	}
}

func TestFullJitterCeiling(t *testing.T) {
	j := newFullJitter(100*time.Millisecond, 10*time.Second, seeded(1))
	tests := []struct {
		retry int
		want  time.Duration
	}{
		{1, 100 * time.Millisecond},
		{2, 200 * time.Millisecond},
		{3, 400 * time.Millisecond},
		{7, 6400 * time.Millisecond},
		{8, 10 * time.Second}, // 12.8s capped
		{1000, 10 * time.Second},
		{0, 100 * time.Millisecond},
	}
	for _, tt := range tests {
		assert.Equal(t, tt.want, j.ceiling(tt.retry), "retry %d", tt.retry)
	}
}

func TestFullJitterStaysInRangeAndSpreads(t *testing.T) {
	const samples = 20000
	j := newFullJitter(100*time.Millisecond, time.Second, seeded(42))
	for _, retry := range []int{1, 2, 3, 4, 5, 10} {
		ceiling := j.ceiling(retry)
		var buckets [10]int
		var sum float64
		for range samples {
			d := j.Delay(retry)
			require.GreaterOrEqual(t, d, time.Duration(0))
			require.LessOrEqual(t, d, ceiling)
			buckets[min(int(10*d/(ceiling+1)), 9)]++
			sum += float64(d)
		}
		// Uniform over [0, ceiling]: each tenth holds about 10% of the samples
		// and the mean sits near the middle. A backoff that clusters (no
		// jitter, or "equal jitter") fails both.
		for i, n := range buckets {
			assert.InDelta(t, samples/10, n, samples/10*0.15, "retry %d bucket %d", retry, i)
		}
		assert.InEpsilon(t, float64(ceiling)/2, sum/samples, 0.03, "retry %d mean", retry)
	}
}

func TestFullJitterDefaultsForNonPositive(t *testing.T) {
	j := newFullJitter(0, -1, seeded(1))
	assert.Equal(t, DefaultBackoffBase, j.base)
	assert.Equal(t, DefaultBackoffMax, j.max)
}

func TestFullJitterPublicConstructor(t *testing.T) {
	b := FullJitter(time.Millisecond, 8*time.Millisecond)
	seen := map[time.Duration]bool{}
	for range 200 {
		d := b.Delay(4)
		require.LessOrEqual(t, d, 8*time.Millisecond)
		seen[d] = true
	}
	assert.Greater(t, len(seen), 100, "delays should vary")
}

func TestFullJitterHugeCapDoesNotOverflow(t *testing.T) {
	for _, b := range []Backoff{
		FullJitter(time.Second, math.MaxInt64),
		FullJitter(math.MaxInt64, math.MaxInt64),
		FullJitter(math.MaxInt64/3, math.MaxInt64-1),
	} {
		for _, retry := range []int{1, 2, 40, 64, 1000} {
			var d time.Duration
			require.NotPanics(t, func() { d = b.Delay(retry) })
			assert.GreaterOrEqual(t, d, time.Duration(0))
		}
	}
	j := newFullJitter(time.Second, math.MaxInt64, seeded(1))
	assert.Equal(t, time.Duration(math.MaxInt64), j.ceiling(100))
}
