package idemserver

import (
	"context"
	"encoding/binary"
	"hash/maphash"
	"net/http"
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
// when its room is needed, so the store runs no goroutine. Completed
// responses are kept packed into one pointer-free block each, which the
// garbage collector does not have to scan, and every Claim that finds one
// returns a fresh copy. The zero value is an empty store with the default
// limits, ready to use.
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

type memShard struct {
	mu      sync.Mutex
	records map[Key]*memEntry
	limit   int
	// head and tail list the completed records, oldest completion first.
	head, tail *memEntry
	_          [24]byte // keeps neighbouring shards' locks off one cache line
}

type memEntry struct {
	key Key
	rec Record // without its Response, which is kept encoded in resp
	// resp is the encoded response of a completed record, nil while it is
	// in progress: one pointer-free block per record, which the garbage
	// collector need not scan, where a Response with its header map would
	// cost it several objects to mark.
	resp       []byte
	prev, next *memEntry
}

func (e *memEntry) completed() bool { return e.resp != nil }

// record returns the entry's record with its response decoded.
func (e *memEntry) record() Record {
	r := e.rec
	if e.resp != nil {
		r.Response = decodeResponse(e.resp)
	}
	return r
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
			s.shards[i].records = make(map[Key]*memEntry)
			s.shards[i].limit = limit
		}
	})
}

func (s *MemoryStore) shard(k Key) *memShard {
	s.init()
	var h maphash.Hash
	h.SetSeed(s.seed)
	h.WriteString(k.Scope)
	h.WriteByte(0)
	h.WriteString(k.Key)
	return &s.shards[h.Sum64()&s.mask]
}

// Claim implements [Store].
func (s *MemoryStore) Claim(ctx context.Context, c Claim) (ClaimResult, error) {
	return s.claim(ctx, c, false, "")
}

// TakeOver implements [Store].
func (s *MemoryStore) TakeOver(ctx context.Context, c Claim, expiredToken string) (ClaimResult, error) {
	return s.claim(ctx, c, true, expiredToken)
}

func (s *MemoryStore) claim(ctx context.Context, c Claim, takeOver bool, expiredToken string) (ClaimResult, error) {
	if err := ctx.Err(); err != nil {
		return ClaimResult{}, err
	}
	sh := s.shard(c.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if s.closed.Load() {
		return ClaimResult{}, ErrClosed
	}
	fresh := Record{Fingerprint: c.Fingerprint, Token: c.Token, LeaseExpires: c.LeaseExpires}
	if e := sh.records[c.Key]; e != nil {
		switch {
		case e.completed() && !c.Now.Before(e.rec.Expires):
			sh.remove(e)
		case takeOver && !e.completed() && e.rec.Token == expiredToken:
			e.rec = fresh
			return ClaimResult{Claimed: true}, nil
		default:
			return ClaimResult{Record: e.record()}, nil
		}
	}
	if len(sh.records) >= sh.limit && !sh.evict(c.Now) {
		return ClaimResult{}, ErrStoreFull
	}
	sh.records[c.Key] = &memEntry{key: c.Key, rec: fresh}
	return ClaimResult{Claimed: true}, nil
}

// Complete implements [Store].
func (s *MemoryStore) Complete(ctx context.Context, key Key, token string, resp *Response, expires time.Time) error {
	return s.leased(key, token, func(sh *memShard, e *memEntry) {
		e.resp = encodeResponse(resp)
		e.rec.Expires = expires
		e.rec.Token = "" // a completed record has no lease
		sh.pushCompleted(e)
	})
}

// Release implements [Store].
func (s *MemoryStore) Release(ctx context.Context, key Key, token string) error {
	return s.leased(key, token, func(sh *memShard, e *memEntry) {
		delete(sh.records, key)
	})
}

// leased calls f, under the lock of key's shard, with the in-progress
// record of key, provided it still holds token.
func (s *MemoryStore) leased(key Key, token string, f func(*memShard, *memEntry)) error {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if s.closed.Load() {
		return ErrClosed
	}
	e := sh.records[key]
	if e == nil || e.completed() || e.rec.Token != token {
		return ErrLeaseLost
	}
	f(sh, e)
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
		n += len(sh.records)
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
		clear(sh.records)
		sh.head, sh.tail = nil, nil
		sh.mu.Unlock()
	}
	return nil
}

// evict makes room for one record: it drops the expired records at the old
// end of the completed list, or failing that the oldest completed record.
// It reports false when there is no completed record to drop.
func (sh *memShard) evict(now time.Time) bool {
	if sh.head == nil {
		return false
	}
	if now.Before(sh.head.rec.Expires) {
		sh.remove(sh.head)
		return true
	}
	for sh.head != nil && !now.Before(sh.head.rec.Expires) {
		sh.remove(sh.head)
	}
	return true
}

func (sh *memShard) pushCompleted(e *memEntry) {
	e.prev, e.next = sh.tail, nil
	if sh.tail != nil {
		sh.tail.next = e
	} else {
		sh.head = e
	}
	sh.tail = e
}

// remove deletes a completed record from the map and the list.
func (sh *memShard) remove(e *memEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		sh.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		sh.tail = e.prev
	}
	e.prev, e.next = nil, nil
	delete(sh.records, e.key)
}

// encodeResponse packs resp into one block: the status, a flag, the header
// fields as length-prefixed strings, and the body.
func encodeResponse(resp *Response) []byte {
	size := 3*binary.MaxVarintLen64 + len(resp.Body)
	for k, vs := range resp.Header {
		size += 2*binary.MaxVarintLen64 + len(k)
		for _, v := range vs {
			size += binary.MaxVarintLen64 + len(v)
		}
	}
	b := make([]byte, 0, size)
	b = binary.AppendUvarint(b, uint64(resp.Status))
	omitted := uint64(0)
	if resp.BodyOmitted {
		omitted = 1
	}
	b = binary.AppendUvarint(b, omitted)
	b = binary.AppendUvarint(b, uint64(len(resp.Header)))
	for k, vs := range resp.Header {
		b = binary.AppendUvarint(b, uint64(len(k)))
		b = append(b, k...)
		b = binary.AppendUvarint(b, uint64(len(vs)))
		for _, v := range vs {
			b = binary.AppendUvarint(b, uint64(len(v)))
			b = append(b, v...)
		}
	}
	return append(b, resp.Body...)
}

// decodeResponse unpacks what encodeResponse packed. The header strings
// share one allocation; the body is part of b, which is never modified.
func decodeResponse(b []byte) *Response {
	i := 0
	next := func() int {
		v, n := binary.Uvarint(b[i:])
		i += n
		return int(v)
	}
	resp := &Response{Status: next(), BodyOmitted: next() == 1}
	nkeys := next()
	if nkeys > 0 {
		// The header section, from here to the body, as one string.
		start := i
		values := 0
		for range nkeys {
			i += next()
			nv := next()
			values += nv
			for range nv {
				i += next()
			}
		}
		text := string(b[start:i])
		all := make([]string, values)
		resp.Header = make(http.Header, nkeys)
		i = start
		str := func() string {
			n := next()
			s := text[i-start : i-start+n]
			i += n
			return s
		}
		for range nkeys {
			k := str()
			nv := next()
			vs := all[:nv:nv]
			all = all[nv:]
			for j := range vs {
				vs[j] = str()
			}
			resp.Header[k] = vs
		}
	}
	if i < len(b) {
		resp.Body = b[i:len(b):len(b)]
	}
	return resp
}
