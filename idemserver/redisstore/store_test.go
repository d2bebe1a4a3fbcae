package redisstore_test

import (
	"context"
	"crypto/sha256"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
	"github.com/idemhttp/idemhttp/internal/respcodec"
)

// fixture is a store on the test server with a prefix of its own, and the
// client it uses.
type fixture struct {
	t      *testing.T
	client *redis.Client
	prefix string
	store  *redisstore.Store
}

func newFixture(t *testing.T, opts ...redisstore.Option) *fixture {
	c := newClient(t)
	prefix := newPrefix(t, c)
	return &fixture{t: t, client: c, prefix: prefix,
		store: redisstore.New(c, append([]redisstore.Option{redisstore.WithPrefix(prefix)}, opts...)...)}
}

// claim returns a claim of key whose lease lasts d from now.
func claim(key string, token string, d time.Duration) idemserver.Claim {
	now := time.Now()
	return idemserver.Claim{
		Key:          idemserver.Key{Key: key},
		Fingerprint:  sha256.Sum256([]byte("request")),
		Token:        token,
		Now:          now,
		LeaseExpires: now.Add(d),
	}
}

// redisKey returns the one Redis key under the fixture's prefix.
func (f *fixture) redisKey() string {
	f.t.Helper()
	keys, err := f.client.Keys(f.t.Context(), f.prefix+"*").Result()
	require.NoError(f.t, err)
	require.Len(f.t, keys, 1, "one Redis key per record")
	return keys[0]
}

func TestRecordLayout(t *testing.T) {
	f := newFixture(t)
	ctx := t.Context()
	c := claim("k", "t1", time.Minute)
	res, err := f.store.Claim(ctx, c)
	require.NoError(t, err)
	require.True(t, res.Claimed)

	// One hash, under a key whose hash tag is the (scope, key) pair.
	key := f.redisKey()
	assert.Equal(t, f.prefix+"{:k}", key)
	typ, err := f.client.Type(ctx, key).Result()
	require.NoError(t, err)
	assert.Equal(t, "hash", typ)

	// In progress: it expires in Redis with its lease plus the margin.
	pttl, err := f.client.PTTL(ctx, key).Result()
	require.NoError(t, err)
	assert.Greater(t, pttl, redisstore.LeaseMargin+time.Minute-10*time.Second, "PTTL of an in-progress record")
	assert.LessOrEqual(t, pttl, redisstore.LeaseMargin+time.Minute)

	// Completed: it expires with its own TTL, and keeps no lease.
	resp := &idemserver.Response{Status: http.StatusCreated, Body: []byte("done")}
	require.NoError(t, f.store.Complete(ctx, c.Key, c.Token, resp, time.Now().Add(2*time.Hour)))
	pttl, err = f.client.PTTL(ctx, key).Result()
	require.NoError(t, err)
	assert.Greater(t, pttl, 2*time.Hour-10*time.Second, "PTTL of a completed record")
	assert.LessOrEqual(t, pttl, 2*time.Hour)
	fields, err := f.client.HKeys(ctx, key).Result()
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"f", "r", "e", "c"}, fields)
	stored, err := f.client.HGet(ctx, key, "r").Bytes()
	require.NoError(t, err)
	assert.Equal(t, respcodec.Encode(resp), stored, "the response in respcodec's encoding")

	// Extend moves the native expiry with the lease.
	c2 := claim("k2", "t2", time.Minute)
	res, err = f.store.Claim(ctx, c2)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.NoError(t, f.store.Extend(ctx, c2.Key, c2.Token, time.Now().Add(time.Hour)))
	pttl, err = f.client.PTTL(ctx, f.prefix+"{:k2}").Result()
	require.NoError(t, err)
	assert.Greater(t, pttl, redisstore.LeaseMargin+time.Hour-10*time.Second, "PTTL after Extend")
}

func TestClaimSentAgain(t *testing.T) {
	// A claim that Redis ran, sent again because its reply was lost, is
	// still the winner; any other claim finds it in progress.
	f := newFixture(t)
	c := claim("k", "t1", time.Minute)
	for range 2 {
		res, err := f.store.Claim(t.Context(), c)
		require.NoError(t, err)
		require.True(t, res.Claimed)
	}
	res, err := f.store.Claim(t.Context(), claim("k", "t2", time.Minute))
	require.NoError(t, err)
	assert.False(t, res.Claimed)
	assert.Equal(t, "t1", res.Record.Token)
}

func TestTakeOverSparesExtendedLease(t *testing.T) {
	// A request saw the lease ended and asks to take it over, but its holder
	// extended it in the meantime: the live handler keeps its key.
	f := newFixture(t)
	ctx := t.Context()
	c := claim("k", "holder", time.Millisecond)
	res, err := f.store.Claim(ctx, c)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	waitLeaseEnded(t, f.store, c)
	require.NoError(t, f.store.Extend(ctx, c.Key, c.Token, time.Now().Add(time.Hour)))

	taker := claim("k", "taker", time.Minute)
	res, err = f.store.TakeOver(ctx, taker, c.Token)
	require.NoError(t, err)
	assert.False(t, res.Claimed, "took over an extended lease")
	assert.Equal(t, c.Token, res.Record.Token)
	assert.True(t, taker.Now.Before(res.Record.LeaseExpires), "the record reports the live lease")
	require.NoError(t, f.store.Complete(ctx, c.Key, c.Token, &idemserver.Response{Status: 200}, time.Now().Add(time.Hour)))
}

