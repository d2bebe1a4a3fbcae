package idemhttp

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/internal/keylog"
)

// FuzzOpen opens arbitrary file contents as a store, strictly and with
// salvage. Opening must not panic or hang, and whatever an open accepts it
// must leave clean: a second strict open succeeds, repairs nothing and
// lists the same pending keys.
func FuzzOpen(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte("IDEMKEYS"))
	// The files under testdata are of version 1; these of the current
	// one, whose salt each run makes anew.
	current := currentVersionFile(f)
	f.Add(current)
	f.Add(current[:len(current)-3])
	f.Add(current[:keylog.HeaderSize])
	f.Add(append(append([]byte(nil), current...), make([]byte, 64)...))
	flipped := append([]byte(nil), current...)
	flipped[keylog.HeaderSize+keylog.FrameHeaderSize+2] ^= 0x20
	f.Add(flipped)
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, opts := range [][]FileOption{nil, {WithSalvage()}} {
			p := filepath.Join(t.TempDir(), "keys")
			require.NoError(t, os.WriteFile(p, data, 0o600))
			s, err := OpenFileKeyStore(p, opts...)
			if err != nil {
				continue
			}
			first := pendingMap(t, s)
			require.NoError(t, s.Close())

			s, err = OpenFileKeyStore(p)
			require.NoError(t, err, "a file an open accepted must open again")
			assert.Equal(t, first, pendingMap(t, s))
			assert.Equal(t, FileRecovery{}, s.Recovery(), "the first open left nothing to repair")
			require.NoError(t, s.Close())
		}
	})
}

// currentVersionFile returns a store file written by this release: three
// frames, one of them a release.
func currentVersionFile(f *testing.F) []byte {
	p := filepath.Join(f.TempDir(), "keys")
	s, err := OpenFileKeyStore(p)
	require.NoError(f, err)
	ctx := context.Background()
	for _, op := range []string{"order-1", "order-2"} {
		_, err := s.Acquire(ctx, op, "0190b2a4-7c1e-7b3a-9c1d-"+op)
		require.NoError(f, err)
	}
	require.NoError(f, s.Release(ctx, "order-1", "0190b2a4-7c1e-7b3a-9c1d-order-1"))
	require.NoError(f, s.Close())
	data, err := os.ReadFile(p)
	require.NoError(f, err)
	return data
}
