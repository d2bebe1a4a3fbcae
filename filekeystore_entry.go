package idemhttp

import (
	"encoding/binary"
	"time"
)

// entryValue is the map value of a pending key: the key itself followed by
// its creation time in 8 bytes (Unix nanoseconds, little-endian). The
// operation id, the key and the time share one allocation, and a pending
// key costs one map slot of two string headers, which keeps a million
// pending keys within a few tens of megabytes beyond their text.
type entryValue string

const entryTimeLen = 8

// newEntry copies op, key and created into one allocation and returns the
// id to use as the map key and the value that goes with it.
func newEntry(op, key string, created int64) (string, entryValue) {
	var t [entryTimeLen]byte
	binary.LittleEndian.PutUint64(t[:], uint64(created))
	all := op + key + string(t[:])
	return all[:len(op)], entryValue(all[len(op):])
}

// key returns the idempotency key.
func (v entryValue) key() string { return string(v[:len(v)-entryTimeLen]) }

// created returns the creation time in Unix nanoseconds.
func (v entryValue) created() int64 {
	var t [entryTimeLen]byte
	copy(t[:], v[len(v)-entryTimeLen:])
	return int64(binary.LittleEndian.Uint64(t[:]))
}

// createdTime returns the creation time.
func (v entryValue) createdTime() time.Time { return time.Unix(0, v.created()) }
