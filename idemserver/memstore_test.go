package idemserver

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testClaim(key string, now time.Time) Claim {
	return Claim{Key: Key{Key: key}, Token: "token-" + key, Now: now, LeaseExpires: now.Add(time.Minute), ReportEvictions: true}
}

func TestMemoryStoreLifecycle(t *testing.T) {
	ctx := t.Context()
	now := newFakeClock().Now()
	for _, tt := range []struct {
		name string
		run  func(t *testing.T, s *MemoryStore)
	}{
		{"claim, then the key is in progress", func(t *testing.T, s *MemoryStore) {
			c := testClaim("k", now)
			res, err := s.Claim(ctx, c)
			require.NoError(t, err)
			assert.True(t, res.Claimed)
			res, err = s.Claim(ctx, Claim{Key: c.Key, Token: "other", Now: now})
			require.NoError(t, err)
			assert.False(t, res.Claimed)
			assert.False(t, res.Record.Completed())
			assert.Equal(t, c.Token, res.Record.Token)
			assert.Equal(t, c.LeaseExpires, res.Record.LeaseExpires)
		}},
		{"complete, then the key replays", func(t *testing.T, s *MemoryStore) {
			c := testClaim("k", now)
			_, _ = s.Claim(ctx, c)
			resp := &Response{Status: 201, Body: []byte("x")}
			require.NoError(t, s.Complete(ctx, c.Key, c.Token, resp, now.Add(time.Hour)))
			res, err := s.Claim(ctx, Claim{Key: c.Key, Token: "other", Now: now.Add(time.Hour - 1)})
			require.NoError(t, err)
			assert.False(t, res.Claimed)
			assert.Equal(t, resp, res.Record.Response)
			assert.NoError(t, s.Complete(ctx, c.Key, c.Token, resp, now.Add(time.Hour)), "the same completion sent again")
			assert.ErrorIs(t, s.Complete(ctx, c.Key, c.Token, &Response{Status: 201, Body: []byte("y")}, now), ErrLeaseLost, "completing twice")
			assert.ErrorIs(t, s.Release(ctx, c.Key, c.Token), ErrLeaseLost, "releasing a completed key")
		}},
		{"expired record counts as absent", func(t *testing.T, s *MemoryStore) {
			c := testClaim("k", now)
			_, _ = s.Claim(ctx, c)
			require.NoError(t, s.Complete(ctx, c.Key, c.Token, &Response{Status: 200}, now.Add(time.Hour)))
			res, err := s.Claim(ctx, testClaim("k", now.Add(time.Hour)))
			require.NoError(t, err)
			assert.True(t, res.Claimed)
		}},
		{"release, then the key is free", func(t *testing.T, s *MemoryStore) {
			c := testClaim("k", now)
			_, _ = s.Claim(ctx, c)
			assert.ErrorIs(t, s.Release(ctx, c.Key, "wrong"), ErrLeaseLost)
			require.NoError(t, s.Release(ctx, c.Key, c.Token))
			assert.ErrorIs(t, s.Release(ctx, c.Key, c.Token), ErrLeaseLost)
			res, err := s.Claim(ctx, c)
			require.NoError(t, err)
			assert.True(t, res.Claimed)
		}},
		{"complete with a wrong token", func(t *testing.T, s *MemoryStore) {
			c := testClaim("k", now)
			_, _ = s.Claim(ctx, c)
			assert.ErrorIs(t, s.Complete(ctx, c.Key, "wrong", &Response{}, now), ErrLeaseLost)
			assert.ErrorIs(t, s.Complete(ctx, Key{Key: "absent"}, c.Token, &Response{}, now), ErrLeaseLost)
		}},
		{"takeover is a compare-and-set on the token", func(t *testing.T, s *MemoryStore) {
			c := testClaim("k", now)
			_, _ = s.Claim(ctx, c)
			res, err := s.TakeOver(ctx, Claim{Key: c.Key, Token: "late", Now: now}, "not-the-token")
			require.NoError(t, err)
			assert.False(t, res.Claimed)
			assert.Equal(t, c.Token, res.Record.Token)
			ended := c.LeaseExpires
			res, err = s.TakeOver(ctx, Claim{Key: c.Key, Token: "new", Now: ended, LeaseExpires: ended.Add(time.Minute)}, c.Token)
			require.NoError(t, err)
			assert.True(t, res.Claimed)
			res, err = s.TakeOver(ctx, Claim{Key: c.Key, Token: "newer", Now: ended.Add(time.Hour)}, c.Token)
			require.NoError(t, err)
			assert.False(t, res.Claimed, "a second takeover of the same lease")
			assert.ErrorIs(t, s.Complete(ctx, c.Key, c.Token, &Response{}, now), ErrLeaseLost)
			assert.NoError(t, s.Complete(ctx, c.Key, "new", &Response{}, now.Add(time.Hour)))
		}},
		{"extend moves the lease while the token holds", func(t *testing.T, s *MemoryStore) {
			c := testClaim("k", now)
			_, _ = s.Claim(ctx, c)
			later := c.LeaseExpires.Add(time.Hour)
			require.NoError(t, s.Extend(ctx, c.Key, c.Token, later))
			res, err := s.Claim(ctx, Claim{Key: c.Key, Token: "other", Now: now})
			require.NoError(t, err)
			assert.Equal(t, later, res.Record.LeaseExpires)
			assert.ErrorIs(t, s.Extend(ctx, c.Key, "wrong", later), ErrLeaseLost)
			assert.ErrorIs(t, s.Extend(ctx, Key{Key: "absent"}, c.Token, later), ErrLeaseLost)
			require.NoError(t, s.Complete(ctx, c.Key, c.Token, &Response{Status: 200}, now.Add(time.Hour)))
			assert.ErrorIs(t, s.Extend(ctx, c.Key, c.Token, later), ErrLeaseLost, "a completed record has no lease")
		}},
		{"takeover never replaces a lease that has not ended", func(t *testing.T, s *MemoryStore) {
			c := testClaim("k", now)
			_, _ = s.Claim(ctx, c)
			ended := c.LeaseExpires
			// A duplicate saw the lease ended at ended; the holder's
			// extension lands before the duplicate's takeover.
			require.NoError(t, s.Extend(ctx, c.Key, c.Token, ended.Add(time.Minute)))
			res, err := s.TakeOver(ctx, Claim{Key: c.Key, Token: "new", Now: ended}, c.Token)
			require.NoError(t, err)
			assert.False(t, res.Claimed, "the lease was extended")
			assert.Equal(t, c.Token, res.Record.Token)
			assert.Equal(t, ended.Add(time.Minute), res.Record.LeaseExpires)
			assert.NoError(t, s.Extend(ctx, c.Key, c.Token, ended.Add(2*time.Minute)), "the holder keeps its lease")
		}},
		{"takeover of an absent key claims it", func(t *testing.T, s *MemoryStore) {
			res, err := s.TakeOver(ctx, testClaim("k", now), "gone")
			require.NoError(t, err)
			assert.True(t, res.Claimed)
		}},
		{"takeover never replaces a completed record", func(t *testing.T, s *MemoryStore) {
			c := testClaim("k", now)
			_, _ = s.Claim(ctx, c)
			require.NoError(t, s.Complete(ctx, c.Key, c.Token, &Response{Status: 200}, now.Add(time.Hour)))
			res, err := s.TakeOver(ctx, Claim{Key: c.Key, Token: "new", Now: now}, c.Token)
			require.NoError(t, err)
			assert.False(t, res.Claimed)
			assert.True(t, res.Record.Completed())
		}},
		{"scopes are separate", func(t *testing.T, s *MemoryStore) {
			a := Claim{Key: Key{Scope: "a", Key: "k"}, Token: "a", Now: now}
			b := Claim{Key: Key{Scope: "b", Key: "k"}, Token: "b", Now: now}
			ra, err := s.Claim(ctx, a)
			require.NoError(t, err)
			rb, err := s.Claim(ctx, b)
			require.NoError(t, err)
			assert.True(t, ra.Claimed)
			assert.True(t, rb.Claimed)
		}},
		{"ended context", func(t *testing.T, s *MemoryStore) {
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			_, err := s.Claim(cctx, testClaim("k", now))
			assert.ErrorIs(t, err, context.Canceled)
			assert.Zero(t, s.Len())
		}},
		{"closed", func(t *testing.T, s *MemoryStore) {
			c := testClaim("k", now)
			_, _ = s.Claim(ctx, c)
			require.NoError(t, s.Close())
			assert.Zero(t, s.Len())
			_, err := s.Claim(ctx, c)
			assert.ErrorIs(t, err, ErrClosed)
			_, err = s.TakeOver(ctx, c, c.Token)
			assert.ErrorIs(t, err, ErrClosed)
			assert.ErrorIs(t, s.Complete(ctx, c.Key, c.Token, &Response{}, now), ErrClosed)
			assert.ErrorIs(t, s.Release(ctx, c.Key, c.Token), ErrClosed)
			assert.ErrorIs(t, s.Extend(ctx, c.Key, c.Token, now), ErrClosed)
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Run("new", func(t *testing.T) { tt.run(t, NewMemoryStore()) })
			t.Run("zero value", func(t *testing.T) { tt.run(t, &MemoryStore{}) })
		})
	}
}

