package redisstore_test

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

// startCluster starts a Redis Cluster of two primaries, each serving half
// of the slots, and returns their addresses once both agree that the
// cluster is up.
func startCluster(t *testing.T) []string {
	ctx := t.Context()
	nodes := []*redisServer{
		startRedisWith(t, "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
		startRedisWith(t, "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
	}
	clients := make([]*redis.Client, len(nodes))
	addrs := make([]string, len(nodes))
	for i, n := range nodes {
		clients[i] = clientOf(t, n.addr)
		addrs[i] = n.addr
	}
	require.NoError(t, clients[0].Do(ctx, "cluster", "addslotsrange", 0, 8191).Err())
	require.NoError(t, clients[1].Do(ctx, "cluster", "addslotsrange", 8192, 16383).Err())
	host, port, err := net.SplitHostPort(addrs[1])
	require.NoError(t, err)
	require.NoError(t, clients[0].ClusterMeet(ctx, host, port).Err())
	deadline := time.Now().Add(30 * time.Second)
	for _, c := range clients {
		for {
			info, err := c.ClusterInfo(ctx).Result()
			require.NoError(t, err)
			if strings.Contains(info, "cluster_state:ok") && strings.Contains(info, "cluster_known_nodes:2") {
				break
			}
			require.True(t, time.Now().Before(deadline), "the cluster did not come up:\n%s", info)
			time.Sleep(50 * time.Millisecond)
		}
	}
	for _, c := range clients {
		require.NoError(t, c.ConfigResetStat(ctx).Err())
	}
	return addrs
}

// movedReplies returns how many commands the servers at addrs answered
// with MOVED, sent to a node that does not serve their key's slot.
func movedReplies(t *testing.T, addrs []string) int {
	total := 0
	for _, addr := range addrs {
		info, err := clientOf(t, addr).Info(t.Context(), "errorstats").Result()
		require.NoError(t, err)
		for line := range strings.Lines(info) {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "errorstat_MOVED:count="); ok {
				n, err := strconv.Atoi(rest)
				require.NoError(t, err)
				total += n
			}
		}
	}
	return total
}

// TestClusterClaimGoesToItsNode checks that on Redis Cluster each claim's
// SET goes straight to the node that serves its key's slot, as every
// other command of the store does: the client routes a command by its
// first key, which it must be able to read from the arguments.
func TestClusterClaimGoesToItsNode(t *testing.T) {
	addrs := startCluster(t)
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { _ = c.Close() })
	store := redisstore.New(c)
	ctx := context.Background()
	// Half of the keys hash to each node; a claim routed anywhere but by
	// its key lands on the wrong one about every other time.
	for i := range 32 {
		cl := claim(fmt.Sprint("cluster-", i), fmt.Sprint("token-", i), time.Minute)
		res, err := store.Claim(ctx, cl)
		require.NoError(t, err)
		require.True(t, res.Claimed)
		res, err = store.Claim(ctx, claim(cl.Key.Key, "other", time.Minute))
		require.NoError(t, err)
		require.False(t, res.Claimed, "the second claim finds the first's record")
	}
	assert.Zero(t, movedReplies(t, addrs), "commands sent to a node that does not serve their key")
}

// infoCalls returns how many INFO commands the server at addr has
// answered since its statistics were reset (startCluster resets them),
// not counting the one that asks.
func infoCalls(t *testing.T, addr string) int {
	info, err := clientOf(t, addr).Info(t.Context(), "commandstats").Result()
	require.NoError(t, err)
	for line := range strings.Lines(info) {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_info:calls="); ok {
			n, err := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
			require.NoError(t, err)
			return n
		}
	}
	return 0
}

func TestClusterEvictionPolicy(t *testing.T) {
	// On Redis Cluster the store reads the eviction settings of every
	// primary: one that may evict is enough to refuse claims, whichever
	// node their keys hash to, and the error names it.
	addrs := startCluster(t)
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { _ = c.Close() })
	second := clientOf(t, addrs[1])
	ctx := context.Background()
	var clock fakeClock
	store := redisstore.New(c, redisstore.WithClock(clock.now))
	mustClaim(t, store, clock.claim("k0", "t"))
	assert.Equal(t, 1, infoCalls(t, addrs[0]), "INFO on the first primary")
	assert.Equal(t, 1, infoCalls(t, addrs[1]), "INFO on the second primary")

	require.NoError(t, second.ConfigSet(ctx, "maxmemory", "100mb").Err())
	require.NoError(t, second.ConfigSet(ctx, "maxmemory-policy", "volatile-lru").Err())
	t.Cleanup(func() {
		_ = second.ConfigSet(context.Background(), "maxmemory", "0").Err()
		_ = second.ConfigSet(context.Background(), "maxmemory-policy", "noeviction").Err()
	})
	clock.add(redisstore.EvictionCheckInterval)
	for i := range 8 {
		_, err := store.Claim(ctx, clock.claim(fmt.Sprint("k", i+1), "t"))
		require.ErrorIs(t, err, redisstore.ErrEvictionPolicy, "a claim of a key on either node")
		assert.ErrorContains(t, err, addrs[1])
		assert.ErrorContains(t, err, "volatile-lru")
	}

	require.NoError(t, second.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err())
	clock.add(redisstore.EvictionCheckInterval)
	mustClaim(t, store, clock.claim("k9", "t"))
}
