//go:build race

package idemserver

// raceEnabled reports a -race build, whose instrumentation changes what
// escapes to the heap, so allocation counts are checked only without it.
const raceEnabled = true