func TestMemoryStoreEviction(t *testing.T) {
	ctx := t.Context()
	now := newFakeClock().Now()
	// complete claims key at now and completes it at completed with a body
	// of size bytes, to expire at expires.
	complete := func(t *testing.T, s *MemoryStore, key string, completed, expires time.Time, size int) {
		t.Helper()
		c := testClaim(key, now)
		res, err := s.Claim(ctx, c)
		require.NoError(t, err)
		require.True(t, res.Claimed)
		require.NoError(t, s.CompletePacked(ctx, PackedCompletion{
			Key: c.Key, Token: c.Token, Now: completed, Expires: expires,
			Response: PackResponse(&Response{Status: 200, Body: bytes.Repeat([]byte("x"), size)}),
		}))
	}
	present := func(s *MemoryStore, key string) bool {
		sh, h := s.locate(Key{Key: key})
		sh.mu.Lock()
		defer sh.mu.Unlock()
		return sh.find(h, Key{Key: key}) != none
	}
	// claim claims key at, and fails the test unless it is claimed.
	claim := func(t *testing.T, s *MemoryStore, key string, at time.Time) ClaimResult {
		t.Helper()
		res, err := s.Claim(ctx, testClaim(key, at))
		require.NoError(t, err)
		require.True(t, res.Claimed)
		return res
	}
	// One shard of three records makes the order of eviction visible.
	three := []MemoryOption{WithShards(1), WithMaxEntries(3)}
	for _, tt := range []struct {
		name string
		opts []MemoryOption
		run  func(t *testing.T, s *MemoryStore)
	}{
		{"expired records go first, all of them", three, func(t *testing.T, s *MemoryStore) {
			complete(t, s, "a", now, now.Add(time.Minute), 0)
			complete(t, s, "b", now, now.Add(2*time.Minute), 0)
			complete(t, s, "c", now, now.Add(time.Hour), 0)
			res := claim(t, s, "d", now.Add(3*time.Minute))
			assert.Empty(t, res.Evictions)
			assert.False(t, present(s, "a"))
			assert.False(t, present(s, "b"))
			assert.True(t, present(s, "c"))
			assert.Equal(t, 2, s.Len())
		}},
		{"expired records go first, wherever they are", three, func(t *testing.T, s *MemoryStore) {
			// Two middlewares with different TTLs share the store: the
			// long-TTL record completed first and is still live when the
			// short-TTL ones behind it have expired.
			complete(t, s, "long", now, now.Add(24*time.Hour), 0)
			complete(t, s, "short1", now, now.Add(time.Minute), 0)
			complete(t, s, "short2", now, now.Add(time.Minute), 0)
			claim(t, s, "new", now.Add(time.Hour))
			assert.True(t, present(s, "long"), "a live record was dropped while expired ones were held")
			assert.False(t, present(s, "short1"))
			assert.False(t, present(s, "short2"))
		}},
		{"a store full of live records refuses new keys", three, func(t *testing.T, s *MemoryStore) {
			complete(t, s, "a", now, now.Add(time.Hour), 0)
			complete(t, s, "b", now, now.Add(time.Hour), 0)
			_, err := s.Claim(ctx, testClaim("c", now)) // in progress
			require.NoError(t, err)
			_, err = s.Claim(ctx, testClaim("d", now.Add(time.Minute)))
			require.ErrorIs(t, err, ErrStoreFull)
			for _, key := range []string{"a", "b", "c"} {
				assert.True(t, present(s, key), key)
			}
			// Once a record expires, there is room again.
			claim(t, s, "d", now.Add(time.Hour))
			assert.False(t, present(s, "a"))
		}},
		{"in progress is never evicted", append(three, WithEvictOldest()), func(t *testing.T, s *MemoryStore) {
			for _, key := range []string{"a", "b", "c"} {
				claim(t, s, key, now)
			}
			_, err := s.Claim(ctx, testClaim("d", now.Add(time.Hour)))
			assert.ErrorIs(t, err, ErrStoreFull)
			assert.Equal(t, 3, s.Len())
			// Releasing one makes room again.
			require.NoError(t, s.Release(ctx, Key{Key: "a"}, "token-a"))
			claim(t, s, "d", now)
		}},
		{"opted in, the records that expire soonest are evicted and reported", append(three, WithEvictOldest()), func(t *testing.T, s *MemoryStore) {
			complete(t, s, "late", now.Add(time.Minute), now.Add(48*time.Hour), 0)
			complete(t, s, "soon", now.Add(2*time.Minute), now.Add(time.Hour), 0)
			_, err := s.Claim(ctx, testClaim("busy", now)) // in progress
			require.NoError(t, err)
			res := claim(t, s, "new", now.Add(10*time.Minute))
			assert.Equal(t, []Eviction{{Key: Key{Key: "soon"}, Age: 8 * time.Minute}}, res.Evictions)
			res = claim(t, s, "newer", now.Add(20*time.Minute))
			assert.Equal(t, []Eviction{{Key: Key{Key: "late"}, Age: 19 * time.Minute}}, res.Evictions)
			assert.True(t, present(s, "busy"), "in progress is kept")
			assert.Equal(t, 3, s.Len())
		}},
		{"bounded in bytes", []MemoryOption{WithShards(1), WithMaxBytes(2400)}, func(t *testing.T, s *MemoryStore) {
			complete(t, s, "a", now, now.Add(time.Hour), 1000)
			complete(t, s, "b", now, now.Add(time.Hour), 1000)
			assert.Equal(t, 2, s.Len())
			_, err := s.Claim(ctx, testClaim("c", now))
			require.ErrorIs(t, err, ErrStoreFull, "2 × 1000 bytes and overhead leave no room for a key")
			claim(t, s, "c", now.Add(time.Hour))
			assert.Equal(t, 1, s.Len())
		}},
		{"bounded in bytes, evicting as many as it takes", []MemoryOption{WithShards(1), WithMaxBytes(4000), WithEvictOldest()}, func(t *testing.T, s *MemoryStore) {
			complete(t, s, "a", now, now.Add(time.Hour), 100)
			complete(t, s, "b", now, now.Add(2*time.Hour), 100)
			complete(t, s, "big", now, now.Add(3*time.Hour), 3800) // stored over the bound
			res := claim(t, s, "c", now)
			assert.Equal(t, []Eviction{{Key: Key{Key: "a"}}, {Key: Key{Key: "b"}}, {Key: Key{Key: "big"}}}, res.Evictions)
			assert.Equal(t, 1, s.Len())
		}},
		{"expired records are freed without their room being needed", []MemoryOption{WithShards(1)}, func(t *testing.T, s *MemoryStore) {
			for i := range 10 {
				complete(t, s, fmt.Sprint(i), now, now.Add(time.Minute), 0)
			}
			complete(t, s, "kept", now, now.Add(time.Hour), 0)
			// Later claims, even replays, each drop a couple.
			later := now.Add(2 * time.Minute)
			for range 5 {
				res, err := s.Claim(ctx, testClaim("kept", later))
				require.NoError(t, err)
				require.False(t, res.Claimed)
			}
			assert.Equal(t, 1, s.Len())
		}},
		{"a TTL past the year 2262 does not expire at once", nil, func(t *testing.T, s *MemoryStore) {
			for i, ttl := range []time.Duration{250 * 365 * 24 * time.Hour, math.MaxInt64} {
				key := fmt.Sprint("k", i)
				complete(t, s, key, now, now.Add(ttl), 0)
				res, err := s.Claim(ctx, testClaim(key, now.Add(100*365*24*time.Hour)))
				require.NoError(t, err)
				assert.False(t, res.Claimed, "TTL %v", ttl)
				assert.True(t, res.Record.Completed(), "TTL %v", ttl)
			}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) { tt.run(t, NewMemoryStore(tt.opts...)) })
	}
}

