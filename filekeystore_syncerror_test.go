package idemhttp

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// withFailingSync makes the store's fsyncs of written frames fail while
// *fail is true, after doing nothing: the frame is in the page cache, as
// after a real fsync error that left its pages marked clean.
func withFailingSync(fail *atomic.Bool) FileOption {
	return func(c *fileConfig) {
		c.sync = func(f *os.File) error {
			if fail.Load() {
				return errors.New("injected fsync failure")
			}
			return f.Sync()
		}
	}
}

// A frame whose fsync failed may still be read back by a reopen in the
// same boot (Linux keeps its pages, marked clean), and its keys would be
// handed out as durable although their Acquire failed and a power loss
// can still forget them: an operation resumed from Pending would send a
// key that the next boot no longer knows, and its retry a new one. The
// store cuts the frame off when its write fails.
func TestFileKeyStoreFailedSyncLeavesNoRecord(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "keys")
	var fail atomic.Bool
	s, err := OpenFileKeyStore(path, withFailingSync(&fail))
	require.NoError(t, err)
	kept, err := s.Acquire(ctx, "kept", "k-kept")
	require.NoError(t, err)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	durable := fi.Size()

	fail.Store(true)
	_, err = s.Acquire(ctx, "failed", "k-failed")
	require.Error(t, err)
	_, err = s.Acquire(ctx, "later", "k-later")
	require.Error(t, err, "a store whose write failed refuses until reopened")
	require.Error(t, s.Close())

	fi, err = os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, durable, fi.Size(), "the frame whose fsync failed is cut off")

	s, err = OpenFileKeyStore(path)
	require.NoError(t, err)
	defer s.Close()
	pending, err := s.Pending(ctx)
	require.NoError(t, err)
	var ops []string
	for _, p := range pending {
		ops = append(ops, p.Operation)
		if p.Operation == "kept" {
			assert.Equal(t, kept, p.Key)
		}
	}
	assert.Equal(t, []string{"kept"}, ops)
	assert.Zero(t, s.Recovery().TrimmedBytes, "nothing torn is left to trim")
}
