// Package varint holds what encoding/binary lacks for the project's
// length-prefixed formats.
package varint

import (
	"encoding/binary"
	"strings"
)

// Len returns the number of bytes binary.AppendUvarint writes for v.
func Len(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// Uvarint decodes a uvarint from the start of b, a string or a byte slice,
// as binary.Uvarint does: it returns the value and the number of bytes
// read; n == 0 means b is too short, n < 0 that the value overflows 64 bits
// (and -n bytes were read).
func Uvarint[T ~string | ~[]byte](b T) (v uint64, n int) {
	var s uint
	for i := 0; i < len(b); i++ {
		if i == binary.MaxVarintLen64 {
			return 0, -(i + 1)
		}
		c := b[i]
		if c < 0x80 {
			if i == binary.MaxVarintLen64-1 && c > 1 {
				return 0, -(i + 1)
			}
			return v | uint64(c)<<s, i + 1
		}
		v |= uint64(c&0x7f) << s
		s += 7
	}
	return 0, 0
}

// Write writes v to b as a uvarint, as binary.AppendUvarint would append
// it.
func Write(b *strings.Builder, v uint64) {
	var buf [binary.MaxVarintLen64]byte
	b.Write(binary.AppendUvarint(buf[:0], v))
}
