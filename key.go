package idemhttp

import (
	"github.com/google/uuid"

	"github.com/idemhttp/idemhttp/internal/sfv"
)

// newUUIDv7 returns a new UUIDv7 string: random enough to be unique, and
// time-ordered, which keeps servers' key indexes compact.
func newUUIDv7() (string, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return "", err
	}
	return id.String(), nil
}

// structuredString encodes s as a Structured Fields sf-string (RFC 9651
// section 3.3.3): quoted, with backslash and double quote escaped.
func structuredString(s string) string { return sfv.Quote(s) }
