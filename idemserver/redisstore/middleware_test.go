package redisstore_test

import (
	"bytes"
	"fmt"
	"io"
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

// reply is a response read whole.
type reply struct {
	status int
	header http.Header
	body   []byte
}

// post sends a keyed POST to url and reads the response.
func post(client *http.Client, url, key, body string) (reply, error) {
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	req.Header.Set(idemserver.DefaultKeyHeader, key)
	resp, err := client.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: b}, err
}

func mustPost(t *testing.T, srv *httptest.Server, key, body string) reply {
	t.Helper()
	r, err := post(srv.Client(), srv.URL, key, body)
	require.NoError(t, err)
	return r
}

// created answers 201 with a body that names the run.
func created(run int64, w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/plain")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, "run %d", run)
}

// counted is a server with the middleware over a store whose round trips
// are counted. Its handler answers 201, or 500 to a request with X-Fail.
type counted struct {
	rt     *counter
	c      *redis.Client
	store  *redisstore.Store
	prefix string
	srv    *httptest.Server
	runs   atomic.Int64
}

func newCounted(t *testing.T) *counted {
	x := &counted{rt: new(counter)}
	x.c = newClient(t, x.rt)
	x.prefix = newPrefix(t, x.c)
	x.store = redisstore.New(x.c, redisstore.WithPrefix(x.prefix))
	x.srv = httptest.NewServer(idemserver.Middleware(x.store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Fail") != "" {
			http.Error(w, "failed", http.StatusInternalServerError)
			return
		}
		created(x.runs.Add(1), w)
	})))
	t.Cleanup(x.srv.Close)
	return x
}

func TestRoundTrips(t *testing.T) {
	// Each path of the middleware costs one round trip per store call.
	x := newCounted(t)
	rt, store, srv := x.rt, x.store, x.srv
	// The first call of each script on a server costs one more round trip
	// (EVALSHA answered NOSCRIPT, then EVAL, which loads it): call each
	// once. A claim is no script (SET NX GET).
	warm(t, store)
	rt.take()

	first := mustPost(t, srv, "k", "b")
	require.Equal(t, http.StatusCreated, first.status)
	assert.EqualValues(t, 2, rt.take(), "new key: claim and complete")
	for range 3 {
		r := mustPost(t, srv, "k", "b")
		require.Equal(t, "true", r.header.Get(idemserver.ReplayedHeader))
		assert.EqualValues(t, 1, rt.take(), "replay: the claim")
	}
	assert.Equal(t, http.StatusUnprocessableEntity, mustPost(t, srv, "k", "other").status)
	assert.EqualValues(t, 1, rt.take(), "mismatch: the claim")

	// And each call of the store on its own.
	ctx := t.Context()
	cl := claim("direct", "t1", time.Minute)
	for _, tt := range []struct {
		name string
		do   func() error
	}{
		{"Claim", func() error { _, err := store.Claim(ctx, cl); return err }},
		{"Claim of an in-progress key", func() error { _, err := store.Claim(ctx, claim("direct", "t2", time.Minute)); return err }},
		{"Extend", func() error { return store.Extend(ctx, cl.Key, cl.Token, time.Now().Add(time.Hour)) }},
		{"TakeOver", func() error { _, err := store.TakeOver(ctx, claim("direct", "t3", time.Minute), cl.Token); return err }},
		{"Complete", func() error {
			return store.Complete(ctx, cl.Key, cl.Token, &idemserver.Response{Status: 200}, time.Now().Add(time.Hour))
		}},
		{"Claim of a completed key", func() error { _, err := store.Claim(ctx, claim("direct", "t4", time.Minute)); return err }},
		{"ClaimPacked of a completed key", func() error {
			_, err := store.ClaimPacked(ctx, idemserver.PackedClaim{Claim: claim("direct", "t6", time.Minute)})
			return err
		}},
		{"Release", func() error {
			_, err := store.Claim(ctx, claim("released", "t5", time.Minute))
			require.NoError(t, err)
			rt.take()
			return store.Release(ctx, idemserver.Key{Key: "released"}, "t5")
		}},
	} {
		require.NoError(t, tt.do(), tt.name)
		assert.EqualValues(t, 1, rt.take(), tt.name)
	}

	// A completed record that has expired by the claim's clock but not in
	// Redis (another instance's clock is a little ahead) takes a second:
	// the takeover script replaces it. Complete, without the middleware's
	// time, gives it MaxClockSkew more in Redis: 9 s, less than the claim's
	// clock may be behind Redis.
	brief := claim("brief", "b1", time.Minute)
	mustClaim(t, store, brief)
	require.NoError(t, store.Complete(ctx, brief.Key, brief.Token, &idemserver.Response{Status: 200}, time.Now().Add(4*time.Second)))
	rt.take()
	later := claim("brief", "t7", time.Minute)
	later.Now = later.Now.Add(5 * time.Second)
	later.LeaseExpires = later.Now.Add(time.Minute)
	ahead := aheadOf(x.c, x.prefix, 5*time.Second)
	// A new store's first claim reads Redis's eviction settings (INFO):
	// make it first.
	warmUp := claim("ahead-first", "t8", time.Minute)
	warmUp.Now, warmUp.LeaseExpires = later.Now, later.LeaseExpires
	_, err := ahead.Claim(ctx, warmUp)
	require.NoError(t, err)
	assert.EqualValues(t, 2, rt.take(), "a store's first claim: INFO memory, and the claim")
	res, err := ahead.Claim(ctx, later)
	require.NoError(t, err)
	assert.True(t, res.Claimed, "an expired record counts as absent")
	assert.EqualValues(t, 2, rt.take(), "Claim of a record expired by the claim's clock")
}

