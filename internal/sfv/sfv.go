// Package sfv encodes and decodes the Structured Field Values string type
// (sf-string, RFC 9651 section 3.3.3), the quoted form of an
// Idempotency-Key header.
package sfv

import (
	"errors"
	"fmt"
	"strings"
)

// Quote returns s as an sf-string: in double quotes, with every double
// quote and backslash escaped by a backslash. It does not check that s
// holds only printable ASCII, which an sf-string requires.
func Quote(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 2)
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		if s[i] == '"' || s[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	b.WriteByte('"')
	return b.String()
}

// Unquote parses v, the whole of which must be one sf-string, and returns
// the string it holds. Only printable ASCII (0x20 to 0x7E) may appear, and
// \" and \\ are the only escapes. Nothing may follow the closing quote,
// parameters included.
func Unquote(v string) (string, error) {
	if v == "" || v[0] != '"' {
		return "", errors.New("missing opening quote")
	}
	var b strings.Builder
	escaped := false
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			i++
			if i == len(v) {
				return "", errors.New("unterminated escape")
			}
			if v[i] != '"' && v[i] != '\\' {
				return "", fmt.Errorf("invalid escape \\%c", v[i])
			}
			if !escaped {
				escaped = true
				b.Grow(len(v))
				b.WriteString(v[1 : i-1])
			}
			b.WriteByte(v[i])
		case c == '"':
			if i != len(v)-1 {
				return "", errors.New("text after the closing quote")
			}
			if escaped {
				return b.String(), nil
			}
			return v[1:i], nil
		case c < ' ' || c >= 0x7f:
			return "", fmt.Errorf("byte %#02x at offset %d is not printable ASCII", c, i)
		default:
			if escaped {
				b.WriteByte(c)
			}
		}
	}
	return "", errors.New("missing closing quote")
}
