package idemhttp

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// budgetT0 starts a whole second, so it starts a step of every window of whole
// seconds too.
var budgetT0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// retriesAllowed asks b for retries to host at now until it refuses one,
// and returns how many it allowed.
func retriesAllowed(t *testing.T, b *Budget, host string, now time.Time) int {
	t.Helper()
	for n := 0; n < 1_000_000; n++ {
		if !b.allowRetry(host, now) {
			return n
		}
	}
	t.Fatal("budget never refused")
	return 0
}

func recordFirsts(b *Budget, host string, n int, now time.Time) {
	for range n {
		b.recordFirst(host, now)
	}
}

func TestBudgetAllowsExactlyRatioPlusFloor(t *testing.T) {
	tests := []struct {
		name   string
		opts   []BudgetOption
		firsts int
		want   int
	}{
		{"ratio only", []BudgetOption{BudgetMinRetriesPerSecond(0)}, 100, 20},
		{"ratio only, rounds down", []BudgetOption{BudgetMinRetriesPerSecond(0), BudgetRatio(0.5)}, 3, 1},
		{"ratio only, no traffic", []BudgetOption{BudgetMinRetriesPerSecond(0)}, 0, 0},
		{"floor only", []BudgetOption{BudgetRatio(0)}, 1000, 30},
		{"defaults: ratio plus floor", nil, 10, 2 + 30},
		{"floor scales with the window", []BudgetOption{BudgetRatio(0), BudgetWindow(2 * time.Second), BudgetMinRetriesPerSecond(1.5)}, 0, 3},
		{"negative values mean zero", []BudgetOption{BudgetRatio(-1), BudgetMinRetriesPerSecond(-1)}, 100, 0},
		{"full ratio", []BudgetOption{BudgetRatio(1), BudgetMinRetriesPerSecond(0)}, 7, 7},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := NewBudget(tt.opts...)
			recordFirsts(b, "https://a.example:443", tt.firsts, budgetT0)
			assert.Equal(t, tt.want, retriesAllowed(t, b, "https://a.example:443", budgetT0))
			st := b.Stats()
			assert.Equal(t, BudgetStats{FirstAttempts: uint64(tt.firsts), Retries: uint64(tt.want), Refused: 1}, st)
		})
	}
}

func TestZeroBudgetUsesDefaults(t *testing.T) {
	var b Budget
	recordFirsts(&b, "h", 50, budgetT0)
	assert.Equal(t, 10+30, retriesAllowed(t, &b, "h", budgetT0))
}

func TestNilBudgetAllowsEverything(t *testing.T) {
	var b *Budget
	b.recordFirst("h", budgetT0)
	for range 100 {
		require.True(t, b.allowRetry("h", budgetT0))
	}
}

func TestBudgetWindowSlides(t *testing.T) {
	const host = "http://a.example:80"
	b := NewBudget(BudgetMinRetriesPerSecond(0)) // 20% of a 10 s window, in 1 s steps
	recordFirsts(b, host, 100, budgetT0)
	require.Equal(t, 20, retriesAllowed(t, b, host, budgetT0.Add(500*time.Millisecond)))

	// Five seconds on, 50 more first attempts: 150 in the window, 20 spent.
	recordFirsts(b, host, 50, budgetT0.Add(5*time.Second))
	assert.Equal(t, 10, retriesAllowed(t, b, host, budgetT0.Add(5*time.Second)))

	// The first step is counted until its tenth step begins...
	assert.Equal(t, 0, retriesAllowed(t, b, host, budgetT0.Add(10*time.Second-time.Nanosecond)))
	// ...then its 100 first attempts and 20 retries are gone: 50 first
	// attempts and 10 retries are left, which allow nothing more.
	assert.Equal(t, 0, retriesAllowed(t, b, host, budgetT0.Add(10*time.Second)))
	// When the second batch expires too, nothing is left to retry against.
	recordFirsts(b, host, 5, budgetT0.Add(15*time.Second))
	assert.Equal(t, 1, retriesAllowed(t, b, host, budgetT0.Add(15*time.Second)))
}

func TestBudgetHostsAreSeparateUnlessShared(t *testing.T) {
	tests := []struct {
		name      string
		opts      []BudgetOption
		wantOther int
	}{
		{"per host", nil, 0},
		{"across hosts", []BudgetOption{BudgetAcrossHosts()}, 20 - 5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := NewBudget(append(tt.opts, BudgetMinRetriesPerSecond(0))...)
			recordFirsts(b, "https://a.example:443", 100, budgetT0)
			for range 5 {
				require.True(t, b.allowRetry("https://a.example:443", budgetT0))
			}
			assert.Equal(t, tt.wantOther, retriesAllowed(t, b, "https://b.example:443", budgetT0))
		})
	}
}

func TestBudgetForgetsIdleHosts(t *testing.T) {
	b := NewBudget(BudgetMaxHosts(8))
	for i := range 1000 {
		b.recordFirst(string(rune('A'+i%64))+".example", budgetT0.Add(time.Duration(i)*time.Millisecond))
	}
	assert.LessOrEqual(t, b.hosts.Len(budgetT0.Add(time.Second)), 8)
	// Unused for a whole window, every host is forgotten.
	assert.Equal(t, 0, b.hosts.Len(budgetT0.Add(time.Second+DefaultBudgetWindow+time.Nanosecond)))
}

// Many goroutines racing for retries get exactly what the budget allows.
func TestBudgetConcurrentRetriesGetExactAllowance(t *testing.T) {
	b := NewBudget(BudgetMinRetriesPerSecond(1)) // 20% + 10 per window
	const host = "https://a.example:443"
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			recordFirsts(b, host, 20, budgetT0)
		}()
	}
	wg.Wait()

	var mu sync.Mutex
	allowed := 0
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				if b.allowRetry(host, budgetT0.Add(time.Second)) {
					mu.Lock()
					allowed++
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	assert.Equal(t, 200+10, allowed)
	assert.Equal(t, BudgetStats{FirstAttempts: 1000, Retries: 210, Refused: 1000 - 210}, b.Stats())
}
