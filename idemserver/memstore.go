package idemserver

import (
	"context"
	"hash/maphash"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of a [MemoryStore].
const (
	// DefaultMaxEntries is the number of records a MemoryStore holds
	// unless [WithMaxEntries] says otherwise.
	DefaultMaxEntries = 100_000
	// DefaultShards is the number of independently locked parts a
	// MemoryStore is split into unless [WithShards] says otherwise.
	DefaultShards = 32
)

// MemoryStore is a [Store] that keeps records in the memory of one process.
// It suits a single server instance and tests; instances behind a load
// balancer need a shared store, since each MemoryStore knows only its own
// keys.
//
// Records are spread over shards, each with its own lock, so unrelated keys
// rarely contend. The store is bounded: when a shard is full, a new claim
// first makes room by dropping expired records, oldest completion first, and
// failing that the completed record that completed longest ago. A record in
// progress is never dropped; when a shard holds nothing else, the claim
// fails with [ErrStoreFull], which the middleware answers with 503.
//
// Expiry is lazy: an expired record is removed when it is next claimed or
// when its room is needed, so the store runs no goroutine. A completed
// record is kept as one string holding its key and packed response, in a
// slot of an array indexed by a table without pointers, so that a full store
// costs the garbage collector one object per record to mark and nothing to
// scan but the arrays; every Claim that finds a completed record returns a
// fresh copy of its response. The zero value is an empty store with the
// default limits, ready to use.
type MemoryStore struct {
	once       sync.Once
	seed       maphash.Seed
	shards     []memShard
	mask       uint64
	maxEntries int
	nshards    int
	closed     atomic.Bool
}

// A MemoryOption configures a [MemoryStore].
type MemoryOption func(*MemoryStore)

// WithMaxEntries bounds the number of records the store holds, in progress
// and completed together, to about n (each shard holds n divided by the
// number of shards, rounded up). Values below 1 mean [DefaultMaxEntries].
func WithMaxEntries(n int) MemoryOption {
	return func(s *MemoryStore) { s.maxEntries = n }
}

// WithShards sets the number of shards, rounded up to a power of two.
// Values below 1 mean [DefaultShards].
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
		if s.nshards < 1 {
			s.nshards = DefaultShards
		}
		n := 1
		for n < s.nshards {
			n <<= 1
		}
		s.seed = maphash.MakeSeed()
		s.shards = make([]memShard, n)
		s.mask = uint64(n - 1)
		limit := (s.maxEntries + n - 1) / n
		for i := range s.shards {
			s.shards[i].init(limit)
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
	res, _, _, err := s.claim(ctx, c, false, "", nil, true)
	return res, err
}

// TakeOver implements [Store].
func (s *MemoryStore) TakeOver(ctx context.Context, c Claim, expiredToken string) (ClaimResult, error) {
	res, _, _, err := s.claim(ctx, c, true, expiredToken, nil, true)
	return res, err
}

// A memRef says where a claim put its record, so that completing the
// claim needs neither the key's hash nor, usually, a lookup.
type memRef struct {
	sh    *memShard
	hash  uint64
	slot  int32  // a hint: checked, and looked up again if it no longer holds the claim
	token string // the lease token, when the store made it
}

// claimPacked is Claim, or TakeOver if takeOver is set, for the
// middleware: a completed record's response comes back packed, as the
// second result, instead of as Record.Response, so that a replay can write
// it without decoding it first; and a successful claim reports where its
// record is, for completePacked. The claim's lease token is made by
// tokens, only if the claim succeeds, and reported in the memRef.
func (s *MemoryStore) claimPacked(ctx context.Context, c Claim, takeOver bool, expiredToken string, tokens *tokenSource) (ClaimResult, string, memRef, error) {
	return s.claim(ctx, c, takeOver, expiredToken, tokens, false)
}

// claim is Claim, or TakeOver if takeOver is set. With tokens, c's lease
// token is made there when the claim succeeds; with decode, a completed
// record's response is returned in the record rather than packed.
func (s *MemoryStore) claim(ctx context.Context, c Claim, takeOver bool, expiredToken string, tokens *tokenSource, decode bool) (ClaimResult, string, memRef, error) {
	if err := ctx.Err(); err != nil {
		return ClaimResult{}, "", memRef{}, err
	}
	sh, h := s.locate(c.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if s.closed.Load() {
		return ClaimResult{}, "", memRef{}, ErrClosed
	}
	if i := sh.find(h, c.Key); i != none {
		e := &sh.slots[i]
		switch {
		case e.completed && !c.Now.Before(e.expiresAt()):
			sh.remove(i)
		case takeOver && !e.completed && e.token == expiredToken:
			if tokens != nil {
				c.Token = tokens.next()
			}
			e.fp, e.token, e.leaseExpires = c.Fingerprint, c.Token, c.LeaseExpires
			return ClaimResult{Claimed: true}, "", memRef{sh, h, i, c.Token}, nil
		default:
			rec := Record{Fingerprint: e.fp, Token: e.token, LeaseExpires: e.leaseExpires}
			if !e.completed {
				return ClaimResult{Record: rec}, "", memRef{}, nil
			}
			rec.Expires = e.expiresAt()
			if !decode {
				return ClaimResult{Record: rec}, e.response(), memRef{}, nil
			}
			rec.Response = unpack(e.response()).response()
			return ClaimResult{Record: rec}, "", memRef{}, nil
		}
	}
	if sh.len >= sh.limit && !sh.evict(c.Now) {
		return ClaimResult{}, "", memRef{}, ErrStoreFull
	}
	if tokens != nil {
		c.Token = tokens.next()
	}
	i := sh.insert(h, c)
	return ClaimResult{Claimed: true}, "", memRef{sh, h, i, c.Token}, nil
}

// Complete implements [Store].
func (s *MemoryStore) Complete(ctx context.Context, key Key, token string, resp *Response, expires time.Time) error {
	sh, h := s.locate(key)
	return s.completePacked(memRef{sh: sh, hash: h, slot: none}, key, token, partsOf(resp), expires)
}

// completePacked is Complete for a response the middleware has already
// taken apart into the pieces of its packed form, and a record that ref
// locates.
func (s *MemoryStore) completePacked(ref memRef, key Key, token string, p packedParts, expires time.Time) error {
	// The record's one block is built before the lock is taken: the key
	// again, then the response.
	var b strings.Builder
	b.Grow(packedKeyLen(key) + p.size())
	writePackedKey(&b, key)
	p.writeTo(&b)
	data := b.String()

	sh := ref.sh
	sh.mu.Lock()
	defer sh.mu.Unlock()
	i, err := sh.leased(s, ref.hash, ref.slot, key, token)
	if err != nil {
		return err
	}
	sh.complete(i, data, expires)
	return nil
}

// Release implements [Store].
func (s *MemoryStore) Release(ctx context.Context, key Key, token string) error {
	sh, h := s.locate(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	i, err := sh.leased(s, h, none, key, token)
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
	i, err := sh.leased(s, h, none, key, token)
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
		sh.init(sh.limit)
		sh.mu.Unlock()
	}
	return nil
}
