package idemserver

import (
	"context"
	"net/http"
	"strings"
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

// TestFingerprintStable pins the fingerprints the middleware takes of
// requests without a parsed form, whose records earlier releases stored:
// a retry of one after an upgrade must still match. A form parsed in front
// that holds nothing (ParseForm reads no multipart body, nor the body of a
// method it does not parse) leaves the fingerprint as it was.
func TestFingerprintStable(t *testing.T) {
	const small, large = "6087b32ec8e7b69c9739149a67a08268170e9d9a328974bdd5f55cce7d75ae30",
		"a152141d77d20de10a73bd22c77b18d32f3b53926c8757937954a87d17efc4b5"
	long := strings.Repeat("x", 2000)
	parse := func(r *http.Request) { _ = r.ParseForm() }
	for _, tt := range []struct {
		name, method, target, body, contentType string
		front                                   func(*http.Request)
		want                                    string
	}{
		{"small body", "POST", "/charges?a=1", "amount=10", "", nil, small},
		{"large body", "POST", "/charges", long, "", nil, large},
		{"form of a lower-case method, not parsed", "post", "/charges", "amount=10", "application/x-www-form-urlencoded", parse,
			"27a2cd5087758cebb852750e6e3c9e4cc192ef01c6fca79377cadf4ae8f48fd4"},
		{"multipart body ParseForm leaves", "POST", "/charges", long, "multipart/form-data; boundary=b", parse, large},
		{"query parsed, body not a form", "POST", "/charges?a=1", "amount=10", "text/plain", parse, small},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var got Fingerprint
			store := newStubStore()
			store.claim = func(ctx context.Context, c Claim) (ClaimResult, error) {
				got = c.Fingerprint
				return store.MemoryStore.Claim(ctx, c)
			}
			h := Middleware(store)(&countingHandler{})
			r := newRequest(tt.method, tt.target, "k", tt.body)
			if tt.contentType != "" {
				r.Header.Set("Content-Type", tt.contentType)
			}
			if tt.front != nil {
				tt.front(r)
			}
			serve(h, r)
			assert.Equal(t, tt.want, got.String())
		})
	}
}
