package idemserver

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
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
	// Small requests are encoded on the stack and hashed in one call.
	var buf [1024]byte
	b := appendField(buf[:0], fingerprintVersion)
	b = appendField(b, method)
	b = appendField(b, path)
	b = appendField(b, query)
	b = binary.BigEndian.AppendUint64(b, uint64(len(body)))
	if len(b)+len(body) <= len(buf) {
		return sha256.Sum256(append(b, body...))
	}
	h := sha256.New()
	h.Write(bytes.Clone(b))
	h.Write(body)
	var f Fingerprint
	h.Sum(f[:0])
	return f
}

func appendField(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint64(b, uint64(len(s)))
	return append(b, s...)
}
