package idemserver

import (
	"math"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/idemhttp/idemhttp/internal/varint"
)

// memShard is one independently locked part of a [MemoryStore].
//
// Its records live in slots of one array, found through a [memIndex] by
// the hashes of their keys. The index holds no pointers and the slots few,
// so a shard of many records gives the garbage collector little to do: per
// completed record, one string to mark.
//
// The completed records are also ordered by expiry, in a binary min-heap
// of slot numbers, so that the record that expires first is always at
// hand, whatever the TTLs of the records around it. Records completed in
// order of expiry, as with a single TTL, go in at the bottom without moving
// anything.
type memShard struct {
	mu       sync.Mutex
	index    memIndex
	slots    []memSlot
	expiries []memExpiry // the heap
	free     int32       // first unused slot, the others chained through memSlot.nextFree
	len      int         // records held
	bytes    int64       // their size, as memSlot.size counts it
	done     int64       // the size of the completed ones
	_        [8]byte     // pads the shard to 128 bytes: no two shards' locks share a cache line
}

// memExpiry is an entry of a shard's expiry heap.
type memExpiry struct {
	at   int64 // the record's expiry; see memTimes
	slot int32
}

// none is the slot index that stands for no slot.
const none = -1

// memSlot holds one record.
type memSlot struct {
	// data holds the record's key (see writePackedKey), followed, once
	// the record is completed, by its packed response.
	data         string
	token        string    // lease token, while in progress
	leaseExpires time.Time // while in progress
	expires      int64     // once completed; see memTimes
	since        int64     // when claimed, then when completed; see memTimes
	hash         uint64
	fp           Fingerprint
	nextFree     int32 // of an unused slot
	heapPos      int32 // in the expiry heap, once completed
	completed    bool
	// doneBy is the tag of the token that completed the record (see
	// MemoryStore.tokenTag), so that a completion sent again is told
	// from another claim's. It fits in the slot's padding.
	doneBy uint32
}

// memRecordOverhead is what a record costs besides its strings: its slot,
// its expiry entry and its index entry, with the index kept at most half
// full. The documentation of [WithMaxBytes] states it.
const memRecordOverhead = int64(unsafe.Sizeof(memSlot{})) + int64(unsafe.Sizeof(memExpiry{})) + 2*8

// size returns what the record in e counts toward the store's byte bound.
func (e *memSlot) size() int64 { return int64(len(e.data)+len(e.token)) + memRecordOverhead }

// response returns the packed response of a completed record.
func (e *memSlot) response() string {
	_, _, n := unpackKey(e.data)
	return e.data[n:]
}

// key returns the record's key, sharing the record's memory.
func (e *memSlot) key() Key {
	scope, key, _ := unpackKey(e.data)
	return Key{Scope: scope, Key: key}
}

// is reports whether the slot holds the record of k.
func (e *memSlot) is(k Key) bool {
	scope, key, _ := unpackKey(e.data)
	return scope == k.Scope && key == k.Key
}

// init empties the shard.
func (sh *memShard) init() {
	sh.index = memIndex{}
	sh.slots, sh.expiries = nil, nil
	sh.free = none
	sh.len = 0
	sh.bytes, sh.done = 0, 0
}

// find returns the slot of k, whose hash is h, or none.
func (sh *memShard) find(h uint64, k Key) int32 {
	x := &sh.index
	if x.n == 0 {
		return none
	}
	tag := indexTag(h)
	for p := x.home(tag); x.entries[p] != 0; p = (p + 1) & x.mask() {
		if e := x.entries[p]; uint32(e>>32) == tag {
			i := int32(uint32(e)) - 1
			if s := &sh.slots[i]; s.hash == h && s.is(k) {
				return i
			}
		}
	}
	return none
}

// holds reports whether slot i holds key's in-progress record under token.
// A lease token is unique, so such a slot holds that very claim.
func (sh *memShard) holds(i int32, key Key, token string) bool {
	if i < 0 || int(i) >= len(sh.slots) {
		return false
	}
	e := &sh.slots[i]
	return !e.completed && token != "" && e.token == token && e.is(key)
}

