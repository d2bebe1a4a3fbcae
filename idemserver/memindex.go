package idemserver

// memIndex finds a shard's slots by the hashes of their keys. It is an
// open-addressing table of uint64 entries with linear probing, kept at most
// half full: no pointers for the garbage collector, usually one cache line
// per lookup, and no tombstones, since a removal shifts the entries after it
// back (Knuth's algorithm R), so lookups stay short however many records
// come and go.
//
// An entry holds the top 32 bits of the key's hash, which also choose its
// home position, and the slot number plus one; zero marks an empty entry.
// Several entries may share a tag, or a whole hash: the shard compares the
// keys themselves.
type memIndex struct {
	entries []uint64 // length a power of two, or zero
	n       int
}

func indexTag(h uint64) uint32 { return uint32(h >> 32) }

func indexEntry(h uint64, slot int32) uint64 {
	return uint64(indexTag(h))<<32 | uint64(uint32(slot+1))
}

func (x *memIndex) mask() int { return len(x.entries) - 1 }

// home returns the position where probing for tag starts.
func (x *memIndex) home(tag uint32) int { return int(tag) & x.mask() }

// add records that slot holds a key with hash h.
func (x *memIndex) add(h uint64, slot int32) {
	if 2*(x.n+1) > len(x.entries) {
		x.grow()
	}
	x.put(indexEntry(h, slot))
	x.n++
}

func (x *memIndex) put(e uint64) {
	p := x.home(uint32(e >> 32))
	for x.entries[p] != 0 {
		p = (p + 1) & x.mask()
	}
	x.entries[p] = e
}

func (x *memIndex) grow() {
	old := x.entries
	x.entries = make([]uint64, max(16, 2*len(old)))
	for _, e := range old {
		if e != 0 {
			x.put(e)
		}
	}
}

// remove forgets that slot holds a key with hash h, which it must.
func (x *memIndex) remove(h uint64, slot int32) {
	mask := x.mask()
	want := indexEntry(h, slot)
	hole := x.home(indexTag(h))
	for x.entries[hole] != want {
		hole = (hole + 1) & mask
	}
	// Move back each following entry of the run that may live in the
	// hole: one whose home is not between the hole and where it is.
	for q := (hole + 1) & mask; x.entries[q] != 0; q = (q + 1) & mask {
		if home := x.home(uint32(x.entries[q] >> 32)); (q-home)&mask >= (q-hole)&mask {
			x.entries[hole] = x.entries[q]
			hole = q
		}
	}
	x.entries[hole] = 0
	x.n--
}
