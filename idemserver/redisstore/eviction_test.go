package redisstore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

// The tests that change Redis's eviction settings or its users change
// those of a server of their own, never the shared one, which other tests
// (of other packages, too) use at the same time; they still set them back
// when they end.

// commands is a go-redis hook that counts the commands sent, by name.
type commands struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *commands) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *commands) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.mu.Lock()
		if c.n == nil {
			c.n = map[string]int{}
		}
		c.n[cmd.Name()]++
		c.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (c *commands) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// take returns the count of the command name, and resets every count.
func (c *commands) take(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.n[name]
	c.n = nil
	return n
}

// fakeClock is a store's and its claims' clock, the real one moved on by
// what the test adds.
type fakeClock struct{ ahead atomic.Int64 }

func (c *fakeClock) now() time.Time { return time.Now().Add(time.Duration(c.ahead.Load())) }

func (c *fakeClock) add(d time.Duration) { c.ahead.Add(int64(d)) }

// claim returns a claim of key at the clock's time, whose lease lasts a
// minute.
func (c *fakeClock) claim(key, token string) idemserver.Claim {
	cl := claim(key, token, time.Minute)
	now := c.now()
	cl.Now, cl.LeaseExpires = now, now.Add(time.Minute)
	return cl
}

// evictionServer is a Redis server of a test's own with a client, whose
// eviction settings the test changes.
type evictionServer struct {
	*redisServer
	admin *redis.Client
}

func startEvictionServer(t *testing.T) *evictionServer {
	s := &evictionServer{redisServer: startRedis(t, false)}
	s.admin = clientOf(t, s.addr)
	t.Cleanup(func() { s.set(t, "0", "noeviction") })
	return s
}

// set sets maxmemory and maxmemory-policy.
func (s *evictionServer) set(t *testing.T, maxmemory, policy string) {
	t.Helper()
	require.NoError(t, s.admin.ConfigSet(context.Background(), "maxmemory", maxmemory).Err())
	require.NoError(t, s.admin.ConfigSet(context.Background(), "maxmemory-policy", policy).Err())
}

func TestEvictionPolicyRefusesClaims(t *testing.T) {
	// Every record has a TTL, so a Redis with a maxmemory and a policy
	// other than noeviction evicts live records under memory pressure, in
	// silence; a retry of an evicted completed key would run its handler
	// again. The store refuses claims there, with an error that names the
	// policy and the fix, and writes nothing.
	server := startEvictionServer(t)
	for _, tt := range []struct {
		maxmemory, policy string
		refused           bool
	}{
		{"100mb", "allkeys-lru", true},
		{"100mb", "volatile-lru", true},
		{"100mb", "volatile-ttl", true},
		{"100mb", "allkeys-random", true},
		{"100mb", "noeviction", false},
		{"0", "allkeys-lru", false},
		{"0", "volatile-lru", false},
	} {
		t.Run(tt.maxmemory+" "+tt.policy, func(t *testing.T) {
			server.set(t, tt.maxmemory, tt.policy)
			c := clientOf(t, server.addr)
			prefix := newPrefix(t, c)
			store := redisstore.New(c, redisstore.WithPrefix(prefix))
			ctx := t.Context()
			res, err := store.Claim(ctx, claim("k", "t", time.Minute))
			if !tt.refused {
				require.NoError(t, err)
				assert.True(t, res.Claimed)
				return
			}
			require.ErrorIs(t, err, redisstore.ErrEvictionPolicy)
			for _, s := range []string{tt.policy, "noeviction", "WithEvictionAllowed"} {
				assert.Contains(t, err.Error(), s)
			}
			_, err = store.TakeOver(ctx, claim("k", "u", time.Minute), "t")
			require.ErrorIs(t, err, redisstore.ErrEvictionPolicy)
			_, err = store.ClaimPacked(ctx, idemserver.PackedClaim{Claim: claim("k", "v", time.Minute)})
			require.ErrorIs(t, err, redisstore.ErrEvictionPolicy)
			n, err := c.Exists(ctx, prefix+"{:k}").Result()
			require.NoError(t, err)
			assert.Zero(t, n, "nothing written")
		})
	}
}

