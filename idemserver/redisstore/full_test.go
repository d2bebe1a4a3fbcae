package redisstore_test

import (
	"net/http"
	"strconv"
	"strings"
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
	// completed, and completed keys replay.
	server := startRedis(t, false)
	c := redis.NewClient(&redis.Options{Addr: server.addr})
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
	big := strings.Repeat("x", 4096)
	for i := 0; ; i++ {
		err := c.Set(ctx, "fill"+strconv.Itoa(i), big, 0).Err()
		if err != nil {
			require.ErrorContains(t, err, "OOM")
			break
		}
		require.Less(t, i, 100000, "Redis never filled")
	}

	_, err = store.Claim(ctx, claim("new", "n", time.Minute))
	assert.ErrorContains(t, err, "OOM", "a new claim in a full Redis")
	n, err := c.Exists(ctx, redisstore.DefaultPrefix+"{:new}").Result()
	require.NoError(t, err)
	assert.Zero(t, n, "no record of the refused claim")

	res, err := store.Claim(ctx, claim("done", "d2", time.Minute))
	require.NoError(t, err)
	assert.True(t, res.Record.Completed(), "a completed key replays")
	assert.NoError(t, store.Extend(ctx, live.Key, live.Token, time.Now().Add(time.Minute)), "a live claim is extended")
	assert.NoError(t, store.Complete(ctx, live.Key, live.Token, resp, time.Now().Add(time.Hour)), "a live claim is completed")
	res, err = store.Claim(ctx, claim("live", "l2", time.Minute))
	require.NoError(t, err)
	assert.True(t, res.Record.Completed())
}
