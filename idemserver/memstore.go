package idemserver

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of a [MemoryStore]. They meet at records of 512 bytes (see
// [WithMaxBytes] for what a record counts): the store then holds 1,000,000
// of them, the responses of about 11 keyed requests a second, sustained,
// for the middleware's default TTL of 24 hours. Larger records fill the
// bytes first: at 2 KiB, 262,144 records, or 3 requests a second.
const (
	// DefaultMaxEntries is the number of records a MemoryStore holds
	// unless [WithMaxEntries] says otherwise.
	DefaultMaxEntries = 1_000_000
	// DefaultMaxBytes is the size of the records a MemoryStore holds
	// unless [WithMaxBytes] says otherwise: 512 MiB.
	DefaultMaxBytes = 512 << 20
	// DefaultShards is the number of independently locked parts a
	// MemoryStore is split into unless [WithShards] says otherwise.
	DefaultShards = 32
)

// reclaimPerClaim is how many expired records a claim drops, besides
// what it needs to make room, so that expired records are freed as
// traffic flows: more than one, so that the store shrinks when traffic
// falls.
const reclaimPerClaim = 2

// MemoryStore is a [Store] that keeps records in the memory of one process.
// It suits a single server instance and tests; instances behind a load
// balancer need a shared store, since each MemoryStore knows only its own
// keys.
//
// # Bounds
//
// The store is bounded in records ([WithMaxEntries]) and in bytes
// ([WithMaxBytes]); see [DefaultMaxEntries] for the rate of keyed requests
// the defaults hold. Records are spread over shards, each with its own
// lock and an equal share of both bounds, so unrelated keys rarely
// contend.
//
// A record is never forgotten before it expires without anyone being
// told. Expired records go first: every claim drops a couple of them, the
// soonest expired first, so that they are freed as traffic flows, and a
// claim that finds its shard full drops all of them, whatever the TTLs
// they were stored with. If the shard is still full of live records (in
// progress, or completed and not expired), the claim fails with an error
// wrapping [ErrStoreFull], which the middleware answers with 503 and
// Retry-After: the store fails closed rather than forget a response that a
// retry may still need. Only with [WithEvictOldest] does it drop the
// completed records that expire soonest instead, and it reports each one in
// [ClaimResult.Evictions]. A record in progress is never dropped.
//
// # Costs
//
// The store runs no goroutine. A completed record is kept as one string
// holding its key and packed response, in a slot of an array indexed by a
// table without pointers, so that a full store costs the garbage collector
// one object per record to mark and nothing to scan but the arrays. It
// implements [PackedStore], so the middleware stores a response and writes
// a replay without converting it; every Claim that finds a completed record
// returns a fresh copy of its response. A record expires when its TTL has
// passed on the monotonic clock, so a step of the wall clock neither drops
// records early nor keeps them late (see [time.Time.Sub]; times from an
// injected clock, without monotonic readings, are compared as they are);
// a TTL of more than about 292 years means 292 years. The zero value is an
// empty store with the default limits, ready to use.
type MemoryStore struct {
	once         sync.Once
	seed         maphash.Seed
	shards       []memShard
	mask         uint64
	maxEntries   int
	maxBytes     int64
	nshards      int
	shardEntries int   // per shard
	shardBytes   int64 // per shard
	evictOldest  bool
	report       func(Eviction) // see WithEvictionReport
	times        memTimes
	closed       atomic.Bool
}

// A MemoryOption configures a [MemoryStore].
type MemoryOption func(*MemoryStore)

// WithMaxEntries bounds the number of records the store holds, in progress
// and completed together, to about n (each shard holds n divided by the
// number of shards, rounded up). Values below 1 mean [DefaultMaxEntries].
func WithMaxEntries(n int) MemoryOption {
	return func(s *MemoryStore) { s.maxEntries = n }
}

// WithMaxBytes bounds the size of the records the store holds to about n
// bytes (each shard holds n divided by the number of shards, rounded up).
// A record counts its key and scope, its packed response (the status, the
// stored header fields' names and values, and the body), its lease token
// while in progress, and 160 bytes for its slot and index entries. The
// response counts once it is stored: a claim is refused (or, with
// [WithEvictOldest], makes room) while its shard holds its share or more,
// so a shard goes over its share by at most the responses of the records
// in progress in it, each at most the middleware's [WithMaxResponseBytes].
// The Go heap the store takes is larger than what it counts, by up to the
// garbage collector's headroom (GOGC). Values below 1 mean
// [DefaultMaxBytes].
func WithMaxBytes(n int64) MemoryOption {
	return func(s *MemoryStore) { s.maxBytes = n }
}

// WithEvictOldest lets the store drop completed records before they expire
// when a claim finds its shard full of live records: the records that
// expire soonest go first (with a single TTL, those completed longest
// ago). A retry of a dropped record's key runs the handler again, so each
// drop is reported in [ClaimResult.Evictions], and by the middleware to
// its observer in [Event.Evictions], and to [WithEvictionReport]'s
// function. No drop goes unreported: for a claim whose evictions no one
// would see (one without [Claim.ReportEvictions], as from a middleware
// without [WithObserver]), a store without WithEvictionReport drops
// nothing live and fails with [ErrStoreFull], as without this option, which
// is what a full store does: it refuses new keys.
func WithEvictOldest() MemoryOption {
	return func(s *MemoryStore) { s.evictOldest = true }
}

// WithEvictionReport sets a function the store calls with each completed
// record it drops before it expires (see [WithEvictOldest]), whatever the
// claim that dropped it: to count or log evictions where the middleware
// has no observer, or where several share the store. It is called with a
// shard's lock held, so it must be quick and must not call the store.
func WithEvictionReport(report func(Eviction)) MemoryOption {
	return func(s *MemoryStore) { s.report = report }
}

// maxShards is the most shards a MemoryStore is split into: far more than
// there are cores to contend for locks, and few enough that rounding up to
// a power of two cannot overflow.
const maxShards = 1 << 16

// WithShards sets the number of shards, rounded up to a power of two, and
// at most 65,536. Values below 1 mean [DefaultShards].
func WithShards(n int) MemoryOption {
	return func(s *MemoryStore) { s.nshards = n }
}

// NewMemoryStore returns an empty MemoryStore configured by opts.
func NewMemoryStore(opts ...MemoryOption) *MemoryStore {
	s := &MemoryStore{}
	for _, o := range opts {
		o(s)
	}
	s.init()
	return s
}

func (s *MemoryStore) init() {
	s.once.Do(func() {
		if s.maxEntries < 1 {
			s.maxEntries = DefaultMaxEntries
		}
		if s.maxBytes < 1 {
			s.maxBytes = DefaultMaxBytes
		}
		if s.nshards < 1 {
			s.nshards = DefaultShards
		}
		// Rounding a larger number up to a power of two would overflow
		// and never end.
		s.nshards = min(s.nshards, maxShards)
		n := 1
		for n < s.nshards {
			n <<= 1
		}
		s.seed = maphash.MakeSeed()
		s.times = memTimes{base: time.Now()}
		s.shards = make([]memShard, n)
		s.mask = uint64(n - 1)
		// Each shard's share is rounded up, as (x-1)/n + 1 rather than
		// (x+n-1)/n, which overflows into a negative share, and so a store
		// that refuses every key, for a bound near the largest int.
		s.shardEntries = (s.maxEntries-1)/n + 1
		s.shardBytes = (s.maxBytes-1)/int64(n) + 1
		for i := range s.shards {
			s.shards[i].init()
		}
	})
}

// locate returns the shard of k and the hash that indexes k there.
func (s *MemoryStore) locate(k Key) (*memShard, uint64) {
	s.init()
	sum := maphash.Comparable(s.seed, k)
	return &s.shards[sum&s.mask], sum
}

// Claim implements [Store].
func (s *MemoryStore) Claim(ctx context.Context, c Claim) (ClaimResult, error) {
	res, err := s.claim(ctx, PackedClaim{Claim: c}, true)
	return res.ClaimResult, err
}

// TakeOver implements [Store].
func (s *MemoryStore) TakeOver(ctx context.Context, c Claim, expiredToken string) (ClaimResult, error) {
	res, err := s.claim(ctx, PackedClaim{Claim: c, TakeOver: true, ExpiredToken: expiredToken}, true)
	return res.ClaimResult, err
}

// ClaimPacked implements [PackedStore]. The response it returns shares the
// record's memory, which no one changes.
func (s *MemoryStore) ClaimPacked(ctx context.Context, c PackedClaim) (PackedClaimResult, error) {
	return s.claim(ctx, c, false)
}

// A claim's Ref names its shard and slot: the shard's number in the high 32
// bits, and the slot's number plus one in the low 32 bits.
func memRef(shard uint64, slot int32) uint64 { return shard<<32 | uint64(uint32(slot+1)) }

// claim is ClaimPacked; with decode, a completed record's response is
// returned in the record rather than packed.
func (s *MemoryStore) claim(ctx context.Context, c PackedClaim, decode bool) (PackedClaimResult, error) {
	if err := ctx.Err(); err != nil {
		return PackedClaimResult{}, err
	}
	sh, h := s.locate(c.Key)
	now := s.times.of(c.Now)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if s.closed.Load() {
		return PackedClaimResult{}, ErrClosed
	}
	sh.reclaim(now, reclaimPerClaim)
	if i := sh.find(h, c.Key); i != none {
		e := &sh.slots[i]
		switch {
		case e.completed && e.expires <= now:
			sh.remove(i)
		case c.TakeOver && !e.completed && e.token == c.ExpiredToken && !c.Now.Before(e.leaseExpires):
			// An extension may have landed since the caller saw the
			// lease ended: then its holder is live and keeps it.
			if c.NewToken != nil {
				c.Token = c.NewToken()
			}
			sh.lease(i, c.Claim, now)
			return PackedClaimResult{ClaimResult: ClaimResult{Claimed: true}, Token: c.Token, Ref: memRef(h&s.mask, i)}, nil
		default:
			res := PackedClaimResult{ClaimResult: ClaimResult{
				Record: Record{Fingerprint: e.fp, Token: e.token, LeaseExpires: e.leaseExpires},
			}}
			if !e.completed {
				return res, nil
			}
			res.Record.Expires = s.times.timeAt(e.expires, c.Now, now)
			if decode {
				res.Record.Response = unpack(e.response()).response()
			} else {
				res.Response = PackedResponse{s: e.response()}
			}
			return res, nil
		}
	}
	evictions, err := s.makeRoom(sh, int64(packedKeyLen(c.Key)+len(c.Token))+memRecordOverhead, now, c.ReportEvictions)
	if err != nil {
		return PackedClaimResult{}, err
	}
	if c.NewToken != nil {
		c.Token = c.NewToken()
	}
	i := sh.insert(h, c.Claim, now)
	return PackedClaimResult{
		ClaimResult: ClaimResult{Claimed: true, Evictions: evictions},
		Token:       c.Token,
		Ref:         memRef(h&s.mask, i),
	}, nil
}

// makeRoom makes room in sh, whose lock is held, for a record of size
// bytes claimed at now: it drops the expired records, then, if the store
// may, the completed ones that expire soonest, and lists those if list is
// set. It fails with ErrStoreFull, dropping nothing live, if that would
// not make room, or if no one would hear of a drop: the claim does not
// list them, and the store reports none.
func (s *MemoryStore) makeRoom(sh *memShard, size, now int64, list bool) ([]Eviction, error) {
	fits := func(n int, bytes int64) bool { return n < s.shardEntries && bytes+size <= s.shardBytes }
	if fits(sh.len, sh.bytes) {
		return nil, nil
	}
	sh.reclaim(now, -1)
	if fits(sh.len, sh.bytes) {
		return nil, nil
	}
	if !s.evictOldest || !fits(sh.len-len(sh.expiries), sh.bytes-sh.done) {
		return nil, fmt.Errorf("%w: a shard holds %d live records of %d bytes, and may hold %d records of %d bytes",
			ErrStoreFull, sh.len, sh.bytes, s.shardEntries, s.shardBytes)
	}
	if !list && s.report == nil {
		return nil, fmt.Errorf("%w: a shard holds %d live records, and an eviction would go unreported "+
			"(the claim does not report evictions, as from a middleware without an observer, "+
			"and the store has no WithEvictionReport)", ErrStoreFull, sh.len)
	}
	var evicted []Eviction
	for !fits(sh.len, sh.bytes) {
		i := sh.soonest()
		e := &sh.slots[i]
		ev := Eviction{Key: e.key(), Age: time.Duration(max(0, now-e.since))}
		if s.report != nil {
			s.report(ev)
		}
		if list {
			evicted = append(evicted, ev)
		}
		sh.remove(i)
	}
	return evicted, nil
}

// Complete implements [Store].
func (s *MemoryStore) Complete(ctx context.Context, key Key, token string, resp *Response, expires time.Time) error {
	if resp == nil {
		return errNoResponse
	}
	return s.CompletePacked(ctx, PackedCompletion{Key: key, Token: token, Response: packedOf(partsOf(resp)), Expires: expires})
}

// errNoResponse is the error of a Complete with a nil response, which
// changes nothing (see [Store.Complete]).
var errNoResponse = errors.New("idemserver: complete: no response")

// CompletePacked implements [PackedStore]. It copies the response.
func (s *MemoryStore) CompletePacked(ctx context.Context, c PackedCompletion) error {
	// The record's one block is built before the lock is taken: the key
	// again, then the response.
	var b strings.Builder
	b.Grow(packedKeyLen(c.Key) + c.Response.Len())
	writePackedKey(&b, c.Key)
	c.Response.writeTo(&b)
	data := b.String()

	s.init()
	tag := s.tokenTag(c.Token)
	now, expires := int64(noTime), s.times.of(c.Expires)
	if !c.Now.IsZero() {
		now = s.times.of(c.Now)
	}
	// The claim's Ref, checked, saves hashing the key and looking it up.
	if shard := c.Ref >> 32; c.Ref != 0 && shard < uint64(len(s.shards)) {
		sh, slot := &s.shards[shard], int32(uint32(c.Ref))-1
		sh.mu.Lock()
		if !s.closed.Load() && sh.holds(slot, c.Key, c.Token) {
			sh.complete(slot, data, tag, now, expires)
			sh.mu.Unlock()
			return nil
		}
		sh.mu.Unlock()
	}
	sh, h := s.locate(c.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	i, err := sh.leased(s, h, c.Key, c.Token)
	if err == ErrLeaseLost && sh.completedWith(h, c.Key, tag, data) {
		// Sent again after it succeeded: the record holds this very
		// response, stored under this token. (Another claim's
		// completion with the same bytes is still refused: the lease
		// lost is the one sign that the handler ran twice.)
		return nil
	}
	if err != nil {
		return err
	}
	sh.complete(i, data, tag, now, expires)
	return nil
}

// tokenTag returns a 32-bit hash of a lease token, which a completed
// record keeps in place of the token (see memSlot.doneBy): enough to
// tell a completion sent again from another claim's, at no cost in
// memory. Two tokens of one key that share a tag are as likely as a
// random 32-bit collision.
func (s *MemoryStore) tokenTag(token string) uint32 {
	return uint32(maphash.String(s.seed, token))
}

// Release implements [Store].
func (s *MemoryStore) Release(ctx context.Context, key Key, token string) error {
	sh, h := s.locate(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	i, err := sh.leased(s, h, key, token)
	if err != nil {
		return err
	}
	sh.remove(i)
	return nil
}

// Extend implements [Store].
func (s *MemoryStore) Extend(ctx context.Context, key Key, token string, leaseExpires time.Time) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh, h := s.locate(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	i, err := sh.leased(s, h, key, token)
	if err != nil {
		return err
	}
	sh.slots[i].leaseExpires = leaseExpires
	return nil
}

// Len returns the number of records the store holds, including expired
// ones that have not been removed yet.
func (s *MemoryStore) Len() int {
	s.init()
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n += sh.len
		sh.mu.Unlock()
	}
	return n
}

// Close drops every record. Later calls of the store's methods return
// [ErrClosed]. The store runs no goroutine, so nothing outlives Close.
// Close always returns nil.
func (s *MemoryStore) Close() error {
	s.init()
	s.closed.Store(true)
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		sh.init()
		sh.mu.Unlock()
	}
	return nil
}