// Many claims of new keys keep a full store at its bound, in records and
// in bytes, when it may evict.
func TestMemoryStoreBound(t *testing.T) {
	ctx := t.Context()
	now := newFakeClock().Now()
	const maxBytes = 100 * (1000 + memRecordOverhead)
	for _, tt := range []struct {
		name string
		opts []MemoryOption
		body int
	}{
		{"records", []MemoryOption{WithMaxEntries(100)}, 0},
		{"bytes", []MemoryOption{WithMaxBytes(maxBytes)}, 1000},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := NewMemoryStore(append(tt.opts, WithShards(4), WithEvictOldest())...)
			for i := range 1000 {
				c := testClaim(fmt.Sprint(i), now)
				res, err := s.Claim(ctx, c)
				require.NoError(t, err)
				require.True(t, res.Claimed)
				resp := &Response{Status: 200, Body: bytes.Repeat([]byte("x"), tt.body)}
				require.NoError(t, s.Complete(ctx, c.Key, c.Token, resp, now.Add(time.Hour)))
			}
			assert.LessOrEqual(t, s.Len(), 100)
			assert.Greater(t, s.Len(), 50, "evicts only what it must")
			var size int64
			for i := range s.shards {
				size += s.shards[i].bytes
			}
			// A shard goes over its share by at most the response
			// completed last, which was stored while the shard was full.
			assert.LessOrEqual(t, size, int64(maxBytes+4*(1000+memRecordOverhead+16)))
		})
	}
}