// warm calls every method of store once, so that Redis has its scripts.
func warm(t *testing.T, store idemserver.Store) {
	ctx := t.Context()
	cl := claim("warm", "warm1", time.Minute)
	_, err := store.Claim(ctx, cl)
	require.NoError(t, err)
	require.NoError(t, store.Extend(ctx, cl.Key, cl.Token, time.Now().Add(time.Minute)))
	require.NoError(t, store.Release(ctx, cl.Key, cl.Token))
	cl.Token = "warm2"
	_, err = store.Claim(ctx, cl)
	require.NoError(t, err)
	require.NoError(t, store.Complete(ctx, cl.Key, cl.Token, &idemserver.Response{Status: 200}, time.Now().Add(time.Minute)))
	taker := claim("warm-taken", "warm3", time.Minute)
	res, err := store.TakeOver(ctx, taker, "none")
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.NoError(t, store.Release(ctx, taker.Key, taker.Token))
}

func TestScriptFlush(t *testing.T) {
	// With the script cache flushed, each script costs one more round trip
	// (EVALSHA answered NOSCRIPT, then EVAL, which loads it again) and
	// then one again. A claim, and so a replay, is no script.
	x := newCounted(t)
	rt, c, store, srv := x.rt, x.c, x.store, x.srv
	require.Equal(t, http.StatusCreated, mustPost(t, srv, "before", "b").status)

	flush := func() {
		require.NoError(t, c.ScriptFlush(t.Context()).Err())
		rt.take()
	}
	flush()
	first := mustPost(t, srv, "k", "b")
	require.Equal(t, http.StatusCreated, first.status)
	assert.EqualValues(t, 3, rt.take(), "claim, and complete reloaded")
	r := mustPost(t, srv, "k", "b")
	assert.Equal(t, first.body, r.body)
	assert.Equal(t, "true", r.header.Get(idemserver.ReplayedHeader))
	assert.EqualValues(t, 1, rt.take(), "replay")

	flush()
	r = mustPost(t, srv, "before", "b")
	assert.Equal(t, "run 1", string(r.body), "a replay after a flush")
	assert.EqualValues(t, 1, rt.take(), "a replay needs no script")

	// Release and Extend reload their scripts too.
	flush()
	req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("b"))
	require.NoError(t, err)
	req.Header.Set(idemserver.DefaultKeyHeader, "failing")
	req.Header.Set("X-Fail", "1")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
	assert.EqualValues(t, 3, rt.take(), "claim, and release reloaded")
	require.Equal(t, http.StatusCreated, mustPost(t, srv, "failing", "b").status, "released")
	rt.take()

	flush()
	cl := claim("extended", "t", time.Minute)
	res, err := store.Claim(t.Context(), cl)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	rt.take()
	require.NoError(t, store.Extend(t.Context(), cl.Key, cl.Token, time.Now().Add(time.Hour)))
	assert.EqualValues(t, 2, rt.take(), "extend reloaded")

	flush()
	res, err = store.TakeOver(t.Context(), claim("taken", "t2", time.Minute), "gone")
	require.NoError(t, err)
	require.True(t, res.Claimed)
	assert.EqualValues(t, 2, rt.take(), "takeover reloaded")
	assert.Equal(t, int64(3), x.runs.Load())
}

