//go:build race

package pgstore

// raceEnabled reports a -race build, whose instrumentation changes what
// escapes to the heap (and drops sync.Pool items at random), so allocation
// counts are checked only without it.
const raceEnabled = true
