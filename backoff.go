package idemhttp

import (
	"math"
	"math/rand/v2"
	"time"
)

// A Backoff chooses how long to wait before a retry.
//
// Delay is called with retry = 1 before the second attempt, 2 before the
// third, and so on. It must be safe for concurrent use. A Retry-After
// header, when present and valid, raises the wait to at least what the
// server asked for; the Backoff never lowers it.
type Backoff interface {
	Delay(retry int) time.Duration
}

// Default backoff parameters, used when no [WithBackoff] option is given.
const (
	DefaultBackoffBase = 100 * time.Millisecond
	DefaultBackoffMax  = 10 * time.Second
)

// FullJitter returns the "full jitter" exponential backoff: before retry n
// it waits a uniformly random duration in [0, min(max, base·2^(n-1))].
// Spreading waits over the whole interval keeps many clients that failed
// together from retrying together. A base or max that is not positive is
// replaced by its default ([DefaultBackoffBase], [DefaultBackoffMax]).
func FullJitter(base, max time.Duration) Backoff {
	return newFullJitter(base, max, rand.Int64N)
}

func newFullJitter(base, max time.Duration, int64n func(int64) int64) fullJitter {
	if base <= 0 {
		base = DefaultBackoffBase
	}
	if max <= 0 {
		max = DefaultBackoffMax
	}
	return fullJitter{base: base, max: max, int64n: int64n}
}

type fullJitter struct {
	base, max time.Duration
	int64n    func(n int64) int64 // uniform in [0, n); rand.Int64N in production
}

// Delay implements [Backoff].
func (j fullJitter) Delay(retry int) time.Duration {
	c := int64(j.ceiling(retry))
	if c == math.MaxInt64 {
		return time.Duration(j.int64n(c)) // [0, c) is as good as [0, c] here
	}
	return time.Duration(j.int64n(c + 1))
}

// ceiling is min(max, base·2^(retry-1)), computed without overflow.
func (j fullJitter) ceiling(retry int) time.Duration {
	c := j.base
	for i := 1; i < retry && c < j.max; i++ {
		if c > j.max/2 {
			return j.max
		}
		c *= 2
	}
	return min(c, j.max)
}
