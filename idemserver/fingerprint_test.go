package idemserver

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestFingerprintIsUnambiguous(t *testing.T) {
	type req struct{ method, path, query, body string }
	reqs := []req{
		{"POST", "/a", "", ""},
		{"POST", "/a", "", "b"},
		{"POST", "/ab", "", ""},
		{"POST", "/a", "b", ""},
		{"POS", "T/a", "", ""},
		{"POST", "", "/a", ""},
		{"POST", "/a?b", "", ""},
		{"PATCH", "/a", "", ""},
		{"POST", "/a", "x=1&y=2", ""},
		{"POST", "/a", "y=2&x=1", ""},
	}
	seen := map[Fingerprint]req{}
	for _, r := range reqs {
		fp := fingerprint(r.method, r.path, r.query, []byte(r.body))
		if prev, ok := seen[fp]; ok {
			t.Errorf("%+v and %+v share fingerprint %s", prev, r, fp)
		}
		seen[fp] = r
		assert.Equal(t, fp, fingerprint(r.method, r.path, r.query, []byte(r.body)), "deterministic")
		assert.Len(t, fp.String(), 64)
	}
}
