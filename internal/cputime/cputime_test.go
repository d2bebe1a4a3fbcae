package cputime

import (
	"crypto/sha256"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestElapsedCountsWork(t *testing.T) {
	if !Supported {
		t.Skip("CPU time is not read on this platform")
	}
	m := Start()
	// Hash until the process has used at least 20 ms of CPU time, a bound
	// the kernel's accounting resolves whatever its tick; give up after
	// 10 s of wall time, far more than the work takes.
	buf := make([]byte, 1<<16)
	deadline := time.Now().Add(10 * time.Second)
	for m.Elapsed() < 20*time.Millisecond && time.Now().Before(deadline) {
		sum := sha256.Sum256(buf)
		buf[0] = sum[0]
	}
	got := m.Elapsed()
	assert.GreaterOrEqual(t, got, 20*time.Millisecond, "CPU time must grow with work done")
	assert.LessOrEqual(t, got, Process(), "never more than the process has used")
}
