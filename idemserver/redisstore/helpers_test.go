package redisstore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
)

// The tests run against the Redis server at IDEMHTTP_TEST_REDIS_ADDR
// (host:port), as scripts/with-redis.sh sets it, and skip without one.
const addrEnv = "IDEMHTTP_TEST_REDIS_ADDR"

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// redisAddr returns the test server's address, or skips t.
func redisAddr(t testing.TB) string {
	t.Helper()
	addr := os.Getenv(addrEnv)
	if addr == "" {
		t.Skip(addrEnv + " is not set; run the tests with scripts/with-redis.sh")
	}
	return addr
}

// newClient returns a client of the test server, closed when t ends, and
// skips t without one.
func newClient(t testing.TB, hooks ...redis.Hook) *redis.Client {
	t.Helper()
	return clientOf(t, redisAddr(t), hooks...)
}

// clientOf returns a client of the server at addr, closed when t ends.
func clientOf(t testing.TB, addr string, hooks ...redis.Hook) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 64})
	for _, h := range hooks {
		c.AddHook(h)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// newPrefix returns a key prefix unique to one test, whose keys are deleted
// from the server reached by c when t ends.
func newPrefix(t testing.TB, c redis.UniversalClient) string {
	t.Helper()
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	prefix := "idemtest:" + hex.EncodeToString(b) + ":"
	t.Cleanup(func() {
		// The test's context has ended by now.
		ctx := context.Background()
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		var keys []string
		for iter.Next(ctx) {
			keys = append(keys, iter.Val())
		}
		if err := iter.Err(); err != nil {
			t.Logf("cleaning up %s*: %v", prefix, err)
			return
		}
		if len(keys) > 0 {
			if err := c.Del(ctx, keys...).Err(); err != nil {
				t.Logf("cleaning up %s*: %v", prefix, err)
			}
		}
	})
	return prefix
}

// newStore returns a store on the test server with a prefix of its own.
func newStore(t *testing.T) idemserver.Store {
	c := newClient(t)
	return redisstore.New(c, redisstore.WithPrefix(newPrefix(t, c)))
}

// counter is a go-redis hook that counts the commands sent, as round
// trips: each command or pipeline is one.
type counter struct {
	n atomic.Int64
}

func (c *counter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

func (c *counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmds)
	}
}

// take returns the count and resets it.
func (c *counter) take() int64 { return c.n.Swap(0) }
