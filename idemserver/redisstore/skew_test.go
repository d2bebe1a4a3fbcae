package redisstore_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

// skewedClock is an instance's clock: the real one, off by a duration
// that a test may step.
type skewedClock struct {
	mu  sync.Mutex
	off time.Duration
}

func (c *skewedClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return time.Now().Add(c.off)
}

func (c *skewedClock) set(off time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.off = off
}

func TestInstanceAheadTakesNoLiveLease(t *testing.T) {
	// Two instances share one Redis; the second's clock is ahead of the
	// first's by more than the lease, from the start or after a step
	// mid-lease. A duplicate sent to it while the first's handler runs
	// must not run the handler again: Redis's native expiry, a duration
	// set by the lease's holder, says the lease is live, whatever the
	// duplicate's clock says.
	for _, tt := range []struct {
		name          string
		before, after time.Duration // the second clock's offset before and after the first claim
	}{
		{"ahead", 3 * time.Minute, 3 * time.Minute},
		{"stepped forward mid-lease", 0, 3 * time.Minute},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := newClient(t)
			prefix := newPrefix(t, c)
			var runs atomic.Int64
			started, release := make(chan struct{}), make(chan struct{})
			handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				run := runs.Add(1)
				if run == 1 {
					close(started)
					<-release
				}
				created(run, w)
			})
			clocks := []*skewedClock{{}, {off: tt.before}}
			servers := make([]*httptest.Server, 2)
			var seen events
			for i, clock := range clocks {
				store := redisstore.New(clientOf(t, redisAddr(t)), redisstore.WithPrefix(prefix), redisstore.WithClock(clock.now))
				servers[i] = httptest.NewServer(idemserver.Middleware(store, idemserver.WithClock(clock.now), idemserver.WithObserver(seen.add))(handler))
				defer servers[i].Close()
			}

			var first reply
			var firstErr error
			done := make(chan struct{})
			go func() {
				defer close(done)
				first, firstErr = post(servers[0].Client(), servers[0].URL, "k", "b")
			}()
			<-started
			clocks[1].set(tt.after)
			dup := mustPost(t, servers[1], "k", "b")
			close(release)
			<-done
			require.NoError(t, firstErr)

			assert.EqualValues(t, 1, runs.Load(), "handler runs")
			assert.Equal(t, http.StatusCreated, first.status)
			assert.Equal(t, http.StatusServiceUnavailable, dup.status, "the duplicate: %s", dup.body)
			assert.Contains(t, string(dup.body), "until its configuration is fixed", "the 503 says the store is misconfigured, not unreachable")
			var disagree int
			for _, ev := range seen.of("k") {
				if errors.Is(ev.Err, redisstore.ErrClocksDisagree) {
					disagree++
					assert.ErrorIs(t, ev.Err, idemserver.ErrStoreMisconfigured)
				}
			}
			assert.Equal(t, 1, disagree, "the observer is told the clocks disagree")
		})
	}
}

func TestInstanceAheadKeepsCompletedRecord(t *testing.T) {
	// A record completed to be kept an hour is not forgotten by a claim
	// of an instance whose clock is two hours ahead: Redis keeps it for
	// an hour, and the claim is refused rather than run again.
	f := newFixture(t)
	ctx := t.Context()
	c := claim("k", "holder", time.Minute)
	mustClaim(t, f.store, c)
	require.NoError(t, f.store.Complete(ctx, c.Key, c.Token, &idemserver.Response{Status: http.StatusCreated}, time.Now().Add(time.Hour)))

	later := claim("k", "later", time.Minute)
	later.Now = later.Now.Add(2 * time.Hour)
	later.LeaseExpires = later.Now.Add(time.Minute)
	res, err := aheadOf(f.client, f.prefix, 2*time.Hour).Claim(ctx, later)
	require.ErrorIs(t, err, redisstore.ErrClocksDisagree)
	assert.False(t, res.Claimed)

	res, err = f.store.Claim(ctx, claim("k", "retry", time.Minute))
	require.NoError(t, err)
	assert.True(t, res.Record.Completed(), "the record is kept")
}

func TestClocksDisagreeBeyondTwiceMaxClockSkew(t *testing.T) {
	// A claim whose clock says a completed record has ended replaces it
	// while Redis gives the record at most 2×MaxClockSkew (10 s) more, the
	// most by which the package documentation says a record is forgotten
	// early, and is refused with ErrClocksDisagree beyond that. The record
	// is completed as the middleware completes it, with its time, to be
	// kept for left; the claim's clock is a second past that.
	require.Equal(t, 5*time.Second, redisstore.MaxClockSkew)
	for _, tt := range []struct {
		left     time.Duration
		disagree bool
	}{
		{8 * time.Second, false},
		{12 * time.Second, true},
	} {
		t.Run(tt.left.String(), func(t *testing.T) {
			f := newFixture(t)
			ctx := t.Context()
			c := claim("k", "holder", time.Minute)
			mustClaim(t, f.store, c)
			require.NoError(t, f.store.CompletePacked(ctx, idemserver.PackedCompletion{
				Key: c.Key, Token: c.Token, Response: idemserver.PackResponse(&idemserver.Response{Status: http.StatusCreated}),
				Now: c.Now, Expires: c.Now.Add(tt.left),
			}))

			ahead := tt.left + time.Second
			later := claim("k", "later", time.Minute)
			later.Now = later.Now.Add(ahead)
			later.LeaseExpires = later.Now.Add(time.Minute)
			res, err := aheadOf(f.client, f.prefix, ahead).Claim(ctx, later)
			if tt.disagree {
				require.ErrorIs(t, err, redisstore.ErrClocksDisagree)
				assert.False(t, res.Claimed)
				return
			}
			require.NoError(t, err)
			assert.True(t, res.Claimed, "the record is replaced")
		})
	}
}

func TestHolderClockSteppedBackKeepsItsLease(t *testing.T) {
	// The holder's clock steps back an hour mid-lease, and its next
	// extension writes a lease end an hour before the other instances'
	// time. Their takeover finds the clocks disagree: Redis counts down
	// the minute the extension asked for.
	var holderClock skewedClock
	f := newFixture(t, redisstore.WithClock(holderClock.now))
	ctx := t.Context()
	c := claim("k", "holder", time.Minute)
	mustClaim(t, f.store, c)
	holderClock.set(-time.Hour)
	require.NoError(t, f.store.Extend(ctx, c.Key, c.Token, holderClock.now().Add(time.Minute)))

	other := redisstore.New(f.client, redisstore.WithPrefix(f.prefix))
	taker := claim("k", "taker", time.Minute)
	res, err := other.Claim(ctx, taker)
	require.NoError(t, err)
	require.False(t, res.Claimed)
	require.False(t, taker.Now.Before(res.Record.LeaseExpires), "the lease seems ended to the other instance")
	_, err = other.TakeOver(ctx, taker, c.Token)
	require.ErrorIs(t, err, redisstore.ErrClocksDisagree)
	require.NoError(t, f.store.Complete(ctx, c.Key, c.Token, &idemserver.Response{Status: http.StatusCreated}, holderClock.now().Add(time.Hour)),
		"the holder keeps its claim")
}
