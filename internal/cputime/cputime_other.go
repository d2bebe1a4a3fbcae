//go:build !unix

package cputime

import "time"

// Supported reports whether Process can read the CPU time.
const Supported = false

// Process returns zero: this platform's CPU time is not read.
func Process() time.Duration { return 0 }
