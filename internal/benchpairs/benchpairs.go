// Package benchpairs drives the record+release benchmarks of key stores, so
// that the file store and its peers in the bench module do the same work.
package benchpairs

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
)

// Goroutines are the concurrency levels every store is measured at.
var Goroutines = []int{1, 8, 64}

// Run calls pair b.N times from goroutines goroutines, with i running from
// 0 to b.N-1, and reports the pairs completed per second.
func Run(b *testing.B, goroutines int, pair func(i int) error) {
	b.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	var failed atomic.Pointer[error]
	b.ResetTimer()
	for range goroutines {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(b.N) || failed.Load() != nil {
					return
				}
				if err := pair(int(i)); err != nil {
					failed.Store(&err)
					return
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	if err := failed.Load(); err != nil {
		b.Fatal(*err)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
}

// Name is the sub-benchmark name for a concurrency level.
func Name(goroutines int) string { return fmt.Sprintf("goroutines=%d", goroutines) }

// Operation and Key name the i-th operation of a benchmark.
func Operation(i int) string { return fmt.Sprintf("order-%09d", i) }

// Key is the idempotency key of the i-th operation, as long as a UUID.
func Key(i int) string { return fmt.Sprintf("0190b2a4-7c1e-7b3a-9c1d-%012d", i) }
