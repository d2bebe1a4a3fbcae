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
	nodes := startClusterNodes(t)
	return []string{nodes[0].addr, nodes[1].addr}
}

// startClusterNodes is startCluster, with the servers' options extra, and
// returns the servers.
func startClusterNodes(t *testing.T, extra ...string) []*redisServer {
	ctx := t.Context()
	args := append([]string{"--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"}, extra...)
	nodes := []*redisServer{startRedisWith(t, args...), startRedisWith(t, args...)}
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
	return nodes
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

// keyOn returns a key, named from base, whose record under the default
// prefix the Cluster node c serves.
func keyOn(t *testing.T, c *redis.Client, base string) string {
	slots, err := c.ClusterShards(t.Context()).Result()
	require.NoError(t, err)
	id, err := c.ClusterMyID(t.Context()).Result()
	require.NoError(t, err)
	for i := range 1000 {
		key := fmt.Sprint(base, i)
		slot, err := c.ClusterKeySlot(t.Context(), redisstore.DefaultPrefix+"{:"+key+"}").Result()
		require.NoError(t, err)
		for _, sh := range slots {
			for _, n := range sh.Nodes {
				if n.ID != id {
					continue
				}
				for _, r := range sh.Slots {
					if slot >= r.Start && slot <= r.End {
						return key
					}
				}
			}
		}
	}
	t.Fatal("no key found on the node")
	return ""
}

func TestClusterEvictionCheckWithAPrimaryDown(t *testing.T) {
	// A Cluster that serves the slots of its live primaries while another
	// is down (cluster-require-full-coverage no) takes claims of their
	// keys. The check must not refuse them because it cannot ask the
	// primary that is down, whose settings it has read before: that turns
	// the loss of one primary into the loss of all, and makes every claim
	// send INFO to every primary while it lasts.
	nodes := startClusterNodes(t, "--cluster-require-full-coverage", "no")
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{nodes[0].addr, nodes[1].addr}, MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	first := clientOf(t, nodes[0].addr)
	var clock fakeClock
	store := redisstore.New(c, redisstore.WithClock(clock.now))
	mustClaim(t, store, clock.claim(keyOn(t, first, "before-"), "t"))
	assert.Equal(t, 1, infoCalls(t, nodes[0].addr), "INFO on the live primary")

	nodes[1].kill()
	clock.add(redisstore.EvictionCheckInterval)
	for i := range 4 {
		key := keyOn(t, first, fmt.Sprint("during-", i, "-"))
		_, err := store.Claim(t.Context(), clock.claim(key, "t"))
		require.NoError(t, err, "a claim of a key the live primary serves")
	}
	// A store that never read the settings of the primary that is down
	// cannot tell whether it evicts, and refuses.
	_, err := redisstore.New(c, redisstore.WithClock(clock.now)).Claim(t.Context(), clock.claim(keyOn(t, first, "fresh-"), "t"))
	require.ErrorContains(t, err, "reading Redis's eviction settings", "a primary never checked")
	// The earlier count was an INFO too, and so was the new store's.
	assert.Equal(t, 4, infoCalls(t, nodes[0].addr), "one check more, not one per claim")
}