func TestMemoryStoreConcurrentClaims(t *testing.T) {
	ctx := t.Context()
	now := newFakeClock().Now()
	s := NewMemoryStore()
	const keys, racers = 50, 8
	var won [keys]atomic.Int32
	var wg sync.WaitGroup
	for r := range racers {
		wg.Go(func() {
			for k := range keys {
				c := Claim{Key: Key{Key: fmt.Sprint(k)}, Token: fmt.Sprint(r), Now: now, LeaseExpires: now.Add(time.Minute)}
				res, err := s.Claim(ctx, c)
				if !assert.NoError(t, err) {
					return
				}
				if res.Claimed {
					won[k].Add(1)
					assert.NoError(t, s.Complete(ctx, c.Key, c.Token, &Response{Status: 200}, now.Add(time.Hour)))
				}
			}
		})
	}
	wg.Wait()
	for k := range keys {
		assert.EqualValues(t, 1, won[k].Load(), "key %d", k)
	}
}

func TestMemoryStoreKeepsResponsesIntact(t *testing.T) {
	for _, resp := range []*Response{
		{Status: 204},
		{Status: 201, Body: []byte(`{"id":1}`)},
		{Status: 200, Header: http.Header{"Content-Type": {"text/plain"}}, Body: []byte("ok")},
		{Status: 200, Header: http.Header{"Vary": {"Accept", "Origin"}, "X-Empty": {""}, "Link": {"</a>", "</b>", "</c>"}}},
		{Status: 201, BodyOmitted: true},
		{Status: 200, Body: bytes.Repeat([]byte{0, 0xff, '\n'}, 1000)},
	} {
		s := NewMemoryStore()
		now := time.Now()
		c := testClaim("k", now)
		_, err := s.Claim(t.Context(), c)
		require.NoError(t, err)
		require.NoError(t, s.Complete(t.Context(), c.Key, c.Token, resp, now.Add(time.Hour)))
		for range 2 {
			res, err := s.Claim(t.Context(), testClaim("k", now))
			require.NoError(t, err)
			require.True(t, res.Record.Completed())
			assert.Equal(t, resp, res.Record.Response)
			// What one replay does to its copy does not reach the next.
			if res.Record.Response.Header != nil {
				res.Record.Response.Header.Set("X-Changed", "1")
			}
		}
	}
}

