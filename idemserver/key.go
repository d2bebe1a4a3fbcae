package idemserver

import (
	"errors"
	"fmt"
	"strings"

	"github.com/idemhttp/idemhttp/internal/sfv"
)

// MaxKeyLen is the longest idempotency key, in characters, that the
// middleware accepts.
const MaxKeyLen = 255

// ErrMalformedKey is returned by [ParseKey] for a header value that is not a
// valid idempotency key. The middleware answers such a request with 400.
var ErrMalformedKey = errors.New("idemserver: malformed idempotency key")

// ParseKey parses the value of an Idempotency-Key header field and returns
// the key it carries.
//
// The value is either a bare key, such as 8e03978e-40d5-43e8-bc93-6894a57f9324,
// or a Structured Fields string (RFC 9651, section 3.3.3) such as
// "8e03978e-40d5-43e8-bc93-6894a57f9324", in which \" and \\ are the only
// escapes. A bare key consists of visible ASCII characters (0x21 to 0x7E)
// other than the double quote and the backslash; a quoted key may also
// contain spaces. Surrounding spaces and tabs are ignored. Either way the key
// is 1 to [MaxKeyLen] characters long after unquoting. Structured Fields
// parameters after the string are not accepted.
//
// Every error wraps [ErrMalformedKey] and says what is wrong.
func ParseKey(value string) (string, error) {
	v := strings.Trim(value, " \t")
	if v == "" {
		return "", fmt.Errorf("%w: empty", ErrMalformedKey)
	}
	if v[0] == '"' {
		return parseQuotedKey(v)
	}
	if len(v) > MaxKeyLen {
		return "", fmt.Errorf("%w: %d characters, limit %d", ErrMalformedKey, len(v), MaxKeyLen)
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c <= ' ' || c >= 0x7f || c == '"' || c == '\\' {
			return "", fmt.Errorf("%w: byte %#02x at offset %d is not allowed in a bare key", ErrMalformedKey, c, i)
		}
	}
	return v, nil
}

// parseQuotedKey parses v, which starts with a double quote, as a Structured
// Fields string.
func parseQuotedKey(v string) (string, error) {
	// The longest acceptable encoding escapes every character.
	if len(v) > 2*MaxKeyLen+2 {
		return "", fmt.Errorf("%w: quoted value of %d bytes is too long", ErrMalformedKey, len(v))
	}
	key, err := sfv.Unquote(v)
	switch {
	case err != nil:
		return "", fmt.Errorf("%w: %v", ErrMalformedKey, err)
	case key == "":
		return "", fmt.Errorf("%w: empty", ErrMalformedKey)
	case len(key) > MaxKeyLen:
		return "", fmt.Errorf("%w: %d characters, limit %d", ErrMalformedKey, len(key), MaxKeyLen)
	}
	return key, nil
}

// FormatKey returns key as a Structured Fields string, the form a client
// should send in the Idempotency-Key header. It does not validate key.
func FormatKey(key string) string { return sfv.Quote(key) }
