package idemhttp

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestFileKeyStoreCompactionKeepsTheFileMode(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys")
	s := openTestStore(t, path)
	require.NoError(t, os.Chmod(path, 0o640))
	_, err := s.Acquire(context.Background(), "order-1", "k1")
	require.NoError(t, err)

	compactNow(s)
	require.Positive(t, s.compactions)

	fi, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o640), fi.Mode().Perm(), "the compacted file replaced the store with the mode its operator gave it")
}

func TestFileKeyStoreCompactionDoesNotFollowALinkAtItsTemporaryName(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "keys")
	s := openTestStore(t, path)
	_, err := s.Acquire(context.Background(), "order-1", "k1")
	require.NoError(t, err)
	victim := filepath.Join(dir, "victim")
	require.NoError(t, os.WriteFile(victim, []byte("precious"), 0o600))
	require.NoError(t, os.Symlink(victim, path+".compact"))

	compactNow(s)
	require.Positive(t, s.compactions)

	b, err := os.ReadFile(victim)
	require.NoError(t, err)
	assert.Equal(t, "precious", string(b), "the link's target is untouched")
	key, err := s.Acquire(context.Background(), "order-1", "other")
	require.NoError(t, err)
	assert.Equal(t, "k1", key, "the store still holds its pending key")
}
