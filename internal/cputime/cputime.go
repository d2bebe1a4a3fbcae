// Package cputime reads the CPU time a process has used, so that
// benchmarks can report it beside wall time. On a machine shared with other
// work, wall time counts the moments the benchmark waited for a CPU; CPU
// time counts only the work done, the Go runtime's own (garbage collection,
// scheduling) included.
package cputime

import (
	"testing"
	"time"
)

// Meter measures the CPU time used between its start and a report.
type Meter struct{ start time.Duration }

// Start returns a Meter started now.
func Start() Meter { return Meter{start: Process()} }

// Elapsed returns the CPU time the process has used since m started.
func (m Meter) Elapsed() time.Duration { return Process() - m.start }

// Report adds the CPU time used since m started, divided by ops, to b's
// results as "cpu-ns/op". It reports nothing where the CPU time cannot be
// read.
func (m Meter) Report(b *testing.B, ops int) {
	if !Supported || ops <= 0 {
		return
	}
	b.ReportMetric(float64(m.Elapsed().Nanoseconds())/float64(ops), "cpu-ns/op")
}
