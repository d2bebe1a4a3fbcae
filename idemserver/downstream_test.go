package idemserver

import (
	"context"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestKeyFrom(t *testing.T) {
	type seen struct {
		key Key
		ok  bool
	}
	var got []seen
	type otherKey struct{}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k, ok := KeyFrom(r.Context())
		got = append(got, seen{k, ok})
		// Contexts derived from the handler's carry the key too.
		derived, cancel := context.WithCancel(context.WithValue(r.Context(), otherKey{}, 1))
		defer cancel()
		dk, dok := KeyFrom(derived)
		assert.Equal(t, seen{k, ok}, seen{dk, dok})
		assert.Equal(t, 1, derived.Value(otherKey{}))
	})
	mw := Middleware(nil, WithScope(func(r *http.Request) string { return r.Header.Get("X-Tenant") }))(h)

	keyed := newRequest(http.MethodPost, "/x", `"a key"`, "b")
	keyed.Header.Set("X-Tenant", "acme")
	serve(mw, keyed)
	serve(mw, newRequest(http.MethodPost, "/x", "", "b"))  // no key
	serve(mw, newRequest(http.MethodGet, "/x", "k", ""))   // method not keyed
	serve(mw, newRequest(http.MethodPost, "/x", "k", "b")) // claimed
	serve(mw, newRequest(http.MethodPost, "/x", "k", "b")) // replayed: the handler does not run
	assert.Equal(t, []seen{
		{Key{Scope: "acme", Key: "a key"}, true},
		{Key{}, false},
		{Key{}, false},
		{Key{Key: "k"}, true},
	}, got)

	k, ok := KeyFrom(context.Background())
	assert.False(t, ok)
	assert.Zero(t, k)
}

func TestKeyDerive(t *testing.T) {
	k := Key{Scope: "tenant-42", Key: "order-1234"}
	d := k.Derive("charge")
	assert.Equal(t, d, k.Derive("charge"), "deterministic")
	// SHA-256 of the domain, then each part after its uvarint length.
	assert.Equal(t, "3Q4mnb5idbXSQsZ6jo1_RmMJMd--uJUnqO8HfQW_ynU", d, "stable across versions")
	parsed, err := ParseKey(d)
	require.NoError(t, err, "a valid key")
	assert.Equal(t, d, parsed)

	// Keys that a concatenation of scope, key and label would confuse are
	// all different.
	long := string(make([]byte, MaxKeyLen))
	keys := []struct {
		k     Key
		label string
	}{
		{Key{}, ""},
		{Key{Key: "a"}, ""},
		{Key{Scope: "a"}, ""},
		{Key{}, "a"},
		{Key{Scope: "a", Key: "bc"}, ""},
		{Key{Scope: "ab", Key: "c"}, ""},
		{Key{Key: "ab"}, "c"},
		{Key{Key: "a"}, "bc"},
		{Key{Key: "a:b"}, "c"},
		{Key{Key: "a"}, "b:c"},
		{Key{Key: "a\x01"}, "b"},
		{Key{Key: "a"}, "\x01b"},
		{Key{Scope: "x", Key: "a"}, "charge"},
		{Key{Scope: "y", Key: "a"}, "charge"},
		{Key{Scope: "x", Key: "a"}, "refund"},
		{Key{Key: long}, long},
		{Key{Key: long + "a"}, long},
	}
	seen := make(map[string]int, len(keys))
	for i, c := range keys {
		d := c.k.Derive(c.label)
		if j, dup := seen[d]; dup {
			t.Errorf("%+v %q and %+v %q derive the same key", keys[j].k, keys[j].label, c.k, c.label)
		}
		seen[d] = i
		_, err := ParseKey(d)
		assert.NoError(t, err)
		assert.Len(t, d, 43)
	}
}