// Keys whose hashes collide share a run of index entries; each must be
// found, completed and removed without disturbing the others.
func TestMemShardHashCollisions(t *testing.T) {
	const now = 0
	var sh memShard
	sh.init()
	const h = 42
	keys := []Key{{Key: "a"}, {Key: "b"}, {Scope: "t", Key: "a"}, {Key: "c"}}
	for _, k := range keys {
		require.Equal(t, int32(none), sh.find(h, k))
		sh.insert(h, Claim{Key: k, Token: "token-" + k.Scope + k.Key}, now)
	}
	for _, k := range keys {
		i := sh.find(h, k)
		require.NotEqual(t, int32(none), i, k)
		assert.Equal(t, "token-"+k.Scope+k.Key, sh.slots[i].token)
	}
	// Remove from the middle, the end and the start of the run.
	for _, k := range []Key{keys[1], keys[3], keys[0]} {
		sh.remove(sh.find(h, k))
		assert.Equal(t, int32(none), sh.find(h, k), k)
	}
	i := sh.find(h, keys[2])
	require.NotEqual(t, int32(none), i)
	sh.complete(i, sh.slots[i].data+PackResponse(&Response{Status: 201}).s, 0, now, now+int64(time.Hour))
	assert.Equal(t, 201, unpack(sh.slots[i].response()).status)
	sh.remove(i)
	assert.Zero(t, sh.index.n)
	assert.Equal(t, 0, sh.len)
	// Freed slots are reused.
	sh.insert(h, Claim{Key: Key{Key: "d"}}, now)
	assert.Len(t, sh.slots, len(keys))
}

