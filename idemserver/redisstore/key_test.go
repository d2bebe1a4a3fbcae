package redisstore

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/idemserver"
)

func TestRecordKey(t *testing.T) {
	for _, tt := range []struct {
		name   string
		prefix string
		key    idemserver.Key
		want   string
	}{
		{"no scope", "idem:", idemserver.Key{Key: "k"}, "idem:{:k}"},
		{"scope", "idem:", idemserver.Key{Scope: "tenant", Key: "k"}, "idem:{tenant:k}"},
		{"no prefix", "", idemserver.Key{Scope: "s", Key: "k"}, "{s:k}"},
		{"escaped", "p:", idemserver.Key{Scope: "a:b%{c}", Key: "}{:%"}, "p:{a%3Ab%25%7Bc%7D:%7D%7B%3A%25}"},
		{"bytes kept", "p:", idemserver.Key{Scope: "\x00\xff", Key: "k"}, "p:{\x00\xff:k}"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, recordKey(tt.prefix, tt.key))
		})
	}
}

// FuzzRecordKey checks that two (scope, key) pairs share a Redis key only
// when they are equal, and that the pair is the key's whole hash tag.
func FuzzRecordKey(f *testing.F) {
	f.Add("ab", "c", "a", "bc")
	f.Add("a:b", "c", "a", "b:c")
	f.Add("a%3Ab", "c", "a:b", "c")
	f.Add("}", "{", "", "}{")
	f.Add("", "k", "k", "")
	f.Fuzz(func(t *testing.T, s1, k1, s2, k2 string) {
		a, b := idemserver.Key{Scope: s1, Key: k1}, idemserver.Key{Scope: s2, Key: k2}
		ka, kb := recordKey("idem:", a), recordKey("idem:", b)
		assert.Equal(t, a == b, ka == kb, "%q and %q give %q and %q", a, b, ka, kb)
		assert.Equal(t, ka[len("idem:"):], "{"+hashTag(ka)+"}", "the hash tag of %q", ka)
	})
}

// hashTag returns the part of key that Redis Cluster hashes: what lies
// between the first '{' and the first '}' after it, if not empty.
func hashTag(key string) string {
	i := strings.IndexByte(key, '{')
	if i < 0 {
		return key
	}
	j := strings.IndexByte(key[i+1:], '}')
	if j <= 0 {
		return key
	}
	return key[i+1 : i+1+j]
}

func TestRecordKeyHashTag(t *testing.T) {
	// A key with braces of its own still hashes on the whole pair.
	key := recordKey("idem:", idemserver.Key{Scope: "{t}", Key: "a}b"})
	require.Equal(t, "%7Bt%7D:a%7Db", hashTag(key))
}
