package idemhttp

import (
	"crypto/rand"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemhttp/idemhttp/internal/sfv"
)

// keyRandomBatch is how many bytes of randomness a keySource reads from
// crypto/rand at once: the random bytes of 64 keys.
const keyRandomBatch = 64 * 16

// A keySource makes a Transport's default idempotency keys: UUIDv7 strings
// (RFC 9562 section 5.7), whose 74 random bits make them unique and
// unpredictable and whose leading Unix-millisecond timestamp orders them by
// time, which keeps servers' key indexes compact.
//
// The random bits come from crypto/rand, as uuid.NewV7's do, but read for
// 64 keys at a time: on Linux each read of crypto/rand is a system call,
// which cost more than all the rest of making a key. Each byte read is used
// for one key only. A keySource belongs to one Transport; the zero value is
// ready to use, and it is safe for concurrent use.
//
// The bytes of up to 63 keys to come sit in the Transport's memory: a core
// dump shows them, and a process whose memory is snapshotted and restored
// twice (a VM or CRIU snapshot cloned) hands the same keys out in both
// copies. Where that can happen, give [WithKeyGenerator] a generator that
// reads crypto/rand for each key.
type keySource struct {
	mu     sync.Mutex
	random [keyRandomBatch]byte
	used   int // bytes of random handed out; a full batch is read again
}

// newKey returns a new UUIDv7 string stamped with now.
func (s *keySource) newKey(now time.Time) (string, error) {
	var id [16]byte
	s.mu.Lock()
	if s.used == 0 || s.used == len(s.random) {
		if _, err := rand.Read(s.random[:]); err != nil {
			s.used = 0
			s.mu.Unlock()
			return "", err
		}
		s.used = 0
	}
	copy(id[:], s.random[s.used:])
	s.used += len(id)
	s.mu.Unlock()
	return formatUUIDv7(&id, now.UnixMilli()), nil
}

// formatUUIDv7 stamps the random bytes id with the Unix time ms, the
// version and the variant of a UUIDv7, and returns it in the canonical
// 8-4-4-4-12 hexadecimal form. The string is its only allocation. Each
// group's digits are written at offsets the compiler knows, one table
// lookup per byte, so that, with putHex inlined, the compiler can drop the
// index checks, and no branch places the dashes.
func formatUUIDv7(id *[16]byte, ms int64) string {
	id[0], id[1], id[2] = byte(ms>>40), byte(ms>>32), byte(ms>>24)
	id[3], id[4], id[5] = byte(ms>>16), byte(ms>>8), byte(ms)
	id[6] = 0x70 | id[6]&0x0f // version 7
	id[8] = 0x80 | id[8]&0x3f // variant 10 (RFC 9562)
	var s [36]byte
	s[8], s[13], s[18], s[23] = '-', '-', '-', '-'
	for i := range 4 {
		putHex(&s, 2*i, id[i])
	}
	for i := range 2 {
		putHex(&s, 9+2*i, id[4+i])
		putHex(&s, 14+2*i, id[6+i])
		putHex(&s, 19+2*i, id[8+i])
	}
	for i := range 6 {
		putHex(&s, 24+2*i, id[10+i])
	}
	return string(s[:])
}

// putHex writes the two hexadecimal digits of b at s[at:at+2].
func putHex(s *[36]byte, at int, b byte) {
	s[at], s[at+1] = hexPairs[2*int(b)], hexPairs[2*int(b)+1]
}

// hexPairs holds the two lowercase hexadecimal digits of each byte value,
// at twice the value.
const hexPairs = "" +
	"000102030405060708090a0b0c0d0e0f" +
	"101112131415161718191a1b1c1d1e1f" +
	"202122232425262728292a2b2c2d2e2f" +
	"303132333435363738393a3b3c3d3e3f" +
	"404142434445464748494a4b4c4d4e4f" +
	"505152535455565758595a5b5c5d5e5f" +
	"606162636465666768696a6b6c6d6e6f" +
	"707172737475767778797a7b7c7d7e7f" +
	"808182838485868788898a8b8c8d8e8f" +
	"909192939495969798999a9b9c9d9e9f" +
	"a0a1a2a3a4a5a6a7a8a9aaabacadaeaf" +
	"b0b1b2b3b4b5b6b7b8b9babbbcbdbebf" +
	"c0c1c2c3c4c5c6c7c8c9cacbcccdcecf" +
	"d0d1d2d3d4d5d6d7d8d9dadbdcdddedf" +
	"e0e1e2e3e4e5e6e7e8e9eaebecedeeef" +
	"f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff"

// checkKey returns an error unless key can be sent as an idempotency key,
// in an sf-string if structured is set and bare otherwise, and reach the
// server as the same key: one or more printable ASCII characters, which an
// sf-string can hold; sent bare, neither beginning nor ending with a space,
// which a header field's value loses, nor beginning with a double quote,
// which makes a server read the value as an sf-string. Either would make
// the server read another key, perhaps another operation's.
func checkKey(key string, structured bool) error {
	if key == "" {
		return errors.New("idemhttp: empty idempotency key")
	}
	for i := 0; i < len(key); i++ {
		if key[i] < 0x20 || key[i] > 0x7e {
			return fmt.Errorf("idemhttp: idempotency key %q holds a byte outside printable ASCII", key)
		}
	}
	if structured {
		return nil
	}
	if key[0] == ' ' || key[len(key)-1] == ' ' {
		return fmt.Errorf("idemhttp: idempotency key %q begins or ends with a space, which its header field would lose", key)
	}
	if key[0] == '"' {
		return fmt.Errorf("idemhttp: idempotency key %q begins with a double quote, so a server would read it as a Structured Fields string; use WithStructuredKey to send it", key)
	}
	return nil
}

// structuredString encodes s as a Structured Fields sf-string (RFC 9651
// section 3.3.3): quoted, with backslash and double quote escaped.
func structuredString(s string) string { return sfv.Quote(s) }
