package idemhttp

import (
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const bHost = "https://a.example:443"

// tryBreaker asks b for an attempt to bHost and reports outcome o if allowed.
// It returns whether the attempt was allowed and every change seen.
func tryBreaker(t *testing.T, b *breakers, o breakerOutcome) (bool, []BreakerChange) {
	t.Helper()
	sent := false
	changes, err := b.send(bHost, time.Now(), func() breakerOutcome {
		sent = true
		return o
	})
	if err != nil {
		require.ErrorIs(t, err, ErrCircuitOpen)
		require.False(t, sent)
		return false, changes
	}
	require.True(t, sent)
	return true, changes
}

// probe is an attempt through a breaker that stays in flight until its
// outcome is sent on the channel probe returns.
func probe(b *breakers, host string, changes *[]BreakerChange, errp *error) chan<- breakerOutcome {
	outcome := make(chan breakerOutcome)
	go func() {
		*changes, *errp = b.send(host, time.Now(), func() breakerOutcome { return <-outcome })
	}()
	return outcome
}

func breakerChange(from, to BreakerState) BreakerChange {
	return BreakerChange{Host: bHost, From: from, To: to}
}

func TestBreakerSettingsDefaults(t *testing.T) {
	assert.Equal(t, BreakerSettings{
		ConsecutiveFailures: 5, FailureRatio: 0.5, MinRequests: 20,
		Interval: 10 * time.Second, OpenTimeout: 5 * time.Second, HalfOpenProbes: 3,
	}, BreakerSettings{}.withDefaults())
	custom := BreakerSettings{ConsecutiveFailures: 2, FailureRatio: 2, MinRequests: 1,
		Interval: time.Second, OpenTimeout: time.Minute, HalfOpenProbes: 1}
	assert.Equal(t, custom, custom.withDefaults())
}

// step is one attempt in a breaker scenario: what happens before it, what it
// reports, and what the test expects.
type step struct {
	sleep   time.Duration // fake time passed before the attempt
	outcome breakerOutcome
	allowed bool
	changes []BreakerChange
	state   BreakerState // after the attempt
}

func runSteps(t *testing.T, s BreakerSettings, steps []step) {
	synctest.Test(t, func(t *testing.T) {
		b := newBreakers(s, 16, time.Hour)
		for i, st := range steps {
			time.Sleep(st.sleep)
			allowed, changes := tryBreaker(t, b, st.outcome)
			assert.Equal(t, st.allowed, allowed, "step %d allowed", i)
			assert.Equal(t, st.changes, changes, "step %d changes", i)
			assert.Equal(t, st.state, b.state(bHost), "step %d state", i)
		}
	})
}

func TestBreakerTransitions(t *testing.T) {
	const (
		ok      = outcomeSuccess
		fail    = outcomeFailure
		ignored = outcomeIgnored
	)
	closed, halfOpen, open := BreakerClosed, BreakerHalfOpen, BreakerOpen
	// Two failures in a row trip; a half-open breaker lets two probes through.
	small := BreakerSettings{ConsecutiveFailures: 2, HalfOpenProbes: 2, OpenTimeout: time.Second}
	tripped := []step{
		{outcome: fail, allowed: true, state: closed},
		{outcome: fail, allowed: true, state: open, changes: []BreakerChange{breakerChange(closed, open)}},
	}
	tests := []struct {
		name     string
		settings BreakerSettings
		steps    []step
	}{
		{"closed, open, half-open, closed", small, append(tripped[:2:2],
			step{outcome: ok, allowed: false, state: open},
			// Exactly the timeout later the breaker is still open...
			step{sleep: time.Second, outcome: ok, allowed: false, state: open},
			// ...a moment later it lets probes through.
			step{sleep: time.Nanosecond, outcome: ok, allowed: true, state: halfOpen,
				changes: []BreakerChange{breakerChange(open, halfOpen)}},
			step{outcome: ok, allowed: true, state: closed, changes: []BreakerChange{breakerChange(halfOpen, closed)}},
			step{outcome: fail, allowed: true, state: closed},
		)},
		{"half-open probe fails: open again", small, append(tripped[:2:2],
			step{sleep: 2 * time.Second, outcome: ok, allowed: true, state: halfOpen,
				changes: []BreakerChange{breakerChange(open, halfOpen)}},
			step{outcome: fail, allowed: true, state: open, changes: []BreakerChange{breakerChange(halfOpen, open)}},
			step{sleep: 500 * time.Millisecond, outcome: ok, allowed: false, state: open},
		)},
		{"successes in between reset the run", small, []step{
			{outcome: fail, allowed: true}, {outcome: ok, allowed: true},
			{outcome: fail, allowed: true}, {outcome: ok, allowed: true},
			{outcome: fail, allowed: true},
		}},
		{"ignored outcomes count for nothing", small, []step{
			{outcome: fail, allowed: true}, {outcome: ignored, allowed: true},
			{outcome: ignored, allowed: true},
			{outcome: fail, allowed: true, state: open, changes: []BreakerChange{breakerChange(closed, open)}},
		}},
		{"failures forgotten after the interval",
			BreakerSettings{ConsecutiveFailures: 2, Interval: 10 * time.Second}, []step{
				{outcome: fail, allowed: true},
				{sleep: 11 * time.Second, outcome: fail, allowed: true},
				{outcome: fail, allowed: true, state: open, changes: []BreakerChange{breakerChange(closed, open)}},
			}},
		{"defaults: five failures in a row", BreakerSettings{}, []step{
			{outcome: fail, allowed: true}, {outcome: fail, allowed: true},
			{outcome: fail, allowed: true}, {outcome: fail, allowed: true},
			{outcome: fail, allowed: true, state: open, changes: []BreakerChange{breakerChange(closed, open)}},
			{sleep: 5 * time.Second, outcome: ok, allowed: false, state: open},
			{sleep: time.Nanosecond, outcome: ok, allowed: true, state: halfOpen,
				changes: []BreakerChange{breakerChange(open, halfOpen)}},
			{outcome: ok, allowed: true, state: halfOpen},
			{outcome: ok, allowed: true, state: closed, changes: []BreakerChange{breakerChange(halfOpen, closed)}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { runSteps(t, tt.settings, tt.steps) })
	}
}

func TestBreakerTripsOnFailureRatio(t *testing.T) {
	var steps []step
	// Alternating outcomes never make 5 failures in a row; at the 20th
	// attempt half of them have failed.
	for i := range 20 {
		st := step{outcome: outcomeSuccess, allowed: true}
		if i%2 == 1 {
			st.outcome = outcomeFailure
		}
		steps = append(steps, st)
	}
	steps[19].state = BreakerOpen
	steps[19].changes = []BreakerChange{breakerChange(BreakerClosed, BreakerOpen)}
	runSteps(t, BreakerSettings{}, steps)

	// A ratio above one never trips.
	for i := range steps {
		steps[i].state, steps[i].changes = BreakerClosed, nil
	}
	runSteps(t, BreakerSettings{FailureRatio: 1.5}, steps)
}

func TestHalfOpenLimitsProbesInFlight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := newBreakers(BreakerSettings{ConsecutiveFailures: 1, HalfOpenProbes: 2}, 16, time.Hour)
		tryBreaker(t, b, outcomeFailure)
		time.Sleep(DefaultBreakerOpenTimeout + time.Nanosecond)

		var changes1, changes2 []BreakerChange
		var err1, err2 error
		p1 := probe(b, bHost, &changes1, &err1)
		p2 := probe(b, bHost, &changes2, &err2)
		synctest.Wait() // both in flight
		allowed, seen := tryBreaker(t, b, outcomeSuccess)
		assert.False(t, allowed, "a third probe while two are in flight")
		changes, err := b.send(bHost, time.Now(), func() breakerOutcome { return outcomeSuccess })
		assert.Contains(t, err.Error(), "half-open")
		seen = append(seen, changes...)

		p1 <- outcomeSuccess
		synctest.Wait()
		require.NoError(t, err1)
		assert.Equal(t, BreakerHalfOpen, b.state(bHost), "one probe of two succeeded")
		p2 <- outcomeSuccess
		synctest.Wait()
		require.NoError(t, err2)
		assert.Equal(t, []BreakerChange{breakerChange(BreakerHalfOpen, BreakerClosed)}, changes2, "the last probe closes it")
		// Each change is reported once, to whoever first saw it.
		seen = append(append(seen, changes1...), changes2...)
		assert.Equal(t, []BreakerChange{breakerChange(BreakerOpen, BreakerHalfOpen), breakerChange(BreakerHalfOpen, BreakerClosed)}, seen)
		assert.Equal(t, BreakerClosed, b.state(bHost))
	})
}

func TestBreakersArePerHostAndBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := newBreakers(BreakerSettings{ConsecutiveFailures: 1}, 4, time.Minute)
		send := func(host string, o breakerOutcome) error {
			_, err := b.send(host, time.Now(), func() breakerOutcome { return o })
			return err
		}
		require.NoError(t, send("https://a.example:443", outcomeFailure))
		require.ErrorIs(t, send("https://a.example:443", outcomeSuccess), ErrCircuitOpen)
		require.NoError(t, send("https://b.example:443", outcomeSuccess), "another host has its own breaker")

		for i := range 100 {
			require.NoError(t, send("https://h"+string(rune('a'+i%26))+".example:443", outcomeSuccess))
		}
		assert.Equal(t, 4, b.hosts.Len(time.Now()))
		time.Sleep(time.Minute + time.Nanosecond)
		assert.Equal(t, 0, b.hosts.Len(time.Now()), "idle hosts are forgotten")
	})
}

// Many goroutines share one breaker: every change is reported exactly once,
// and an open breaker lets nothing through.
func TestBreakerConcurrent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := newBreakers(BreakerSettings{OpenTimeout: time.Hour}, 16, 0)
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			all     []BreakerChange
			allowed atomic.Int64
		)
		for range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 50 {
					changes, _ := b.send(bHost, time.Now(), func() breakerOutcome {
						allowed.Add(1)
						return outcomeFailure
					})
					mu.Lock()
					all = append(all, changes...)
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		assert.Equal(t, []BreakerChange{breakerChange(BreakerClosed, BreakerOpen)}, all)
		assert.GreaterOrEqual(t, allowed.Load(), int64(5))
		assert.LessOrEqual(t, allowed.Load(), int64(5+31), "at most the tripping failures and those already in flight")
		assert.Equal(t, BreakerOpen, b.state(bHost))
	})
}