// The middleware in front of a full MemoryStore: by default it fails
// closed and forgets nothing; with eviction allowed it reports each record
// it dropped, to the middleware's observer or the store's report function.
// With neither, a drop would go unreported, so the store fails closed as
// if eviction were not allowed.
func TestMiddlewareWithFullMemoryStore(t *testing.T) {
	for _, tt := range []struct {
		name             string
		evict            bool
		observe, report  bool
		evictsReportedTo string // "" when the store fails closed
		wrapped          bool   // in a Store that is not a PackedStore
		rebuilt          bool   // by a wrapper that rebuilds each Claim, dropping fields it does not know
	}{
		{"fails closed by default", false, true, false, "", false, false},
		{"evicts and reports when allowed", true, true, false, "observer", false, false},
		{"evicts and reports when allowed, wrapped", true, true, false, "observer", true, false},
		{"fails closed when allowed but no one would hear of it", true, false, false, "", false, false},
		{"fails closed when allowed but no one would hear of it, wrapped", true, false, false, "", true, false},
		{"evicts when the store reports it", true, false, true, "store", false, false},
		{"evicts when the store reports it, wrapped", true, false, true, "store", true, false},
		{"fails closed when a wrapper drops the claim's report flag", true, true, false, "", true, true},
		{"fails closed when a wrapper drops the claim's report flag, no observer", true, false, false, "", true, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			var reported []Eviction
			opts := []MemoryOption{WithShards(1), WithMaxEntries(2)}
			if tt.evict {
				opts = append(opts, WithEvictOldest())
			}
			if tt.report {
				opts = append(opts, WithEvictionReport(func(e Eviction) { reported = append(reported, e) }))
			}
			var events []Event
			mwOpts := []Option{WithClock(clock.Now), WithRetryAfter(3 * time.Second)}
			if tt.observe {
				mwOpts = append(mwOpts, WithObserver(func(e Event) { events = append(events, e) }))
			}
			var store Store = NewMemoryStore(opts...)
			if tt.wrapped {
				stub := &stubStore{MemoryStore: store.(*MemoryStore)}
				if tt.rebuilt {
					stub.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
						return stub.MemoryStore.Claim(ctx, Claim{Key: c.Key, Fingerprint: c.Fingerprint,
							Token: c.Token, Now: c.Now, LeaseExpires: c.LeaseExpires})
					}
				}
				store = stub
			}
			h := &countingHandler{}
			mw := Middleware(store, mwOpts...)(h)
			for _, key := range []string{"a", "b"} {
				require.Equal(t, http.StatusCreated, serve(mw, newRequest(http.MethodPost, "/x", key, "b")).Code)
				clock.Advance(time.Minute)
			}
			w := serve(mw, newRequest(http.MethodPost, "/x", "c", "b"))
			var last Event
			if tt.observe {
				last = events[len(events)-1]
			}
			want := []Eviction{{Key: Key{Key: "a"}, Age: 2 * time.Minute}}
			switch tt.evictsReportedTo {
			case "":
				decodeProblem(t, w, ProblemStoreUnavailable, http.StatusServiceUnavailable)
				assert.Equal(t, "3", w.Header().Get("Retry-After"))
				if tt.observe {
					assert.Equal(t, OutcomeUnavailable, last.Outcome)
					assert.ErrorIs(t, last.Err, ErrStoreFull)
					assert.Empty(t, last.Evictions)
				}
				assert.EqualValues(t, 2, h.calls.Load(), "the handler did not run")
				for _, key := range []string{"a", "b"} {
					replay := serve(mw, newRequest(http.MethodPost, "/x", key, "b"))
					assert.Equal(t, "true", replay.Header().Get(ReplayedHeader), "%s was forgotten", key)
				}
				assert.EqualValues(t, 2, h.calls.Load(), "no handler ran again")
				return
			case "observer":
				assert.Equal(t, OutcomeExecuted, last.Outcome)
				assert.Equal(t, want, last.Evictions)
			case "store":
				assert.Equal(t, want, reported)
			}
			assert.Equal(t, http.StatusCreated, w.Code)
			replay := serve(mw, newRequest(http.MethodPost, "/x", "b", "b"))
			assert.Equal(t, "true", replay.Header().Get(ReplayedHeader))
		})
	}
}

