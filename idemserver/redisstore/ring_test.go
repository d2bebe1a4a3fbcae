package redisstore_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

func TestNewRefusesRing(t *testing.T) {
	// A Ring would lose records in silence (see TestRingMovesKeys), so a
	// store over one is a programming error, refused when it is made
	// rather than found out by a payment made twice.
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1", "b": "127.0.0.1:2"}})
	defer ring.Close()
	assert.PanicsWithValue(t, "redisstore: New: a *redis.Ring cannot keep idempotency records (see the package documentation); use a *redis.Client, a Sentinel failover client or a *redis.ClusterClient",
		func() { redisstore.New(ring) })
}

func TestRingMovesKeys(t *testing.T) {
	// Why the store refuses a Ring: when a shard is down, a Ring hashes
	// its keys to the other shards, where they are absent. A completed
	// record on the down shard is then claimed again, and its handler runs
	// a second time; an in-progress one, beside the handler still running.
	a, b := startRedis(t, false), startRedis(t, false)
	ring := redis.NewRing(&redis.RingOptions{
		Addrs:              map[string]string{"a": a.addr, "b": b.addr},
		HeartbeatFrequency: 10 * time.Millisecond,
		MaxRetries:         -1,
	})
	defer ring.Close()
	ctx := t.Context()
	const key = "idem:{:k}"
	set, err := ring.SetNX(ctx, key, "record", time.Hour).Result()
	require.NoError(t, err)
	require.True(t, set)
	onA := redis.NewClient(&redis.Options{Addr: a.addr})
	defer onA.Close()
	n, err := onA.Exists(ctx, key).Result()
	require.NoError(t, err)
	if n == 1 {
		a.kill()
	} else {
		b.kill()
	}
	// Once the Ring has found the shard down, the key is on the other.
	require.Eventually(t, func() bool {
		set, err = ring.SetNX(ctx, key, "another", time.Hour).Result()
		return err == nil
	}, 10*time.Second, 10*time.Millisecond)
	assert.True(t, set, "the key was absent: its record was lost")
}
