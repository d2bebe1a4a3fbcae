// Package varint holds what encoding/binary lacks for the project's
// length-prefixed formats.
package varint

// Len returns the number of bytes binary.AppendUvarint writes for v.
func Len(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}
