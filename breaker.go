package idemhttp

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/idemhttp/idemhttp/internal/hostmap"
)

// Breaker defaults, used for the zero fields of [BreakerSettings].
const (
	// DefaultBreakerConsecutiveFailures is the default of
	// [BreakerSettings.ConsecutiveFailures].
	DefaultBreakerConsecutiveFailures = 5
	// DefaultBreakerFailureRatio is the default of [BreakerSettings.FailureRatio].
	DefaultBreakerFailureRatio = 0.5
	// DefaultBreakerMinRequests is the default of [BreakerSettings.MinRequests].
	DefaultBreakerMinRequests = 20
	// DefaultBreakerInterval is the default of [BreakerSettings.Interval].
	DefaultBreakerInterval = 10 * time.Second
	// DefaultBreakerOpenTimeout is the default of [BreakerSettings.OpenTimeout].
	DefaultBreakerOpenTimeout = 5 * time.Second
	// DefaultBreakerHalfOpenProbes is the default of
	// [BreakerSettings.HalfOpenProbes].
	DefaultBreakerHalfOpenProbes = 3
)

// BreakerSettings configures the circuit breakers of a Transport.
//
// A circuit breaker stops a client from sending requests that are almost
// certain to fail, so that a struggling server gets room to recover and the
// client fails fast instead of waiting on timeouts. The Transport keeps one
// breaker per host (scheme, host and port), built on
// github.com/sony/gobreaker/v2. Each breaker is in one of three states:
//
//   - Closed: attempts are sent and their outcomes counted over a rolling
//     Interval. Network errors and 5xx responses are failures; any other
//     response, 4xx (including 429) too, is a success, because the server
//     answered. An attempt ended by the caller's own context counts as
//     neither. The breaker trips open after ConsecutiveFailures failures in
//     a row, or once at least MinRequests attempts in the Interval have
//     failed at FailureRatio or more.
//   - Open: for OpenTimeout, attempts fail at once with an error that
//     wraps [ErrCircuitOpen], and nothing is sent. A request that would
//     retry while its host's breaker is open stops instead, with its last
//     outcome: its last response, or its last error wrapped so that it
//     also matches ErrCircuitOpen.
//   - Half-open: up to HalfOpenProbes attempts are let through as probes,
//     others fail as if open. A failed probe opens the breaker again for
//     another OpenTimeout; HalfOpenProbes successful probes in a row close
//     it.
//
// Every zero field means its default, so the zero BreakerSettings is the
// default configuration. To switch one way of tripping off, make it
// unreachable: a FailureRatio above 1, or ConsecutiveFailures of
// math.MaxUint32.
type BreakerSettings struct {
	// ConsecutiveFailures trips the breaker after this many failures in a
	// row. Default 5.
	ConsecutiveFailures uint32
	// FailureRatio trips the breaker when failures make up at least this
	// share of the attempts in the Interval, counted once there have been
	// MinRequests of them. Default 0.5.
	FailureRatio float64
	// MinRequests is how many attempts the Interval must hold before
	// FailureRatio is considered. Default 20.
	MinRequests uint32
	// Interval is how far back a closed breaker counts attempts; it rolls in
	// steps of a tenth of its length. Default 10 s.
	Interval time.Duration
	// OpenTimeout is how long the breaker stays open before it lets probes
	// through. Default 5 s.
	OpenTimeout time.Duration
	// HalfOpenProbes is how many probes a half-open breaker lets through,
	// and how many must succeed in a row to close it. Default 3.
	HalfOpenProbes uint32
}

// withDefaults returns s with every zero field set to its default.
func (s BreakerSettings) withDefaults() BreakerSettings {
	if s.ConsecutiveFailures == 0 {
		s.ConsecutiveFailures = DefaultBreakerConsecutiveFailures
	}
	if s.FailureRatio <= 0 {
		s.FailureRatio = DefaultBreakerFailureRatio
	}
	if s.MinRequests == 0 {
		s.MinRequests = DefaultBreakerMinRequests
	}
	if s.Interval <= 0 {
		s.Interval = DefaultBreakerInterval
	}
	if s.OpenTimeout <= 0 {
		s.OpenTimeout = DefaultBreakerOpenTimeout
	}
	if s.HalfOpenProbes == 0 {
		s.HalfOpenProbes = DefaultBreakerHalfOpenProbes
	}
	return s
}

// BreakerState is the state of a host's circuit breaker.
type BreakerState int

// The states of a circuit breaker; see [BreakerSettings].
const (
	// BreakerClosed: attempts are sent and their outcomes counted.
	BreakerClosed BreakerState = iota
	// BreakerHalfOpen: a few probes are sent to see if the host recovered.
	BreakerHalfOpen
	// BreakerOpen: attempts fail at once and nothing is sent.
	BreakerOpen
)

// String returns "closed", "half-open" or "open".
func (s BreakerState) String() string {
	switch s {
	case BreakerClosed:
		return "closed"
	case BreakerHalfOpen:
		return "half-open"
	case BreakerOpen:
		return "open"
	}
	return fmt.Sprintf("BreakerState(%d)", int(s))
}

func breakerState(s gobreaker.State) BreakerState {
	switch s {
	case gobreaker.StateHalfOpen:
		return BreakerHalfOpen
	case gobreaker.StateOpen:
		return BreakerOpen
	}
	return BreakerClosed
}

