package redisstore_test

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
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

	// One string, under a key whose hash tag is the (scope, key) pair.
	key := f.redisKey()
	assert.Equal(t, f.prefix+"{:k}", key)
	typ, err := f.client.Type(ctx, key).Result()
	require.NoError(t, err)
	assert.Equal(t, "string", typ)
	v, err := f.client.Get(ctx, key).Bytes()
	require.NoError(t, err)
	want := []byte{1, 'p'}
	want = append(want, c.Fingerprint[:]...)
	want = binary.BigEndian.AppendUint64(want, uint64(c.LeaseExpires.UnixMicro()))
	want = append(want, 0, 2, 't', '1')
	assert.Equal(t, want, v, "version, state, fingerprint, lease end, token")

	// In progress: it expires in Redis with its lease plus the margin.
	pttl, err := f.client.PTTL(ctx, key).Result()
	require.NoError(t, err)
	assert.Greater(t, pttl, redisstore.LeaseMargin+time.Minute-10*time.Second, "PTTL of an in-progress record")
	assert.LessOrEqual(t, pttl, redisstore.LeaseMargin+time.Minute+time.Millisecond)

	// Completed: it expires with its own TTL; the state and the time
	// change, the token stays, and the response follows in respcodec's
	// encoding.
	resp := &idemserver.Response{Status: http.StatusCreated, Body: []byte("done")}
	expires := time.Now().Add(2 * time.Hour)
	require.NoError(t, f.store.Complete(ctx, c.Key, c.Token, resp, expires))
	pttl, err = f.client.PTTL(ctx, key).Result()
	require.NoError(t, err)
	// Complete reckons on the store's clock, which may be MaxClockSkew
	// behind the middleware's that stamped expires: Redis keeps the record
	// that much longer.
	assert.Greater(t, pttl, 2*time.Hour+redisstore.MaxClockSkew-time.Second, "PTTL of a completed record")
	assert.LessOrEqual(t, pttl, 2*time.Hour+redisstore.MaxClockSkew+time.Millisecond)
	v, err = f.client.Get(ctx, key).Bytes()
	require.NoError(t, err)
	want = []byte{1, 'c'}
	want = append(want, c.Fingerprint[:]...)
	want = binary.BigEndian.AppendUint64(want, uint64(expires.UnixMicro()))
	want = append(want, 0, 2, 't', '1')
	want = append(want, respcodec.Encode(resp)...)
	assert.Equal(t, want, v, "version, state, fingerprint, expiry, token, response")

	// Extend moves the lease's end and the native expiry.
	c2 := claim("k2", "t2", time.Minute)
	res, err = f.store.Claim(ctx, c2)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	end := time.Now().Add(time.Hour)
	require.NoError(t, f.store.Extend(ctx, c2.Key, c2.Token, end))
	pttl, err = f.client.PTTL(ctx, f.prefix+"{:k2}").Result()
	require.NoError(t, err)
	assert.Greater(t, pttl, redisstore.LeaseMargin+time.Hour-10*time.Second, "PTTL after Extend")
	v, err = f.client.Get(ctx, f.prefix+"{:k2}").Bytes()
	require.NoError(t, err)
	assert.Equal(t, uint64(end.UnixMicro()), binary.BigEndian.Uint64(v[34:42]), "the lease's end")
	assert.Len(t, v, 44+2, "nothing else changed length")
}

