package idemhttp

import (
	"crypto/rand"
	"encoding/binary"
	"time"

	"github.com/google/uuid"

	"github.com/idemhttp/idemhttp/internal/sfv"
)

// newUUIDv7 returns a new UUIDv7 string (RFC 9562 section 5.7): 74 random
// bits make it unique, and its leading Unix-millisecond timestamp orders
// keys by time, which keeps servers' key indexes compact. It fills the
// bytes itself rather than calling uuid.NewV7, whose random reader makes the
// UUID escape to the heap: one allocation per request, the string, instead
// of two.
func newUUIDv7() (string, error) {
	var id uuid.UUID
	if _, err := rand.Read(id[:]); err != nil {
		return "", err
	}
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(time.Now().UnixMilli()))
	copy(id[:6], ms[2:])
	id[6] = 0x70 | id[6]&0x0f // version 7
	id[8] = 0x80 | id[8]&0x3f // variant 10 (RFC 9562)
	return id.String(), nil
}

// structuredString encodes s as a Structured Fields sf-string (RFC 9651
// section 3.3.3): quoted, with backslash and double quote escaped.
func structuredString(s string) string { return sfv.Quote(s) }