func TestEvictionPolicyThroughMiddleware(t *testing.T) {
	// The middleware answers a refused claim 503 with Retry-After, does not
	// run the handler, and tells its observer why.
	server := startEvictionServer(t)
	server.set(t, "100mb", "volatile-lru")
	c := clientOf(t, server.addr)
	var seen events
	var runs atomic.Int64
	srv := httptest.NewServer(idemserver.Middleware(redisstore.New(c), idemserver.WithObserver(seen.add))(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { created(runs.Add(1), w) })))
	defer srv.Close()
	r := mustPost(t, srv, "k", "charge")
	assert.Equal(t, http.StatusServiceUnavailable, r.status)
	assert.NotEmpty(t, r.header.Get("Retry-After"))
	assert.Zero(t, runs.Load(), "the handler did not run")
	// The client is told the store refuses by its configuration: it is
	// reachable, and looking for a network fault would mislead.
	assert.Contains(t, string(r.body), idemserver.ProblemStoreUnavailable)
	assert.Contains(t, string(r.body), "configuration")
	assert.NotContains(t, string(r.body), "could not be reached")
	ev := seen.of("k")
	require.Len(t, ev, 1)
	assert.Equal(t, idemserver.OutcomeUnavailable, ev[0].Outcome)
	assert.ErrorIs(t, ev[0].Err, redisstore.ErrEvictionPolicy)
	assert.ErrorIs(t, ev[0].Err, idemserver.ErrStoreMisconfigured)
	assert.ErrorContains(t, ev[0].Err, "volatile-lru")
}

func TestEvictionPolicyChangedAtRuntime(t *testing.T) {
	// The store reads the settings on its first claim and again with the
	// first claim after each EvictionCheckInterval, by its clock: a policy
	// an operator changes at runtime is caught then, and so is the fix.
	// In between, a claim costs what it did: one round trip.
	server := startEvictionServer(t)
	var rt counter
	var cmds commands
	c := clientOf(t, server.addr, &rt, &cmds)
	var clock fakeClock
	store := redisstore.New(c, redisstore.WithPrefix(newPrefix(t, c)), redisstore.WithClock(clock.now))
	ctx := t.Context()
	warm(t, redisstore.New(c, redisstore.WithPrefix(newPrefix(t, c)))) // loads the scripts
	rt.take()
	cmds.take("")

	mustClaim(t, store, clock.claim("a", "a"))
	assert.EqualValues(t, 2, rt.take(), "the first claim: INFO memory, and the claim")
	assert.Equal(t, 1, cmds.take("info"))

	server.set(t, "100mb", "allkeys-lru")
	clock.add(redisstore.EvictionCheckInterval - time.Second)
	mustClaim(t, store, clock.claim("b", "b"))
	assert.EqualValues(t, 1, rt.take(), "within the interval: the claim alone, on the last verdict")

	clock.add(time.Second)
	_, err := store.Claim(ctx, clock.claim("c", "c"))
	require.ErrorIs(t, err, redisstore.ErrEvictionPolicy, "caught at the next check")
	assert.EqualValues(t, 1, rt.take(), "INFO memory, and no claim")
	_, err = store.Claim(ctx, clock.claim("c", "c"))
	require.ErrorIs(t, err, redisstore.ErrEvictionPolicy)
	assert.Zero(t, rt.take(), "refused on the last verdict, without a round trip")

	// Claims already held are not stranded: they are extended, completed
	// and released.
	resp := &idemserver.Response{Status: http.StatusCreated, Body: []byte("done")}
	a, b := clock.claim("a", "a"), clock.claim("b", "b")
	require.NoError(t, store.Extend(ctx, a.Key, a.Token, clock.now().Add(time.Minute)))
	require.NoError(t, store.Complete(ctx, a.Key, a.Token, resp, clock.now().Add(time.Hour)))
	require.NoError(t, store.Release(ctx, b.Key, b.Token))
	// A completed key does not replay: the claim is refused before it is
	// sent.
	_, err = store.Claim(ctx, clock.claim("a", "a2"))
	require.ErrorIs(t, err, redisstore.ErrEvictionPolicy)

	server.set(t, "100mb", "noeviction")
	_, err = store.Claim(ctx, clock.claim("d", "d"))
	require.ErrorIs(t, err, redisstore.ErrEvictionPolicy, "until the next check")
	clock.add(redisstore.EvictionCheckInterval)
	rt.take()
	res, err := store.Claim(ctx, clock.claim("a", "a3"))
	require.NoError(t, err, "fixed, and caught at the next check")
	assert.True(t, res.Record.Completed(), "the completed key replays again")
	assert.EqualValues(t, 2, rt.take(), "INFO memory, and the claim")
	cmds.take("")
	_, err = store.Claim(ctx, clock.claim("a", "a4"))
	require.NoError(t, err)
	assert.EqualValues(t, 1, rt.take(), "a replay: one round trip")
	assert.Equal(t, 0, cmds.take("info"), "no more INFO within the interval")
}

