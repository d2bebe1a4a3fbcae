package hostmap

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func counting(created *int) func(string) *string {
	return func(host string) *string {
		*created++
		h := host
		return &h
	}
}

func TestGetReturnsSameValueUntilForgotten(t *testing.T) {
	created := 0
	m := New(10, time.Minute, counting(&created))

	a := m.Get("a", t0)
	require.Equal(t, "a", *a)
	assert.Same(t, a, m.Get("a", t0.Add(59*time.Second)), "used within the idle timeout")
	assert.Equal(t, 1, created)

	// Idle for exactly the timeout is still kept; a moment longer is not.
	assert.Same(t, a, m.Get("a", t0.Add(59*time.Second+time.Minute)))
	b := m.Get("a", t0.Add(59*time.Second+time.Minute+time.Nanosecond+time.Minute))
	assert.NotSame(t, a, b, "idle longer than the timeout: forgotten and recreated")
	assert.Equal(t, 2, created)
}

func TestEviction(t *testing.T) {
	tests := []struct {
		name     string
		capacity int
		idle     time.Duration
		uses     []string        // hosts used one second apart, from t0
		at       time.Duration   // when Len is asked, after t0
		wantLen  int             // hosts held then
		kept     map[string]bool // which hosts Peek must (not) find
	}{
		{
			name: "capacity evicts least recently used", capacity: 2, idle: time.Hour,
			uses: []string{"a", "b", "a", "c"}, at: 4 * time.Second, wantLen: 2,
			kept: map[string]bool{"a": true, "b": false, "c": true},
		},
		{
			name: "idle hosts go, busy ones stay", capacity: 100, idle: 2 * time.Second,
			uses: []string{"a", "b", "c", "d", "d"}, at: 6 * time.Second, wantLen: 1,
			kept: map[string]bool{"a": false, "b": false, "c": false, "d": true},
		},
		{
			name: "no idle timeout keeps everything within capacity", capacity: 3, idle: 0,
			uses: []string{"a", "b", "c"}, at: 1000 * time.Hour, wantLen: 3,
			kept: map[string]bool{"a": true, "b": true, "c": true},
		},
		{
			name: "capacity below one means one", capacity: 0, idle: 0,
			uses: []string{"a", "b"}, at: 2 * time.Second, wantLen: 1,
			kept: map[string]bool{"a": false, "b": true},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			created := 0
			m := New(tt.capacity, tt.idle, counting(&created))
			for i, h := range tt.uses {
				m.Get(h, t0.Add(time.Duration(i)*time.Second))
			}
			assert.Equal(t, tt.wantLen, m.Len(t0.Add(tt.at)))
			for h, want := range tt.kept {
				_, ok := m.Peek(h)
				assert.Equal(t, want, ok, "host %s", h)
			}
		})
	}
}

// A client that calls a million distinct hosts keeps at most capacity of
// them, while many goroutines share the map.
func TestManyHostsStayBounded(t *testing.T) {
	var created atomic.Int64
	m := New(64, time.Minute, func(host string) int {
		created.Add(1)
		return len(host)
	})
	const goroutines, perGoroutine = 16, 5000
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perGoroutine {
				host := fmt.Sprintf("h%d-%d.example:443", g, i)
				assert.Equal(t, len(host), m.Get(host, t0.Add(time.Duration(i)*time.Millisecond)))
				m.Get("shared.example:443", t0)
			}
		}()
	}
	wg.Wait()
	assert.LessOrEqual(t, m.Len(t0), 64)
	assert.GreaterOrEqual(t, created.Load(), int64(goroutines*perGoroutine))
}

// Random uses against a plain model of the same rules: the hosts held, and
// their order of use, always match.
func TestGetMatchesModel(t *testing.T) {
	const capacity, idle = 3, 5 * time.Second
	m := New(capacity, idle, func(host string) string { return host })
	var model []string // most recently used first
	lastUsed := map[string]time.Time{}
	now := t0
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 5000 {
		now = now.Add(time.Duration(rng.IntN(3000)) * time.Millisecond)
		host := fmt.Sprintf("h%d", rng.IntN(6))
		require.Equal(t, host, m.Get(host, now))

		// The model: forget idle hosts, move or add host to the front,
		// drop the least recently used beyond capacity.
		kept := model[:0]
		for _, h := range model {
			if now.Sub(lastUsed[h]) <= idle {
				kept = append(kept, h)
			}
		}
		model = append([]string{host}, slices.DeleteFunc(kept, func(h string) bool { return h == host })...)
		model = model[:min(len(model), capacity)]
		lastUsed[host] = now

		var got []string
		for e := m.front; e != nil; e = e.next {
			got = append(got, e.host)
		}
		require.Equal(t, model, got, "step %d", i)
		var back []string
		for e := m.back; e != nil; e = e.prev {
			back = append(back, e.host)
		}
		slices.Reverse(back)
		require.Equal(t, got, back, "step %d: links both ways", i)
		require.Len(t, m.byKey, len(model))
	}
}
