package redisstore_test

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

func TestFullRedis(t *testing.T) {
	// A Redis at its maxmemory with maxmemory-policy noeviction refuses new
	// claims, so the middleware answers 503 rather than letting Redis grow
	// past its bound, while the claims it holds can still be extended and
	// completed, and completed keys replay. Redis refuses SET NX GET there
	// even when it would write nothing, so a replay or a claim sent again
	// reads the record with a GET: a second round trip, while Redis is full.
	server := startRedis(t, false)
	var rt counter
	c := redis.NewClient(&redis.Options{Addr: server.addr})
	c.AddHook(&rt)
	t.Cleanup(func() { _ = c.Close() })
	ctx := t.Context()
	store := redisstore.New(c)
	warm(t, store)

	done := claim("done", "d", time.Minute)
	mustClaim(t, store, done)
	resp := &idemserver.Response{Status: http.StatusCreated, Body: []byte("done")}
	require.NoError(t, store.Complete(ctx, done.Key, done.Token, resp, time.Now().Add(time.Hour)))
	live := claim("live", "l", time.Minute)
	mustClaim(t, store, live)
	dead := claim("dead", "dead", time.Millisecond)
	mustClaim(t, store, dead)
	waitLeaseEnded(t, store, dead)
	var runs atomic.Int64
	srv := httptest.NewServer(idemserver.Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		created(runs.Add(1), w)
	})))
	defer srv.Close()
	require.Equal(t, http.StatusCreated, mustPost(t, srv, "http", "b").status)

	require.NoError(t, c.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err())
	info, err := c.Info(ctx, "memory").Result()
	require.NoError(t, err)
	var mem int64
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			mem, err = strconv.ParseInt(v, 10, 64)
			require.NoError(t, err)
		}
	}
	require.NotZero(t, mem)
	require.NoError(t, c.ConfigSet(ctx, "maxmemory", strconv.FormatInt(mem+256<<10, 10)).Err())
	// Fill it with large values, then with small ones, so that even a
	// command as small as a claim finds it full: Redis counts a command's
	// own query buffer in its memory when it checks.
	for _, size := range []int{4096, 16} {
		value := strings.Repeat("x", size)
		for i := 0; ; i++ {
			err := c.Set(ctx, "fill"+strconv.Itoa(size)+":"+strconv.Itoa(i), value, 0).Err()
			if err != nil {
				require.ErrorContains(t, err, "OOM")
				break
			}
			require.Less(t, i, 100000, "Redis never filled")
		}
	}

	rt.take()
	_, err = store.Claim(ctx, claim("new", "n", time.Minute))
	assert.ErrorContains(t, err, "OOM", "a new claim in a full Redis")
	assert.ErrorIs(t, err, idemserver.ErrStoreFull, "the store is full of live records")
	assert.EqualValues(t, 2, rt.take(), "the refused SET, and the GET that finds nothing")
	n, err := c.Exists(ctx, redisstore.DefaultPrefix+"{:new}").Result()
	require.NoError(t, err)
	assert.Zero(t, n, "no record of the refused claim")

	rt.take()
	res, err := store.Claim(ctx, claim("done", "d2", time.Minute))
	require.NoError(t, err)
	assert.True(t, res.Record.Completed(), "a completed key replays")
	assert.Equal(t, resp.Body, res.Record.Response.Body)
	assert.EqualValues(t, 2, rt.take(), "the refused SET, and the GET")

	// A claim sent again (go-redis resends one whose reply was lost) finds
	// its own lease; another finds the key in progress, as before.
	res, err = store.Claim(ctx, live)
	require.NoError(t, err)
	assert.True(t, res.Claimed, "the claim sent again still wins")
	res, err = store.Claim(ctx, claim("live", "other", time.Minute))
	require.NoError(t, err)
	assert.False(t, res.Claimed)
	assert.Equal(t, live.Token, res.Record.Token, "in progress")

	// A completed record expired by the middleware's clock, but not yet in
	// Redis, cannot be replaced in a full Redis: refused.
	later := claim("done", "d3", time.Minute)
	later.Now = later.Now.Add(2 * time.Hour)
	later.LeaseExpires = later.Now.Add(time.Minute)
	_, err = aheadOf(c, redisstore.DefaultPrefix, 2*time.Hour).Claim(ctx, later)
	assert.ErrorContains(t, err, "OOM", "a claim of an expired record in a full Redis")
	assert.ErrorIs(t, err, idemserver.ErrStoreFull)
	// Nor can an ended lease be taken over.
	_, err = store.TakeOver(ctx, claim("dead", "taker", time.Minute), dead.Token)
	assert.ErrorContains(t, err, "OOM", "a takeover in a full Redis")
	assert.ErrorIs(t, err, idemserver.ErrStoreFull)

	assert.NoError(t, store.Extend(ctx, live.Key, live.Token, time.Now().Add(time.Minute)), "a live claim is extended")
	assert.NoError(t, store.Complete(ctx, live.Key, live.Token, resp, time.Now().Add(time.Hour)), "a live claim is completed")
	res, err = store.Claim(ctx, claim("live", "l2", time.Minute))
	require.NoError(t, err)
	assert.True(t, res.Record.Completed())

	// Through the middleware, which claims with ClaimPacked: the completed
	// key replays, and a new one gets 503 without running its handler.
	r := mustPost(t, srv, "http", "b")
	assert.Equal(t, "true", r.header.Get(idemserver.ReplayedHeader))
	assert.Equal(t, "run 1", string(r.body))
	r = mustPost(t, srv, "http-new", "b")
	assert.Equal(t, http.StatusServiceUnavailable, r.status)
	assert.Contains(t, string(r.body), "the idempotency store is full", "the observer and the client are told it is full")
	assert.EqualValues(t, 1, runs.Load())
}