// A TTL or lease of any size works: one that reaches past the year 2262
// does not overflow into the past.
func TestMiddlewareHugeDurations(t *testing.T) {
	const century = 100 * 365 * 24 * time.Hour
	for _, d := range []time.Duration{250 * 365 * 24 * time.Hour, math.MaxInt64} {
		t.Run(d.String(), func(t *testing.T) {
			clock := newFakeClock()
			h := &countingHandler{}
			mw := Middleware(NewMemoryStore(), WithClock(clock.Now), WithTTL(d))(h)
			serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			clock.Advance(century)
			assertReplayed(t, true, serve(mw, newRequest(http.MethodPost, "/x", "k", "b")), h)

			started, block := make(chan struct{}), make(chan struct{})
			slow := Middleware(NewMemoryStore(), WithClock(clock.Now), WithLease(d))(http.HandlerFunc(
				func(w http.ResponseWriter, r *http.Request) { close(started); <-block }))
			done := make(chan struct{})
			go func() {
				defer close(done)
				serve(slow, newRequest(http.MethodPost, "/x", "k", "b"))
			}()
			<-started
			// The first request holds its lease a century later: a
			// duplicate is told it is in progress, not taken over.
			clock.Advance(century)
			w := serve(slow, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, http.StatusConflict, w.Code)
			close(block)
			<-done
		})
	}
}

// The expiry heap stays ordered while records of any expiry come and go
// from anywhere, and gives them back soonest first.
func TestMemShardExpiryOrder(t *testing.T) {
	const now = 0
	rng := rand.New(rand.NewPCG(1, 2))
	var sh memShard
	sh.init()
	live := map[int32]bool{}
	check := func() {
		t.Helper()
		for j := 1; j < len(sh.expiries); j++ {
			require.LessOrEqual(t, sh.expiries[(j-1)/2].at, sh.expiries[j].at, "heap order at %d", j)
		}
		for j, x := range sh.expiries {
			require.Equal(t, int32(j), sh.slots[x.slot].heapPos)
		}
		require.Len(t, sh.expiries, len(live))
	}
	for n := range 2000 {
		c := Claim{Key: Key{Key: fmt.Sprint(n)}, Token: "t"}
		i := sh.insert(uint64(n), c, now)
		// Mostly in order, as with one TTL, with other TTLs mixed in.
		expires := now + int64(n)*int64(time.Second)
		if rng.IntN(3) == 0 {
			expires = now + int64(rng.IntN(4000))*int64(time.Second)
		}
		sh.complete(i, sh.slots[i].data, 0, now, expires)
		live[i] = true
		if rng.IntN(4) == 0 { // a removal from anywhere
			for j := range live {
				sh.remove(j)
				delete(live, j)
				break
			}
		}
	}
	check()
	last := int64(math.MinInt64)
	for len(sh.expiries) > 0 {
		i := sh.soonest()
		require.GreaterOrEqual(t, sh.slots[i].expires, last)
		last = sh.slots[i].expires
		sh.remove(i)
		delete(live, i)
		if len(live)%100 == 0 {
			check()
		}
	}
	assert.Zero(t, sh.len)
	assert.Zero(t, sh.bytes)
	assert.Zero(t, sh.done)
}

// Bounds of any size work: one too large to share evenly among the shards
// without overflowing an int does not turn into a store that refuses
// every key.
func TestMemoryStoreHugeBounds(t *testing.T) {
	now := newFakeClock().Now()
	for _, tt := range []struct {
		name string
		opt  MemoryOption
	}{
		{"entries", WithMaxEntries(math.MaxInt)},
		{"bytes", WithMaxBytes(math.MaxInt64)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := NewMemoryStore(tt.opt)
			res, err := s.Claim(t.Context(), testClaim("k", now))
			require.NoError(t, err)
			assert.True(t, res.Claimed)
		})
	}
}

// A number of shards of any size works: one past the largest power of two
// an int holds is capped, rather than rounded up forever.
func TestMemoryStoreHugeShards(t *testing.T) {
	s := NewMemoryStore(WithShards(math.MaxInt))
	assert.Len(t, s.shards, maxShards)
	res, err := s.Claim(t.Context(), testClaim("k", newFakeClock().Now()))
	require.NoError(t, err)
	assert.True(t, res.Claimed)
}

// clockStep returns a time that reads as wall on the wall clock and as
// mono on the monotonic clock: what time.Now returns after the wall clock
// was stepped by wall - mono. Both must carry monotonic readings, as
// time.Now's do. It copies the monotonic half of the time's layout (see
// the time package: wall, then ext, the monotonic reading).
func clockStep(t *testing.T, wall, mono time.Time) time.Time {
	t.Helper()
	type layout struct {
		wall uint64
		ext  int64
		loc  *time.Location
	}
	stepped := wall
	(*layout)(unsafe.Pointer(&stepped)).ext = (*layout)(unsafe.Pointer(&mono)).ext
	require.Equal(t, wall.Round(0), stepped.Round(0), "the wall clock's reading")
	require.Zero(t, stepped.Sub(mono), "the monotonic clock's reading")
	return stepped
}

