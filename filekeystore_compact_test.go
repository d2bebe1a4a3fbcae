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

// A store opened through a symbolic link is the file the link names: a
// compaction replaces that file, not the link. Replacing the link would
// leave the file it named behind, unlocked and out of date, where a
// second store opened by the file's own name would run beside this one,
// and neither would see the other's keys.
func TestFileKeyStoreCompactionThroughASymbolicLinkReplacesItsTarget(t *testing.T) {
	dir := t.TempDir()
	real := filepath.Join(dir, "real")
	link := filepath.Join(dir, "keys")
	require.NoError(t, os.Symlink("real", link))
	ctx := context.Background()
	s := openTestStore(t, link)
	_, err := s.Acquire(ctx, "order-1", "k1")
	require.NoError(t, err)
	require.NoError(t, s.Release(ctx, "order-1", "k1"))

	compactNow(s)
	require.Positive(t, s.compactions)
	_, err = s.Acquire(ctx, "order-2", "k2")
	require.NoError(t, err)

	fi, err := os.Lstat(link)
	require.NoError(t, err)
	assert.Equal(t, os.ModeSymlink, fi.Mode().Type(), "the link is still a link")
	if crossProcessLocking {
		_, err = OpenFileKeyStore(real)
		require.ErrorIs(t, err, ErrStoreLocked, "the file the link names is the store, and is locked")
	}
	require.NoError(t, s.Close())
	s = openTestStore(t, real)
	assert.Equal(t, map[string]string{"order-2": "k2"}, pendingMap(t, s))
}
