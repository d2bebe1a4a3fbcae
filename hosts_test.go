package idemhttp

import (
	"net/url"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestHostKeysMatchHostKeyAndStayBounded(t *testing.T) {
	h := newHostKeys(3)
	for _, raw := range []string{
		"http://a.example/x", "http://a.example:80/y", "HTTPS://A.Example/", "https://a.example:8443/",
		"http://[::1]:9000/", "http://a.example/x", "https://b.example/?q=1",
	} {
		u, err := url.Parse(raw)
		require.NoError(t, err)
		assert.Equal(t, hostKey(u), h.get(u), raw)
		assert.Equal(t, hostKey(u), h.get(u), raw+" (remembered)")
		assert.LessOrEqual(t, len(h.m), 3)
	}
}

func TestHostKeysRememberedWithoutAllocating(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under the race detector")
	}
	h := newHostKeys(8)
	u, err := url.Parse("https://api.example.com/v1/charges")
	require.NoError(t, err)
	v, err := url.Parse("https://b.example.com/")
	require.NoError(t, err)
	h.get(u)
	h.get(v)
	assert.Zero(t, testing.AllocsPerRun(100, func() { h.get(u) }), "the last host")
	assert.Zero(t, testing.AllocsPerRun(100, func() { h.get(u); h.get(v) }), "hosts in turn")
}

// Goroutines on different hosts share the last-host entry: each gets its
// own host's key however their lookups interleave.
func TestHostKeysConcurrent(t *testing.T) {
	h := newHostKeys(2) // smaller than the hosts used: the map starts afresh often
	var urls []*url.URL
	for _, raw := range []string{"http://a.example/", "https://a.example/", "http://a.example:81/", "http://b.example/"} {
		u, err := url.Parse(raw)
		require.NoError(t, err)
		urls = append(urls, u)
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 2000 {
				u := urls[(g+i)%len(urls)]
				if got := h.get(u); got != hostKey(u) {
					t.Errorf("get(%s) = %s, want %s", u, got, hostKey(u))
					return
				}
			}
		})
	}
	wg.Wait()
}
