package idemserver

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash"
)

// A Fingerprint identifies the content of a request: a SHA-256 digest of its
// method, path, query and body. Two requests that carry the same key must
// have the same fingerprint; otherwise the second is refused with 422.
type Fingerprint [sha256.Size]byte

// String returns the fingerprint in lower-case hexadecimal.
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }

// fingerprintVersion starts every digest, so that a change of encoding can
// never make an old fingerprint match a new one.
const fingerprintVersion = "idemserver fingerprint v1"

// fingerprint returns the Fingerprint of a request. Every part is written
// with its length in front, so no two different requests share an encoding:
// a path ending where the query begins cannot collide with another split.
// The path is the escaped path and the query the raw query, exactly as the
// client sent them.
func fingerprint(method, path, query string, body []byte) Fingerprint {
	h := sha256.New()
	writeField(h, []byte(fingerprintVersion))
	writeField(h, []byte(method))
	writeField(h, []byte(path))
	writeField(h, []byte(query))
	writeField(h, body)
	var f Fingerprint
	h.Sum(f[:0])
	return f
}

func writeField(h hash.Hash, b []byte) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(b)))
	h.Write(n[:])
	h.Write(b)
}