// BreakerChange records that the breaker of Host went From one state To
// another.
type BreakerChange struct {
	// Host is the breaker's host, as scheme://host:port.
	Host string
	// From and To are the states before and after the change.
	From, To BreakerState
}

// breakerOutcome is what an attempt tells a breaker about its host.
type breakerOutcome int

const (
	outcomeSuccess breakerOutcome = iota // the host answered
	outcomeFailure                       // a network error or a 5xx
	outcomeIgnored                       // the caller's context ended it
)

var (
	errBreakerFailure  = errors.New("failure")
	errBreakerExcluded = errors.New("excluded")
)

// breakers holds a Transport's per-host circuit breakers.
type breakers struct {
	settings BreakerSettings
	hosts    *hostmap.Map[*hostBreaker]
}

type hostBreaker struct {
	cb *gobreaker.CircuitBreaker[struct{}]

	// changed is set while changes is not empty, so that the common case,
	// no change, costs an atomic load rather than taking mu twice per
	// attempt.
	changed atomic.Bool
	mu      sync.Mutex
	changes []BreakerChange // not yet reported
}

// newBreakers returns breakers configured by s, tracking at most maxHosts
// hosts and forgetting those idle for longer than idle.
func newBreakers(s BreakerSettings, maxHosts int, idle time.Duration) *breakers {
	s = s.withDefaults()
	b := &breakers{settings: s}
	b.hosts = hostmap.New(maxHosts, idle, b.newHost)
	return b
}

func (b *breakers) newHost(host string) *hostBreaker {
	s := b.settings
	hb := &hostBreaker{}
	hb.cb = gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:         host,
		MaxRequests:  s.HalfOpenProbes,
		Interval:     s.Interval,
		BucketPeriod: s.Interval / 10,
		Timeout:      s.OpenTimeout,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			// Excluded attempts (ended by the caller, or never sent)
			// count as neither success nor failure.
			counted := c.Requests - c.TotalExclusions
			return c.ConsecutiveFailures >= s.ConsecutiveFailures ||
				(counted >= s.MinRequests &&
					float64(c.TotalFailures) >= s.FailureRatio*float64(counted))
		},
		// breakerOutcome.err passes the sentinels themselves.
		IsExcluded: func(err error) bool { return err == errBreakerExcluded },
		// Called with the breaker's lock held: only note the change here;
		// whoever caused it reports it after the lock is released.
		OnStateChange: func(name string, from, to gobreaker.State) {
			hb.mu.Lock()
			hb.changes = append(hb.changes, BreakerChange{Host: name, From: breakerState(from), To: breakerState(to)})
			hb.changed.Store(true)
			hb.mu.Unlock()
		},
	})
	return hb
}

// drain returns the changes not yet reported.
func (hb *hostBreaker) drain() []BreakerChange {
	// A change noted before this load is seen: it is stored under the
	// breaker's lock, which the caller's Execute or State has just held.
	if !hb.changed.Load() {
		return nil
	}
	hb.mu.Lock()
	defer hb.mu.Unlock()
	c := hb.changes
	hb.changes = nil
	hb.changed.Store(false)
	return c
}

// send sends an attempt to host through its breaker, at now. If the
// breaker lets the attempt through, send calls attempt and reports to the
// breaker the outcome attempt returns; a panic in attempt counts as a
// failure and goes on. If not, attempt is not called and err wraps
// ErrCircuitOpen. Either way, changes lists the state changes found (an
// open breaker turning half-open, a failure opening it).
//
// It goes through gobreaker's Execute rather than its two-step Allow, whose
// callback is an allocation per attempt.
func (b *breakers) send(host string, now time.Time, attempt func() breakerOutcome) (changes []BreakerChange, err error) {
	hb := b.hosts.Get(host, now)
	_, err = hb.cb.Execute(func() (struct{}, error) {
		return struct{}{}, attempt().err()
	})
	changes = hb.drain()
	if err == gobreaker.ErrOpenState || err == gobreaker.ErrTooManyRequests {
		state := "open"
		if err == gobreaker.ErrTooManyRequests {
			state = "half-open, probes in flight"
		}
		return changes, fmt.Errorf("%w: %s (%s)", ErrCircuitOpen, host, state)
	}
	// Any other err is attempt's outcome, already reported.
	return changes, nil
}

// err is what the breaker is told of an attempt with outcome o. These are
// the sentinels themselves, so that IsExcluded can compare them without
// errors.Is, which is dearer on every attempt.
func (o breakerOutcome) err() error {
	switch o {
	case outcomeSuccess:
		return nil
	case outcomeFailure:
		return errBreakerFailure
	}
	return errBreakerExcluded
}

// state returns the state of host's breaker, without creating one.
func (b *breakers) state(host string) BreakerState {
	hb, ok := b.hosts.Peek(host)
	if !ok {
		return BreakerClosed
	}
	return breakerState(hb.cb.State())
}

// WithBreaker sets the settings of the Transport's per-host circuit
// breakers; zero fields take their defaults, see [BreakerSettings]. Breakers
// are on by default, with the zero BreakerSettings.
func WithBreaker(s BreakerSettings) Option {
	return func(c *config) { c.breaker = &s }
}

// WithoutBreaker turns the Transport's circuit breakers off: every attempt
// is sent, whatever happened to the ones before.
func WithoutBreaker() Option {
	return func(c *config) { c.breaker = nil }
}