func TestTimesClamped(t *testing.T) {
	// time.Time saturates far from now (the middleware's expiry of a
	// record kept for a TTL of centuries): the record's time and its
	// native expiry are clamped, never wrapped round to the past.
	f := newFixture(t)
	ctx := t.Context()
	c := claim("k", "t", time.Minute)
	mustClaim(t, f.store, c)
	forever := time.Now().Add(math.MaxInt64)
	require.NoError(t, f.store.Complete(ctx, c.Key, c.Token, &idemserver.Response{Status: 200}, forever))
	pttl, err := f.client.PTTL(ctx, f.redisKey()).Result()
	require.NoError(t, err)
	assert.Greater(t, pttl, 200*365*24*time.Hour, "kept for centuries")
	res, err := f.store.Claim(ctx, claim("k", "u", time.Minute))
	require.NoError(t, err)
	require.True(t, res.Record.Completed())
	assert.Equal(t, int64(1<<53-1), res.Record.Expires.UnixMicro(), "the latest time the record holds")

	// So with a lease without end: the margin added to it does not wrap
	// round to a native expiry of a millisecond.
	for _, name := range []string{"claimed", "extended"} {
		c := claim(name, "t", time.Minute)
		if name == "claimed" {
			c.LeaseExpires = c.Now.Add(math.MaxInt64)
		}
		mustClaim(t, f.store, c)
		if name == "extended" {
			require.NoError(t, f.store.Extend(ctx, c.Key, c.Token, forever))
		}
		pttl, err := f.client.PTTL(ctx, f.prefix+"{:"+name+"}").Result()
		require.NoError(t, err)
		assert.Greater(t, pttl, 200*365*24*time.Hour, "%s: kept for centuries", name)
	}
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
	// Records hold the middleware's instants, and Complete and Extend turn
	// them into Redis's native expiry (a duration) with the clock the store
	// is given, so a middleware clock far from the real one keeps records
	// for the TTL it meant, and its claims judge them by its own time.
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

// recordValue returns a record value in the store's layout: version 1
// unless version is set.
func recordValue(version byte, state byte, token string, rest string) string {
	fp := sha256.Sum256([]byte("request"))
	b := []byte{version, state}
	b = append(b, fp[:]...)
	b = binary.BigEndian.AppendUint64(b, uint64(time.Now().Add(time.Hour).UnixMicro()))
	b = binary.BigEndian.AppendUint16(b, uint16(len(token)))
	b = append(b, token...)
	return string(append(b, rest...))
}

func TestBadRecords(t *testing.T) {
	// What the store did not write, or a later release wrote, is an error,
	// never a claim or a replay; through the middleware it is a 503, and
	// the handler does not run. The scripts leave such a record alone.
	set := func(v string) func(ctx context.Context, c *redis.Client, key string) error {
		return func(ctx context.Context, c *redis.Client, key string) error {
			return c.Set(ctx, key, v, time.Hour).Err()
		}
	}
	ok := string(respcodec.Encode(&idemserver.Response{Status: http.StatusCreated}))
	for _, tt := range []struct {
		name  string
		setup func(ctx context.Context, c *redis.Client, key string) error
		is    error
	}{
		{"not a string", func(ctx context.Context, c *redis.Client, key string) error {
			return c.HSet(ctx, key, "f", strings.Repeat("f", 32)).Err()
		}, nil},
		{"later layout version", set(recordValue(2, 'c', "t", ok)), redisstore.ErrUnknownVersion},
		{"later layout version, short", set("\x02"), redisstore.ErrUnknownVersion},
		{"unknown state", set(recordValue(1, 'x', "t", ok)), redisstore.ErrUnexpectedReply},
		{"short record", set("\x01p"), redisstore.ErrUnexpectedReply},
		{"token past the end", set(recordValue(1, 'p', "token", "")[:48]), redisstore.ErrUnexpectedReply},
		{"in progress, with bytes after the token", set(recordValue(1, 'p', "t", "x")), redisstore.ErrUnexpectedReply},
		{"completed, without a response", set(recordValue(1, 'c', "t", "")), redisstore.ErrUnexpectedReply},
		{"response of a later version", set(recordValue(1, 'c', "t", "\x02later")), respcodec.ErrUnknownVersion},
		{"damaged response", set(recordValue(1, 'c', "t", "\x01")), respcodec.ErrCorrupt},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t)
			key := f.prefix + "{:k}"
			require.NoError(t, tt.setup(t.Context(), f.client, key))
			dump := func() string {
				d, err := f.client.Dump(t.Context(), key).Result()
				require.NoError(t, err)
				return d
			}
			before := dump()
			_, err := f.store.Claim(t.Context(), claim("k", "t", time.Minute))
			require.Error(t, err)
			if tt.is != nil {
				assert.ErrorIs(t, err, tt.is)
			} else {
				assert.ErrorContains(t, err, "WRONGTYPE", "Redis's error for a key of another type")
			}
			// The scripts refuse it too, for whatever token, and change
			// nothing.
			ctx := t.Context()
			k := idemserver.Key{Key: "k"}
			for name, err := range map[string]error{
				"TakeOver": func() error { _, err := f.store.TakeOver(ctx, claim("k", "u", time.Minute), "t"); return err }(),
				"Complete": f.store.Complete(ctx, k, "t", &idemserver.Response{Status: 200}, time.Now().Add(time.Hour)),
				"Release":  f.store.Release(ctx, k, "t"),
				"Extend":   f.store.Extend(ctx, k, "t", time.Now().Add(time.Hour)),
			} {
				switch tt.is {
				case redisstore.ErrUnknownVersion, redisstore.ErrUnexpectedReply:
					assert.ErrorIs(t, err, tt.is, name)
				case nil:
					assert.Error(t, err, name)
				default:
					// A completed record of this layout whose response is
					// not readable: a takeover finds it and fails as the
					// claim does; its lease is no one's.
					if name == "TakeOver" {
						assert.ErrorIs(t, err, tt.is, name)
					} else {
						assert.ErrorIs(t, err, idemserver.ErrLeaseLost, name)
					}
					continue
				}
				assert.NotErrorIs(t, err, idemserver.ErrLeaseLost, name)
			}
			assert.Equal(t, before, dump(), "the record is unchanged")

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
			assert.Equal(t, before, dump(), "the record is unchanged")
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

func TestJudgedByTheClaimsClock(t *testing.T) {
	// Leases and expiry are judged by the middleware's clock, the Now of
	// each claim: a takeover at a Now before the lease's end takes
	// nothing, one at a Now after it takes the key, unless Redis says the
	// lease has much longer to run. The store is given the middleware's
	// clock, as it must be.
	var clock time.Time
	f := newFixture(t, redisstore.WithClock(func() time.Time { return clock }))
	ctx := t.Context()
	holder := claim("k", "holder", time.Hour)
	clock = holder.Now
	mustClaim(t, f.store, holder)

	early := claim("k", "early", time.Minute)
	early.Now = holder.LeaseExpires.Add(-time.Microsecond)
	clock = early.Now
	res, err := f.store.TakeOver(ctx, early, holder.Token)
	require.NoError(t, err)
	assert.False(t, res.Claimed, "the lease has not ended at the takeover's Now")
	assert.Equal(t, holder.Token, res.Record.Token)
	assert.WithinDuration(t, holder.LeaseExpires, res.Record.LeaseExpires, time.Microsecond)

	// A takeover at a Now after the lease's end, an hour before Redis
	// would let the record expire, finds the clocks disagree: the claim's
	// is ahead of the holder's, whose handler may still run.
	late := claim("k", "late", time.Minute)
	late.Now = holder.LeaseExpires
	late.LeaseExpires = late.Now.Add(time.Minute)
	clock = late.Now
	_, err = f.store.TakeOver(ctx, late, holder.Token)
	require.ErrorIs(t, err, redisstore.ErrClocksDisagree)

	// Once Redis agrees that the lease has ended, within the allowance
	// for clocks, the takeover's Now decides: here, after the holder
	// extended its lease to end a second from now, one at a Now a second
	// later takes the key, as Redis still keeps the record LeaseMargin.
	clock = time.Now()
	require.NoError(t, f.store.Extend(ctx, holder.Key, holder.Token, clock.Add(time.Second)))
	late = claim("k", "late", time.Minute)
	late.Now = clock.Add(time.Second)
	late.LeaseExpires = late.Now.Add(time.Minute)
	clock = late.Now
	res, err = f.store.TakeOver(ctx, late, holder.Token)
	require.NoError(t, err)
	assert.True(t, res.Claimed, "the lease has ended at the takeover's Now")
	assert.ErrorIs(t, f.store.Complete(ctx, holder.Key, holder.Token, &idemserver.Response{Status: 200}, time.Now().Add(time.Hour)),
		idemserver.ErrLeaseLost)
}

func TestHolderCompletesAfterItsLeaseEnded(t *testing.T) {
	// A holder whose lease ended, and that no one took over, still
	// extends and completes its claim: the record stays in Redis
	// LeaseMargin past its lease's end. Otherwise a retry would run the
	// handler a second time.
	f := newFixture(t)
	ctx := t.Context()
	c := claim("k", "holder", time.Millisecond)
	mustClaim(t, f.store, c)
	waitLeaseEnded(t, f.store, c)
	pttl, err := f.client.PTTL(ctx, f.redisKey()).Result()
	require.NoError(t, err)
	assert.Greater(t, pttl, redisstore.LeaseMargin-10*time.Second, "the ended lease stays visible")
	require.NoError(t, f.store.Complete(ctx, c.Key, c.Token, &idemserver.Response{Status: http.StatusCreated}, time.Now().Add(time.Hour)))
	res, err := f.store.Claim(ctx, claim("k", "retry", time.Minute))
	require.NoError(t, err)
	require.True(t, res.Record.Completed(), "the retry replays")
}

func TestPackedStore(t *testing.T) {
	// ClaimPacked and CompletePacked store and return what Claim and
	// Complete do, in the packed form; NewToken makes the token of a
	// claim, called once.
	f := newFixture(t)
	ctx := t.Context()
	var store idemserver.PackedStore = f.store
	tokens := 0
	newToken := func() string {
		tokens++
		return "made-" + strconv.Itoa(tokens)
	}
	c := claim("k", "", time.Minute)
	res, err := store.ClaimPacked(ctx, idemserver.PackedClaim{Claim: c, NewToken: newToken})
	require.NoError(t, err)
	require.True(t, res.Claimed)
	assert.Equal(t, "made-1", res.Token)
	assert.Equal(t, 1, tokens)

	resp := &idemserver.Response{
		Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}, "Link": {"</a>", "</b>"}},
		Body:   []byte(`{"id":1}`),
	}
	expires := time.Now().Add(time.Hour)
	require.NoError(t, store.CompletePacked(ctx, idemserver.PackedCompletion{
		Key: c.Key, Token: res.Token, Response: idemserver.PackResponse(resp), Now: time.Now(), Expires: expires,
	}))
	v, err := f.client.Get(ctx, f.redisKey()).Bytes()
	require.NoError(t, err)
	stored, err := respcodec.Decode(v[44+len(res.Token):])
	require.NoError(t, err, "the response in respcodec's encoding")
	assert.Equal(t, resp, stored)

	res, err = store.ClaimPacked(ctx, idemserver.PackedClaim{Claim: claim("k", "", time.Minute), NewToken: newToken})
	require.NoError(t, err)
	assert.False(t, res.Claimed)
	assert.Nil(t, res.Record.Response)
	assert.Equal(t, c.Fingerprint, res.Record.Fingerprint)
	assert.WithinDuration(t, expires, res.Record.Expires, time.Microsecond)
	require.False(t, res.Response.IsZero())
	assert.Equal(t, resp, res.Response.Response())
	plain, err := f.store.Claim(ctx, claim("k", "t", time.Minute))
	require.NoError(t, err)
	assert.Equal(t, resp, plain.Record.Response, "Claim reads what CompletePacked wrote")

	// A takeover through ClaimPacked.
	dead := claim("dead", "dead", time.Millisecond)
	mustClaim(t, f.store, dead)
	waitLeaseEnded(t, f.store, dead)
	res, err = store.ClaimPacked(ctx, idemserver.PackedClaim{Claim: claim("dead", "", time.Minute), NewToken: newToken,
		TakeOver: true, ExpiredToken: dead.Token})
	require.NoError(t, err)
	assert.True(t, res.Claimed)
	assert.Equal(t, "made-"+strconv.Itoa(tokens), res.Token)
	assert.ErrorIs(t, f.store.Release(ctx, dead.Key, dead.Token), idemserver.ErrLeaseLost)
	require.NoError(t, f.store.Release(ctx, dead.Key, res.Token))
}

func TestLongToken(t *testing.T) {
	// The layout holds a token of up to 65535 bytes; a longer one is
	// refused before anything is written.
	f := newFixture(t)
	long := strings.Repeat("t", 1<<16)
	_, err := f.store.Claim(t.Context(), claim("k", long, time.Minute))
	require.Error(t, err)
	keys, err := f.client.Keys(t.Context(), f.prefix+"*").Result()
	require.NoError(t, err)
	assert.Empty(t, keys)
	c := claim("k", long[:1<<16-1], time.Minute)
	mustClaim(t, f.store, c)
	require.NoError(t, f.store.Complete(t.Context(), c.Key, c.Token, &idemserver.Response{Status: 200}, time.Now().Add(time.Hour)))
}
