package idemserver

import (
	"strings"
	"sync"
	"time"
)

// memShard is one independently locked part of a [MemoryStore].
//
// Its records live in slots of one array, found through a [memIndex] by
// the hashes of their keys. The index holds no pointers and the slots few,
// so a shard of many records gives the garbage collector little to do: per
// completed record, one string to mark.
type memShard struct {
	mu    sync.Mutex
	index memIndex
	slots []memSlot
	free  int32 // first unused slot, the others chained through memSlot.nextFree
	len   int   // records held
	limit int
	// head and tail list the completed records, oldest completion first.
	head, tail int32
	_          [32]byte // pads the shard to 128 bytes: no two shards' locks share a cache line
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
	expires      int64     // Unix nanoseconds, once completed
	hash         uint64
	fp           Fingerprint
	nextFree     int32 // of an unused slot
	prev, next   int32 // neighbours in the completed list
	completed    bool
}

func (e *memSlot) expiresAt() time.Time { return time.Unix(0, e.expires) }

// response returns the packed response of a completed record.
func (e *memSlot) response() string {
	_, _, n := unpackKey(e.data)
	return e.data[n:]
}

// is reports whether the slot holds the record of k.
func (e *memSlot) is(k Key) bool {
	scope, key, _ := unpackKey(e.data)
	return scope == k.Scope && key == k.Key
}

// init empties the shard and sets its bound.
func (sh *memShard) init(limit int) {
	sh.index = memIndex{}
	sh.slots = nil
	sh.free, sh.head, sh.tail = none, none, none
	sh.len = 0
	sh.limit = limit
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

// leased returns the slot of key's in-progress record, provided it still
// holds token. hint, unless none, is the slot where the record was
// inserted; it is used if it still holds the record.
func (sh *memShard) leased(s *MemoryStore, h uint64, hint int32, key Key, token string) (int32, error) {
	if s.closed.Load() {
		return none, ErrClosed
	}
	if hint != none && int(hint) < len(sh.slots) {
		// A lease token is unique, so a slot in progress with this token
		// and key holds this claim.
		if e := &sh.slots[hint]; !e.completed && token != "" && e.token == token && e.is(key) {
			return hint, nil
		}
	}
	i := sh.find(h, key)
	if i == none || sh.slots[i].completed || sh.slots[i].token != token {
		return none, ErrLeaseLost
	}
	return i, nil
}

// insert adds an in-progress record for the claim c, whose key hashes to h,
// and returns its slot.
func (sh *memShard) insert(h uint64, c Claim) int32 {
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
	sh.slots[i] = memSlot{
		data: b.String(), token: c.Token, leaseExpires: c.LeaseExpires,
		hash: h, fp: c.Fingerprint, prev: none, next: none,
	}
	sh.index.add(h, i)
	sh.len++
	return i
}

// complete turns the in-progress record in slot i into a completed one
// whose data (key and packed response) is data.
func (sh *memShard) complete(i int32, data string, expires time.Time) {
	e := &sh.slots[i]
	e.data = data
	e.expires = expires.UnixNano()
	e.token, e.leaseExpires = "", time.Time{} // a completed record has no lease
	e.completed = true
	e.prev, e.next = sh.tail, none
	if sh.tail != none {
		sh.slots[sh.tail].next = i
	} else {
		sh.head = i
	}
	sh.tail = i
}

// remove deletes the record in slot i and frees the slot.
func (sh *memShard) remove(i int32) {
	e := &sh.slots[i]
	if e.completed {
		if e.prev != none {
			sh.slots[e.prev].next = e.next
		} else {
			sh.head = e.next
		}
		if e.next != none {
			sh.slots[e.next].prev = e.prev
		} else {
			sh.tail = e.prev
		}
	}
	sh.index.remove(e.hash, i)
	*e = memSlot{nextFree: sh.free}
	sh.free = i
	sh.len--
}

// evict makes room for one record: it drops the expired records at the old
// end of the completed list, or failing that the oldest completed record.
// It reports false when there is no completed record to drop.
func (sh *memShard) evict(now time.Time) bool {
	if sh.head == none {
		return false
	}
	if now.Before(sh.slots[sh.head].expiresAt()) {
		sh.remove(sh.head)
		return true
	}
	for sh.head != none && !now.Before(sh.slots[sh.head].expiresAt()) {
		sh.remove(sh.head)
	}
	return true
}

// packedKeyLen returns the length of k as writePackedKey writes it.
func packedKeyLen(k Key) int {
	return uvarintLen(uint64(len(k.Scope))) + len(k.Scope) + uvarintLen(uint64(len(k.Key))) + len(k.Key)
}

// writePackedKey writes k to b: the scope and the key, each preceded by
// its length as a uvarint.
func writePackedKey(b *strings.Builder, k Key) {
	writeUvarint(b, uint64(len(k.Scope)))
	b.WriteString(k.Scope)
	writeUvarint(b, uint64(len(k.Key)))
	b.WriteString(k.Key)
}

// unpackKey reads the key at the start of data and returns it with the
// length it took.
func unpackKey(data string) (scope, key string, n int) {
	l, w := uvarint(data)
	scope = data[w : w+int(l)]
	n = w + int(l)
	l, w = uvarint(data[n:])
	key = data[n+w : n+w+int(l)]
	return scope, key, n + w + int(l)
}
