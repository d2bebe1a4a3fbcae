package redisstore_test

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
	"github.com/idemhttp/idemhttp/idemserver/redisstore"
	"github.com/idemhttp/idemhttp/internal/respcodec"
)

// behind is a middleware clock ten minutes behind the real one.
func behind() time.Time { return time.Now().Add(-10 * time.Minute) }

func TestClaimStampedByAnotherClockIsRefused(t *testing.T) {
	// A middleware given a clock of its own and a store not given it would
	// keep records for the wrong time: Extend and Complete reckon the
	// native expiry on the store's clock, and a live record could vanish
	// from Redis while its handler runs. The store refuses such a claim.
	f := newFixture(t) // no WithClock
	now := behind()
	c := idemserver.Claim{Key: idemserver.Key{Key: "k"}, Token: "holder", Now: now, LeaseExpires: now.Add(time.Minute)}
	_, err := f.store.Claim(t.Context(), c)
	require.ErrorIs(t, err, redisstore.ErrClockSkew)
	_, err = f.store.TakeOver(t.Context(), c, "old")
	require.ErrorIs(t, err, redisstore.ErrClockSkew)
	keys, err := f.client.Keys(t.Context(), f.prefix+"*").Result()
	require.NoError(t, err)
	assert.Empty(t, keys, "nothing was written")

	// Through the middleware: 503, and the handler does not run.
	var runs atomic.Int64
	srv := httptest.NewServer(idemserver.Middleware(f.store, idemserver.WithClock(behind))(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { created(runs.Add(1), w) })))
	defer srv.Close()
	got := mustPost(t, srv, "k", "charge")
	assert.Equal(t, http.StatusServiceUnavailable, got.status, got.body)
	assert.Zero(t, runs.Load())
}

func TestReplayWhileRedisRefusesWrites(t *testing.T) {
	// With min-replicas-to-write and no replica, Redis refuses every write
	// command, SET NX GET among them, though it writes nothing on a
	// completed key; it still answers reads. A replay reads the record
	// then, as it does in a full Redis.
	server := startRedis(t, false)
	c := redis.NewClient(&redis.Options{Addr: server.addr})
	t.Cleanup(func() { _ = c.Close() })
	ctx := t.Context()
	store := redisstore.New(c)
	done := claim("done", "d", time.Minute)
	mustClaim(t, store, done)
	resp := &idemserver.Response{Status: http.StatusCreated, Body: []byte("charged")}
	require.NoError(t, store.Complete(ctx, done.Key, done.Token, resp, time.Now().Add(time.Hour)))

	require.NoError(t, c.ConfigSet(ctx, "min-replicas-to-write", "1").Err())
	v, err := c.Get(ctx, redisstore.DefaultPrefix+"{:done}").Result()
	require.NoError(t, err, "Redis still reads")
	require.NotEmpty(t, v)
	res, err := store.Claim(ctx, claim("done", "d2", time.Minute))
	require.NoError(t, err, "a replay of a completed key")
	assert.True(t, res.Record.Completed())
}

func TestCompleteCalledAgainWithTheSameResponse(t *testing.T) {
	// The middleware calls Complete again after a transient error (through
	// Store, for a store it does not see as a PackedStore). The same
	// response has the same encoding, whatever the order of its header
	// map, so the completion that its own token made is recognised rather
	// than reported as ErrLeaseLost.
	f := newFixture(t)
	ctx := t.Context()
	c := claim("k", "t", time.Minute)
	mustClaim(t, f.store, c)
	h := http.Header{}
	for i := range 12 {
		h.Set("X-Field-"+strconv.Itoa(i), "v")
	}
	resp := &idemserver.Response{Status: http.StatusCreated, Header: h, Body: []byte("charged")}
	expires := time.Now().Add(time.Hour)
	require.NoError(t, f.store.Complete(ctx, c.Key, c.Token, resp, expires))
	for range 10 {
		require.NoError(t, f.store.Complete(ctx, c.Key, c.Token, resp, expires), "the same completion, again")
	}
}

func TestFieldWithoutANameIsNotStored(t *testing.T) {
	// A handler sets a header field with an empty name. net/http drops it
	// on the wire, and the client gets its 201; the middleware does not
	// store it either, so that the stored response is one a replay can
	// read: the retry gets the 201, over every store.
	for name, store := range map[string]idemserver.Store{"memory": idemserver.NewMemoryStore(), "redis": newStore(t)} {
		t.Run(name, func(t *testing.T) {
			var runs atomic.Int64
			srv := httptest.NewServer(idemserver.Middleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header()[""] = []string{"x"}
				created(runs.Add(1), w)
			})))
			defer srv.Close()
			first := mustPost(t, srv, "k", "charge")
			require.Equal(t, http.StatusCreated, first.status)
			retry := mustPost(t, srv, "k", "charge")
			assert.Equal(t, http.StatusCreated, retry.status, "the retry replays the stored success: %s", retry.body)
			assert.EqualValues(t, 1, runs.Load())
		})
	}
}

func TestTimeFieldPastTheLayoutsRange(t *testing.T) {
	// The store writes times below 2^53 µs. A record whose time field is
	// past that was not written by it: the claim and the scripts both
	// refuse it, rather than Go reading it as 1969 and Lua as the far
	// future.
	f := newFixture(t)
	ctx := t.Context()
	v := []byte(recordValue(1, 'c', "t", string(respcodecOK())))
	for i := 34; i < 42; i++ {
		v[i] = 0xff
	}
	require.NoError(t, f.client.Set(ctx, f.prefix+"{:k}", v, time.Hour).Err())
	res, err := f.store.Claim(ctx, claim("k", "u", time.Minute))
	require.ErrorIs(t, err, redisstore.ErrUnexpectedReply, "a time the layout cannot hold is refused, not read: got %+v", res.Record)
	_, err = f.store.TakeOver(ctx, claim("k", "u", time.Minute), "t")
	require.ErrorIs(t, err, redisstore.ErrUnexpectedReply)
	err = f.store.Complete(ctx, idemserver.Key{Key: "k"}, "t", &idemserver.Response{Status: http.StatusOK}, time.Now().Add(time.Hour))
	require.ErrorIs(t, err, redisstore.ErrUnexpectedReply)
	got, err := f.client.Get(ctx, f.prefix+"{:k}").Bytes()
	require.NoError(t, err)
	assert.Equal(t, v, got, "the record is left alone")
}

func respcodecOK() []byte {
	return respcodec.Encode(&idemserver.Response{Status: http.StatusCreated, Body: []byte("ok")})
}