// A record lives its TTL by the monotonic clock: a wall clock stepped
// forward (NTP setting a clock that was far behind, a virtual machine
// resumed) must not expire it early, since a retry of its key would then
// run the handler again; nor keep it later when stepped back.
func TestMemoryStoreExpiryIgnoresWallClockSteps(t *testing.T) {
	ctx := context.Background()
	const ttl = time.Hour
	for _, tc := range []struct {
		name      string
		wallAhead time.Duration // the wall clock's step
		elapsed   time.Duration // time passed, by the monotonic clock
		replayed  bool
	}{
		{"wall clock a day ahead, a minute passed", 24 * time.Hour, time.Minute, true},
		{"wall clock a day behind, two hours passed", -24 * time.Hour, 2 * time.Hour, false},
		{"no step, a minute passed", 0, time.Minute, true},
		{"no step, two hours passed", 0, 2 * time.Hour, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewMemoryStore()
			start := time.Now()
			c := testClaim("k", start)
			res, err := s.Claim(ctx, c)
			require.NoError(t, err)
			require.True(t, res.Claimed)
			require.NoError(t, s.Complete(ctx, c.Key, c.Token, &Response{Status: http.StatusCreated}, start.Add(ttl)))

			later := start.Add(tc.elapsed)
			later = clockStep(t, later.Add(tc.wallAhead), later)
			res, err = s.Claim(ctx, testClaim("k", later))
			require.NoError(t, err)
			if !tc.replayed {
				assert.True(t, res.Claimed, "the record outlived its TTL")
				return
			}
			require.False(t, res.Claimed, "the record was forgotten before its TTL")
			require.NotNil(t, res.Record.Response)
			assert.Equal(t, http.StatusCreated, res.Record.Response.Status)
			assert.Zero(t, res.Record.Expires.Sub(start.Add(ttl)), "the record's expiry, as reported")
			// Read on the wall clock too (as by a caller that strips the
			// monotonic reading, or keeps the time elsewhere), a live
			// record expires the rest of its TTL after the claim that
			// found it, not at a time the stepped clock has passed.
			assert.Zero(t, res.Record.Expires.Round(0).Sub(later.Round(0).Add(ttl-tc.elapsed)),
				"the record's expiry, by the wall clock: %v, found at %v", res.Record.Expires.Round(0), later.Round(0))
		})
	}
}

func TestMemoryStoreDefaultsHoldTheDocumentedLoad(t *testing.T) {
	// The documentation of the defaults (and the README) says what they
	// hold: 1,000,000 records of 512 bytes, about 11 keyed requests a second
	// for the default TTL, and 3 a second at 2 KiB; and WithMaxBytes says
	// what a record counts, 160 bytes of it for its slot and index entries.
	if unsafe.Sizeof(uintptr(0)) == 8 {
		assert.EqualValues(t, 160, memRecordOverhead, "the figure WithMaxBytes states")
	}
	meet := DefaultMaxBytes / DefaultMaxEntries // the record size at which both bounds are reached
	assert.True(t, meet >= 512 && meet < 576, "the bounds meet at about 512-byte records, not %d", meet)
	perSecond := func(records int64) int64 { return records / int64(DefaultTTL/time.Second) }
	assert.EqualValues(t, 11, perSecond(DefaultMaxEntries))
	assert.EqualValues(t, 3, perSecond(DefaultMaxBytes/2048))

	// A typical payment record, a UUIDv7 key and a JSON body of a few
	// hundred bytes with its Content-Type, counts about 512 bytes.
	ctx := t.Context()
	now := newFakeClock().Now()
	s := NewMemoryStore(WithShards(1))
	c := Claim{Key: Key{Key: "01a2074e-7343-71c2-b3a1-d6aa355aab5f"}, Token: "01a2074e-7343-772f-8243-640dc50ea837", Now: now, LeaseExpires: now.Add(time.Minute)}
	res, err := s.Claim(ctx, c)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	body := fmt.Sprintf(`{"id":"ch_%s","amount":100,"currency":"EUR","status":"succeeded","description":%q}`,
		c.Key.Key, bytes.Repeat([]byte("x"), 200))
	resp := &Response{Status: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(body)}
	require.NoError(t, s.Complete(ctx, c.Key, c.Token, resp, now.Add(DefaultTTL)))
	assert.InDelta(t, 512, s.shards[0].bytes, 64, "a typical record")
}
