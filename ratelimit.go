package idemhttp

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/idemhttp/idemhttp/internal/hostmap"
)

// How the adaptive rate limit of WithRateLimit moves.
const (
	// rateDecrease is what a 429 multiplies a host's rate by.
	rateDecrease = 0.5
	// rateIncrease is the share of the configured rate that each
	// successful response adds back, up to the configured rate.
	rateIncrease = 0.01
	// rateMinShare is the lowest share of the configured rate that
	// 429s can push a host's rate down to.
	rateMinShare = 0.01
)

// limiters holds a Transport's per-host adaptive rate limiters.
//
// Each host starts at the configured rate. A 429 response multiplies the
// host's rate by rateDecrease (never below rateMinShare of the
// configured rate); each 2xx or 3xx response adds rateIncrease of the
// configured rate, up to the configured rate. This is additive increase,
// multiplicative decrease: a client backs off fast when a server says it is
// overloaded and probes its way back up.
type limiters struct {
	limit rate.Limit
	burst int
	hosts *hostmap.Map[*hostLimiter]
}

type hostLimiter struct {
	lim *rate.Limiter

	mu      sync.Mutex
	current rate.Limit
}

// newLimiters returns limiters allowing each host limit attempts per second
// with bursts of burst (at least 1), tracking at most maxHosts hosts and
// forgetting those idle for longer than idle.
func newLimiters(limit rate.Limit, burst, maxHosts int, idle time.Duration) *limiters {
	l := &limiters{limit: limit, burst: max(burst, 1)}
	l.hosts = hostmap.New(maxHosts, idle, func(string) *hostLimiter {
		return &hostLimiter{lim: rate.NewLimiter(l.limit, l.burst), current: l.limit}
	})
	return l
}

// wait blocks until host's limiter lets an attempt through, or ctx ends. If
// the wait would end after ctx's deadline it returns at once with an error
// wrapping ErrWaitPastDeadline and takes nothing from the limiter.
func (l *limiters) wait(ctx context.Context, host string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	now := time.Now()
	r := l.hosts.Get(host, now).lim.ReserveN(now, 1)
	delay := r.DelayFrom(now)
	if delay == 0 {
		return nil
	}
	if deadline, ok := ctx.Deadline(); ok && now.Add(delay).After(deadline) {
		r.CancelAt(now)
		return fmt.Errorf("%w: rate limit of %s needs %v", ErrWaitPastDeadline, host, delay)
	}
	timer := time.NewTimer(delay)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		r.Cancel()
		return ctx.Err()
	}
}

// observe adapts host's rate to a response status: a 429 lowers it, a 2xx
// or 3xx raises it back towards the configured rate. Other statuses, and
// attempts that got no response (status 0), change nothing.
func (l *limiters) observe(host string, status int) {
	var next func(rate.Limit) rate.Limit
	switch {
	case status == http.StatusTooManyRequests:
		next = func(cur rate.Limit) rate.Limit {
			return max(cur*rateDecrease, l.limit*rateMinShare)
		}
	case status >= 200 && status < 400:
		next = func(cur rate.Limit) rate.Limit {
			return min(cur+l.limit*rateIncrease, l.limit)
		}
	default:
		return
	}
	now := time.Now()
	hl := l.hosts.Get(host, now)
	hl.mu.Lock()
	defer hl.mu.Unlock()
	if cur := next(hl.current); cur != hl.current {
		hl.current = cur
		hl.lim.SetLimitAt(now, cur)
	}
}

// current returns host's rate now.
func (l *limiters) current(host string) rate.Limit {
	hl := l.hosts.Get(host, time.Now())
	hl.mu.Lock()
	defer hl.mu.Unlock()
	return hl.current
}

// WithRateLimit limits the attempts sent to each host to r per second, with
// bursts of up to burst (at least 1). Every attempt, retries included, waits
// for the host's limiter first; the wait ends early if the request's
// context ends, and is not started at all if it would outlast the context's
// deadline (the error then wraps [ErrWaitPastDeadline]).
//
// The limit is adaptive. A 429 response halves the host's rate, down to a
// hundredth of r at the lowest, and each 2xx or 3xx response adds a
// hundredth of r back, up to r: the client slows down as soon as the server
// says it is overloaded and finds its way back up while the server copes.
//
// Rate limiting is off by default. A rate of zero or less turns it off;
// [rate.Inf] allows everything.
func WithRateLimit(r rate.Limit, burst int) Option {
	return func(c *config) { c.rateLimit, c.rateBurst = r, burst }
}
