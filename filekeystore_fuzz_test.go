package idemhttp

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// FuzzOpen opens arbitrary file contents as a store, strictly and with
// salvage. Opening must not panic or hang, and whatever an open accepts it
// must leave clean: a second strict open succeeds, repairs nothing and
// lists the same pending keys.
func FuzzOpen(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte("IDEMKEYS"))
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
