package idemhttp

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNewUUIDv7(t *testing.T) {
	before := time.Now().UnixMilli()
	seen := make(map[string]bool)
	for range 10000 {
		s, err := newUUIDv7()
		require.NoError(t, err)
		require.False(t, seen[s], "duplicate key %s", s)
		seen[s] = true
	}
	after := time.Now().UnixMilli()

	for s := range seen {
		id, err := uuid.Parse(s)
		require.NoError(t, err)
		assert.Equal(t, uuid.Version(7), id.Version())
		assert.Equal(t, uuid.RFC4122, id.Variant())
		sec, nsec := id.Time().UnixTime()
		ms := sec*1000 + nsec/1e6
		assert.True(t, ms >= before && ms <= after, "timestamp %d outside [%d, %d]", ms, before, after)
	}
}

func TestNewUUIDv7AllocatesOnlyTheString(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under the race detector")
	}
	allocs := testing.AllocsPerRun(100, func() { _, _ = newUUIDv7() })
	assert.Equal(t, 1.0, allocs)
}