// leased returns the slot of key's in-progress record, provided it still
// holds token.
func (sh *memShard) leased(s *MemoryStore, h uint64, key Key, token string) (int32, error) {
	if s.closed.Load() {
		return none, ErrClosed
	}
	i := sh.find(h, key)
	if i == none || sh.slots[i].completed || sh.slots[i].token != token {
		return none, ErrLeaseLost
	}
	return i, nil
}

// completedWith reports whether key's record, whose key hashes to h, was
// completed by the token whose tag is tag with the response packed in
// data, after key (see writePackedKey), whatever the order of its fields.
func (sh *memShard) completedWith(h uint64, key Key, tag uint32, data string) bool {
	i := sh.find(h, key)
	if i == none || !sh.slots[i].completed || sh.slots[i].doneBy != tag {
		return false
	}
	_, _, n := unpackKey(data)
	return samePacked(sh.slots[i].response(), data[n:])
}

// insert adds an in-progress record for the claim c, made at now, whose
// key hashes to h, and returns its slot.
func (sh *memShard) insert(h uint64, c Claim, now int64) int32 {
	i := sh.free
	if i != none {
		sh.free = sh.slots[i].nextFree
	} else {
		i = int32(len(sh.slots))
		sh.slots = append(sh.slots, memSlot{})
	}
	var b strings.Builder
	b.Grow(packedKeyLen(c.Key))
	writePackedKey(&b, c.Key)
	e := &sh.slots[i]
	*e = memSlot{
		data: b.String(), token: c.Token, leaseExpires: c.LeaseExpires,
		since: now, hash: h, fp: c.Fingerprint, heapPos: none,
	}
	sh.index.add(h, i)
	sh.len++
	sh.bytes += e.size()
	return i
}

// lease gives the in-progress record in slot i to the claim c, made at now.
func (sh *memShard) lease(i int32, c Claim, now int64) {
	e := &sh.slots[i]
	sh.bytes -= e.size()
	e.fp, e.token, e.leaseExpires, e.since = c.Fingerprint, c.Token, c.LeaseExpires, now
	sh.bytes += e.size()
}

// complete turns the in-progress record in slot i into a completed one
// whose data (key and packed response) is data, to expire at expires, by
// the token whose tag is tag. now, unless it is noTime, is the time of the
// completion.
func (sh *memShard) complete(i int32, data string, tag uint32, now, expires int64) {
	e := &sh.slots[i]
	sh.bytes -= e.size()
	e.data = data
	e.expires = expires
	if now != noTime {
		e.since = now
	}
	e.token, e.leaseExpires = "", time.Time{} // a completed record has no lease
	e.completed, e.doneBy = true, tag
	n := e.size()
	sh.bytes += n
	sh.done += n
	e.heapPos = int32(len(sh.expiries))
	sh.expiries = append(sh.expiries, memExpiry{at: e.expires, slot: i})
	sh.up(int(e.heapPos))
}

// remove deletes the record in slot i and frees the slot.
func (sh *memShard) remove(i int32) {
	e := &sh.slots[i]
	n := e.size()
	if e.completed {
		sh.unheap(int(e.heapPos))
		sh.done -= n
	}
	sh.bytes -= n
	sh.index.remove(e.hash, i)
	*e = memSlot{nextFree: sh.free}
	sh.free = i
	sh.len--
}

// soonest returns the slot of the completed record that expires first, or
// none if there is no completed record.
func (sh *memShard) soonest() int32 {
	if len(sh.expiries) == 0 {
		return none
	}
	return sh.expiries[0].slot
}

// reclaim drops up to max records that have expired at now (all of them if
// max is negative), soonest first.
func (sh *memShard) reclaim(now int64, max int) {
	for ; max != 0 && len(sh.expiries) > 0 && sh.expiries[0].at <= now; max-- {
		sh.remove(sh.expiries[0].slot)
	}
}