func TestEvictionAllowedSendsNoInfo(t *testing.T) {
	// An operator who accepts eviction, or cannot grant INFO, opts out:
	// the store never reads the settings, and claims go on.
	server := startEvictionServer(t)
	server.set(t, "100mb", "allkeys-lru")
	var cmds commands
	c := clientOf(t, server.addr, &cmds)
	var clock fakeClock
	store := redisstore.New(c, redisstore.WithPrefix(newPrefix(t, c)), redisstore.WithClock(clock.now), redisstore.WithEvictionAllowed())
	for i := range 3 {
		res, err := store.Claim(t.Context(), clock.claim("k", "t"+string(rune('0'+i))))
		require.NoError(t, err)
		assert.Equal(t, i == 0, res.Claimed)
		clock.add(redisstore.EvictionCheckInterval)
	}
	assert.Zero(t, cmds.take("info"))
}

func TestEvictionCheckRefused(t *testing.T) {
	// INFO is in ACL's @dangerous category, which operators often deny,
	// and a server may have it renamed. The store cannot tell whether Redis
	// evicts, and refuses claims with an error that says why and how to
	// opt out; opted out, it works.
	denied := startRedisWith(t, "--appendonly", "no")
	admin := clientOf(t, denied.addr)
	ctx := t.Context()
	require.NoError(t, admin.Do(ctx, "acl", "setuser", "idem", "on", ">secret", "~*", "&*", "+@all", "-@dangerous").Err())
	t.Cleanup(func() { _ = admin.Do(context.Background(), "acl", "deluser", "idem").Err() })
	renamed := startRedisWith(t, "--appendonly", "no", "--rename-command", "INFO", "")
	for name, opts := range map[string]*redis.Options{
		"ACL without INFO": {Addr: denied.addr, Username: "idem", Password: "secret"},
		"INFO renamed":     {Addr: renamed.addr},
	} {
		t.Run(name, func(t *testing.T) {
			c := redis.NewClient(opts)
			t.Cleanup(func() { _ = c.Close() })
			prefix := newPrefix(t, c)
			_, err := redisstore.New(c, redisstore.WithPrefix(prefix)).Claim(ctx, claim("k", "t", time.Minute))
			require.ErrorIs(t, err, redisstore.ErrEvictionPolicy)
			for _, s := range []string{"refused INFO", "+info", "WithEvictionAllowed"} {
				assert.Contains(t, err.Error(), s)
			}
			store := redisstore.New(c, redisstore.WithPrefix(prefix), redisstore.WithEvictionAllowed())
			warm(t, store)
		})
	}
}

func TestEvictionCheckFailed(t *testing.T) {
	// A check that could not be made, Redis being down, is no verdict: the
	// claim fails as its own command would have, and the next claim checks.
	server := startRedis(t, false)
	c := newRestartClient(t, server)
	store := redisstore.New(c)
	server.kill()
	_, err := store.Claim(t.Context(), claim("k", "t", time.Minute))
	require.Error(t, err)
	assert.NotErrorIs(t, err, redisstore.ErrEvictionPolicy)
	require.NoError(t, server.start())
	waitAnswers(t, c)
	mustClaim(t, store, claim("k", "t", time.Minute))
}

func TestEvictionCheckedOnceByConcurrentClaims(t *testing.T) {
	// Claims that come together to a new store, or after the interval, send
	// INFO once between them: one claim checks, and the others wait for its
	// verdict (the first time) or go on the last one.
	var cmds commands
	c := newClient(t, &cmds)
	var clock fakeClock
	store := redisstore.New(c, redisstore.WithPrefix(newPrefix(t, c)), redisstore.WithClock(clock.now))
	const n = 32
	claimAll := func(round int) {
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range n {
			wg.Go(func() {
				<-start
				cl := clock.claim(strings.Repeat("x", round+1)+string(rune('a'+i)), "t")
				res, err := store.Claim(t.Context(), cl)
				if assert.NoError(t, err) {
					assert.True(t, res.Claimed)
				}
			})
		}
		close(start)
		wg.Wait()
	}
	claimAll(0)
	assert.Equal(t, 1, cmds.take("info"), "concurrent first claims")
	clock.add(redisstore.EvictionCheckInterval)
	claimAll(1)
	assert.Equal(t, 1, cmds.take("info"), "concurrent claims after the interval")
}

