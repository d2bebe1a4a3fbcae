package idemhttp

import (
	"net/url"
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
	h.get(u)
	assert.Zero(t, testing.AllocsPerRun(100, func() { h.get(u) }))
}