// The expiry heap. Each entry's slot knows its position, so that a record
// can leave the heap from anywhere when it is removed.

func (sh *memShard) heapSet(j int, x memExpiry) {
	sh.expiries[j] = x
	sh.slots[x.slot].heapPos = int32(j)
}

// up moves the entry at j toward the root to its place.
func (sh *memShard) up(j int) {
	x := sh.expiries[j]
	for j > 0 {
		parent := (j - 1) / 2
		if sh.expiries[parent].at <= x.at {
			break
		}
		sh.heapSet(j, sh.expiries[parent])
		j = parent
	}
	sh.heapSet(j, x)
}

// down moves the entry at j away from the root to its place.
func (sh *memShard) down(j int) {
	h := sh.expiries
	x := h[j]
	for {
		c := 2*j + 1
		if c >= len(h) {
			break
		}
		if c+1 < len(h) && h[c+1].at < h[c].at {
			c++
		}
		if x.at <= h[c].at {
			break
		}
		sh.heapSet(j, h[c])
		j = c
	}
	sh.heapSet(j, x)
}

// unheap takes the entry at j out of the heap.
func (sh *memShard) unheap(j int) {
	last := len(sh.expiries) - 1
	if j != last {
		moved := sh.expiries[last]
		sh.expiries = sh.expiries[:last]
		sh.heapSet(j, moved)
		if j > 0 && sh.expiries[(j-1)/2].at > moved.at {
			sh.up(j)
		} else {
			sh.down(j)
		}
		return
	}
	sh.expiries = sh.expiries[:last]
}

// memTimes turns the times a [MemoryStore] is given into the numbers it
// keeps: nanoseconds since base, a time taken when the store was made.
// Time.Sub reads the monotonic clock when both times carry a reading of
// it, as those of time.Now do, so a record lives its TTL by the time that
// has passed, whatever steps the wall clock takes: a wall clock set a day
// forward must not expire a day of records at once, and retries of their
// keys run again. Times without a reading (those of an injected clock) are
// measured on the wall clock, against the same base, so they stay in order
// with one another. Sub saturates, so a time more than about 292 years
// from base is kept as that far: a TTL of centuries means "for 292 years".
type memTimes struct{ base time.Time }

// noTime stands for no time.
const noTime = math.MinInt64

// of returns what the store keeps for t.
func (m memTimes) of(t time.Time) int64 { return int64(t.Sub(m.base)) }

// timeAt returns the time that n stands for, on the clocks of now, which
// the store keeps as at: now plus the time from at to n. Read on the wall
// clock, it is then when n comes by the wall clock as it reads now, even
// if that clock was stepped since base; with a monotonic reading it is the
// same instant as base plus n.
func (memTimes) timeAt(n int64, now time.Time, at int64) time.Time {
	d := n - at
	switch { // saturated, as Sub is
	case n > at && d < 0:
		d = math.MaxInt64
	case n < at && d > 0:
		d = math.MinInt64
	}
	return now.Add(time.Duration(d))
}

// packedKeyLen returns the length of k as writePackedKey writes it.
func packedKeyLen(k Key) int {
	return varint.Len(uint64(len(k.Scope))) + len(k.Scope) + varint.Len(uint64(len(k.Key))) + len(k.Key)
}

// writePackedKey writes k to b: the scope and the key, each preceded by
// its length as a uvarint.
func writePackedKey(b *strings.Builder, k Key) {
	varint.Write(b, uint64(len(k.Scope)))
	b.WriteString(k.Scope)
	varint.Write(b, uint64(len(k.Key)))
	b.WriteString(k.Key)
}

// unpackKey reads the key at the start of data and returns it with the
// length it took.
func unpackKey(data string) (scope, key string, n int) {
	l, w := varint.Uvarint(data)
	scope = data[w : w+int(l)]
	n = w + int(l)
	l, w = varint.Uvarint(data[n:])
	key = data[n+w : n+w+int(l)]
	return scope, key, n + w + int(l)
}
