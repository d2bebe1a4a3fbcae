package redisstore

import (
	"slices"
	"strings"

	"github.com/idemhttp/idemhttp/idemserver"
)

// recordKey returns the Redis key of k's record under prefix:
//
//	prefix "{" escape(scope) ":" escape(key) "}"
//
// escape replaces '%', ':', '{' and '}' with %25, %3A, %7B and %7D, so the
// separator ':' appears only between the two, and no two (scope, key) pairs
// share a Redis key. Since no brace is left inside them, the braces make
// the whole pair the key's hash tag: Redis Cluster then hashes on the pair
// alone, whatever the prefix (unless the prefix has a tag of its own).
func recordKey(prefix string, k idemserver.Key) string {
	return string(appendRecordKey(nil, prefix, k))
}

// appendRecordKey appends the Redis key of k's record under prefix (see
// recordKey) to dst, and returns the extended slice.
func appendRecordKey(dst []byte, prefix string, k idemserver.Key) []byte {
	n := len(prefix) + len(k.Scope) + len(k.Key) + 3
	plain := !strings.ContainsAny(k.Scope, escaped) && !strings.ContainsAny(k.Key, escaped)
	if !plain {
		n += 2 * (count(k.Scope) + count(k.Key))
	}
	dst = slices.Grow(dst, n)
	dst = append(dst, prefix...)
	dst = append(dst, '{')
	dst = appendEscaped(dst, k.Scope, plain)
	dst = append(dst, ':')
	dst = appendEscaped(dst, k.Key, plain)
	return append(dst, '}')
}

// escaped holds the bytes recordKey escapes.
const escaped = "%:{}"

const hexDigits = "0123456789ABCDEF"

func appendEscaped(dst []byte, s string, plain bool) []byte {
	if plain {
		return append(dst, s...)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if strings.IndexByte(escaped, c) < 0 {
			dst = append(dst, c)
			continue
		}
		dst = append(dst, '%', hexDigits[c>>4], hexDigits[c&15])
	}
	return dst
}

// count returns how many bytes of s recordKey escapes.
func count(s string) int {
	n := 0
	for i := 0; i < len(s); i++ {
		if strings.IndexByte(escaped, s[i]) >= 0 {
			n++
		}
	}
	return n
}