func TestTwoInstances(t *testing.T) {
	// Two middleware instances, each with a client of its own, share one
	// Redis: of 200 concurrent duplicates spread across them, one runs the
	// handler; the others are told it is in progress.
	const n = 200
	addr := redisAddr(t)
	prefix := newPrefix(t, newClient(t))
	var runs atomic.Int64
	release := make(chan struct{})
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run := runs.Add(1)
		if run == 1 {
			<-release
		}
		created(run, w)
	})
	servers := make([]*httptest.Server, 2)
	for i := range servers {
		store := redisstore.New(clientOf(t, addr), redisstore.WithPrefix(prefix))
		servers[i] = httptest.NewServer(idemserver.Middleware(store)(handler))
		defer servers[i].Close()
		servers[i].Client().Transport.(*http.Transport).MaxIdleConnsPerHost = n
	}

	replies := make([]reply, n)
	errs := make([]error, n)
	var answered atomic.Int64
	othersAnswered := make(chan struct{})
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			s := servers[i%2]
			replies[i], errs[i] = post(s.Client(), s.URL, "k", `{"amount":1}`)
			if answered.Add(1) == n-1 {
				close(othersAnswered)
			}
		})
	}
	close(start)
	// The first to claim holds its handler until every other request has
	// its answer, so that all of them meet it in progress.
	select {
	case <-othersAnswered:
	case <-time.After(time.Minute):
		t.Error("the duplicates got no answer")
	}
	close(release)
	wg.Wait()

	assert.EqualValues(t, 1, runs.Load(), "handler runs")
	var first []byte
	statuses := map[int]int{}
	for i, r := range replies {
		require.NoError(t, errs[i])
		statuses[r.status]++
		if r.status == http.StatusCreated {
			first = r.body
		}
	}
	assert.Equal(t, map[int]int{http.StatusCreated: 1, http.StatusConflict: n - 1}, statuses)
	assert.Equal(t, "run 1", string(first))
	// Both instances now replay it.
	for _, s := range servers {
		r := mustPost(t, s, "k", `{"amount":1}`)
		assert.Equal(t, "true", r.header.Get(idemserver.ReplayedHeader))
		assert.True(t, bytes.Equal(first, r.body))
	}
	assert.EqualValues(t, 1, runs.Load(), "handler runs")
}

// aheadOf returns a store of the records under prefix, as another
// instance sees them whose clock is d ahead.
func aheadOf(c redis.UniversalClient, prefix string, d time.Duration) *redisstore.Store {
	return redisstore.New(c, redisstore.WithPrefix(prefix), redisstore.WithClock(func() time.Time { return time.Now().Add(d) }))
}