// panicOnce is a go-redis hook that panics on the first INFO.
type panicOnce struct{ done atomic.Bool }

func (p *panicOnce) DialHook(next redis.DialHook) redis.DialHook { return next }

func (p *panicOnce) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "info" && p.done.CompareAndSwap(false, true) {
			panic("hook")
		}
		return next(ctx, cmd)
	}
}

func (p *panicOnce) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func TestEvictionCheckPanicked(t *testing.T) {
	// A check that panics (in a hook) leaves no check under way behind it
	// for later claims to wait on forever: the next claim checks again.
	c := newClient(t, new(panicOnce))
	store := redisstore.New(c, redisstore.WithPrefix(newPrefix(t, c)))
	assert.Panics(t, func() { _, _ = store.Claim(t.Context(), claim("k", "t", time.Minute)) })
	mustClaim(t, store, claim("k", "t", time.Minute))
}

func TestEvictionCheckClockStepsBack(t *testing.T) {
	// A clock given with WithClock need not be monotonic (time.Now().UTC()
	// is not): a step back must not stretch the last verdict by the size of
	// the step, during which a policy changed at runtime would go unseen.
	server := startEvictionServer(t)
	c := clientOf(t, server.addr)
	var clock fakeClock
	store := redisstore.New(c, redisstore.WithPrefix(newPrefix(t, c)), redisstore.WithClock(clock.now))
	ctx := t.Context()
	mustClaim(t, store, clock.claim("a", "a"))

	clock.add(-24 * time.Hour)
	server.set(t, "100mb", "allkeys-lru")
	clock.add(redisstore.EvictionCheckInterval)
	_, err := store.Claim(ctx, clock.claim("b", "b"))
	require.ErrorIs(t, err, redisstore.ErrEvictionPolicy, "caught an interval after the step back")
}

// stallInfo is a go-redis hook that holds the first INFO until its
// context ends, and reports when it holds it.
type stallInfo struct {
	first   atomic.Bool
	holding chan struct{}
}

func (s *stallInfo) DialHook(next redis.DialHook) redis.DialHook { return next }

func (s *stallInfo) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "info" && s.first.CompareAndSwap(false, true) {
			close(s.holding)
			<-ctx.Done()
			cmd.SetErr(ctx.Err())
			return ctx.Err()
		}
		return next(ctx, cmd)
	}
}

func (s *stallInfo) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// doneWatch is a context that reports when Done is first called: when a
// claim waits on it, before it sends anything.
type doneWatch struct {
	context.Context
	once    sync.Once
	waiting chan struct{}
}

func (d *doneWatch) Done() <-chan struct{} {
	d.once.Do(func() { close(d.waiting) })
	return d.Context.Done()
}

func TestEvictionCheckerCanceled(t *testing.T) {
	// The claim that checks goes away (its client did) while others wait
	// for its verdict: they do not fail with its cancellation, nor wait
	// forever, but check themselves.
	hook := &stallInfo{holding: make(chan struct{})}
	var cmds commands
	c := newClient(t, hook, &cmds)
	store := redisstore.New(c, redisstore.WithPrefix(newPrefix(t, c)))
	ctx, cancel := context.WithCancel(t.Context())
	first := make(chan error, 1)
	go func() {
		_, err := store.Claim(ctx, claim("first", "t", time.Minute))
		first <- err
	}()
	<-hook.holding
	const n = 8
	var wg sync.WaitGroup
	waiting := make([]*doneWatch, n)
	for i := range n {
		w := &doneWatch{Context: t.Context(), waiting: make(chan struct{})}
		waiting[i] = w
		wg.Go(func() {
			res, err := store.Claim(w, claim(fmt.Sprint("waiter-", i), "t", time.Minute))
			if assert.NoError(t, err) {
				assert.True(t, res.Claimed)
			}
		})
	}
	for _, w := range waiting {
		<-w.waiting
	}
	cancel()
	require.ErrorIs(t, <-first, context.Canceled)
	wg.Wait()
	assert.LessOrEqual(t, cmds.take("info"), 2, "one check after the one canceled")
}