// An attempt that panics counts as a failure, and the panic goes on.
func TestBreakerCountsAPanicAsAFailure(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := newBreakers(BreakerSettings{ConsecutiveFailures: 1}, 16, time.Hour)
		assert.PanicsWithValue(t, "boom", func() {
			_, _ = b.send(bHost, time.Now(), func() breakerOutcome { panic("boom") })
		})
		assert.Equal(t, BreakerOpen, b.state(bHost))
	})
}

func TestBreakerStateString(t *testing.T) {
	for s, want := range map[BreakerState]string{
		BreakerClosed: "closed", BreakerHalfOpen: "half-open", BreakerOpen: "open", 7: "BreakerState(7)",
	} {
		assert.Equal(t, want, s.String())
	}
}

// Attempts ended by the caller, or never sent, count as neither success nor
// failure, so they neither dilute the failure ratio nor make up MinRequests.
func TestBreakerRatioIgnoresExcludedAttempts(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := BreakerSettings{ConsecutiveFailures: math.MaxUint32, MinRequests: 4, FailureRatio: 0.5, OpenTimeout: time.Hour}
		b := newBreakers(s, 16, time.Hour)
		for _, o := range []breakerOutcome{outcomeIgnored, outcomeIgnored, outcomeIgnored, outcomeIgnored,
			outcomeSuccess, outcomeFailure} {
			tryBreaker(t, b, o)
		}
		assert.Equal(t, BreakerClosed, b.state(bHost), "2 counted attempts are fewer than MinRequests")
		tryBreaker(t, b, outcomeSuccess)
		tryBreaker(t, b, outcomeFailure)
		assert.Equal(t, BreakerOpen, b.state(bHost), "2 of 4 counted attempts failed")
	})
}