// waitLeaseEnded polls until a claim of c's key finds c's lease ended.
func waitLeaseEnded(t *testing.T, s idemserver.Store, c idemserver.Claim) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		probe := claim(c.Key.Key, "probe", time.Minute)
		res, err := s.Claim(t.Context(), probe)
		require.NoError(t, err)
		require.False(t, res.Claimed)
		require.Equal(t, c.Token, res.Record.Token)
		if !probe.Now.Before(res.Record.LeaseExpires) {
			return
		}
		require.True(t, time.Now().Before(deadline), "lease not ended")
		time.Sleep(time.Millisecond)
	}
}

func TestClock(t *testing.T) {
	// Complete and Extend turn the middleware's times into durations with
	// the clock the store is given, so a middleware clock far from the real
	// one keeps records for the TTL it meant.
	past := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
	f := newFixture(t, redisstore.WithClock(func() time.Time { return past }))
	ctx := t.Context()
	c := idemserver.Claim{Key: idemserver.Key{Key: "k"}, Token: "t", Now: past, LeaseExpires: past.Add(time.Minute)}
	res, err := f.store.Claim(ctx, c)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.NoError(t, f.store.Extend(ctx, c.Key, c.Token, past.Add(time.Hour)))
	res, err = f.store.Claim(ctx, idemserver.Claim{Key: c.Key, Token: "u", Now: past, LeaseExpires: past.Add(time.Minute)})
	require.NoError(t, err)
	require.False(t, res.Claimed)
	assert.InDelta(t, time.Hour.Seconds(), res.Record.LeaseExpires.Sub(past).Seconds(), 10, "lease reported an hour after the claim's time")

	require.NoError(t, f.store.Complete(ctx, c.Key, c.Token, &idemserver.Response{Status: 200}, past.Add(time.Hour)))
	pttl, err := f.client.PTTL(ctx, f.redisKey()).Result()
	require.NoError(t, err)
	assert.Greater(t, pttl, time.Hour-10*time.Second)
	res, err = f.store.Claim(ctx, idemserver.Claim{Key: c.Key, Token: "v", Now: past, LeaseExpires: past.Add(time.Minute)})
	require.NoError(t, err)
	require.True(t, res.Record.Completed())
	assert.InDelta(t, time.Hour.Seconds(), res.Record.Expires.Sub(past).Seconds(), 10, "expiry reported an hour after the claim's time")
}

func TestBadRecords(t *testing.T) {
	// What the store did not write is an error, never a claim or a replay;
	// through the middleware it is a 503, and the handler does not run.
	for _, tt := range []struct {
		name  string
		setup func(ctx context.Context, c *redis.Client, key string) error
		is    error
	}{
		{"not a hash", func(ctx context.Context, c *redis.Client, key string) error {
			return c.Set(ctx, key, "x", time.Hour).Err()
		}, nil},
		{"response of a later version", func(ctx context.Context, c *redis.Client, key string) error {
			return c.HSet(ctx, key, "f", strings.Repeat("f", 32), "r", "\x02later", "e", "9999999999999999").Err()
		}, respcodec.ErrUnknownVersion},
		{"damaged response", func(ctx context.Context, c *redis.Client, key string) error {
			return c.HSet(ctx, key, "f", strings.Repeat("f", 32), "r", "\x01", "e", "9999999999999999").Err()
		}, respcodec.ErrCorrupt},
		{"short fingerprint", func(ctx context.Context, c *redis.Client, key string) error {
			return c.HSet(ctx, key, "f", "short", "t", "x", "l", "9999999999999999").Err()
		}, redisstore.ErrUnexpectedReply},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t)
			require.NoError(t, tt.setup(t.Context(), f.client, f.prefix+"{:k}"))
			_, err := f.store.Claim(t.Context(), claim("k", "t", time.Minute))
			require.Error(t, err)
			if tt.is != nil {
				assert.ErrorIs(t, err, tt.is)
			}

			runs := 0
			srv := httptest.NewServer(idemserver.Middleware(f.store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
			})))
			defer srv.Close()
			req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("body"))
			require.NoError(t, err)
			req.Header.Set(idemserver.DefaultKeyHeader, "k")
			resp, err := srv.Client().Do(req)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
			assert.Zero(t, runs)
		})
	}
}

func TestEmptyToken(t *testing.T) {
	f := newFixture(t)
	_, err := f.store.Claim(t.Context(), claim("k", "", time.Minute))
	require.Error(t, err)
	keys, err := f.client.Keys(t.Context(), f.prefix+"*").Result()
	require.NoError(t, err)
	assert.Empty(t, keys, "nothing was written")
}
