package idemhttp

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/internal/keylog"
)

// bindMountEnv makes the test binary act as the child of
// TestFileKeyStoreKeepsVersion1InABindMountedFile, in the directory it
// names.
const bindMountEnv = "IDEMHTTP_KEYSTORE_BINDMOUNT"

// A container's volume of one file is a bind mount, over which no file
// can be renamed (EBUSY): a version 1 file mounted so cannot be rewritten
// in the current version, and the store keeps its version rather than
// refuse to open its keys. The mount is made by a child in a mount
// namespace of its own, so that it ends with the child.
func TestFileKeyStoreKeepsVersion1InABindMountedFile(t *testing.T) {
	dir := t.TempDir()
	volume := filepath.Join(dir, "volume")
	require.NoError(t, os.WriteFile(volume, version1File(), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "keys"), nil, 0o600))
	cmd := exec.Command(os.Args[0], "-test.run=^TestKeyStoreBindMountChild$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), bindMountEnv+"="+dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	out, err := cmd.CombinedOutput()
	if errors.Is(err, syscall.EPERM) || strings.Contains(string(out), "cannot bind-mount") {
		t.Skipf("needs the right to make a mount namespace and mount in it: %v %s", err, out)
	}
	require.NoError(t, err, "child: %s", out)
	require.Contains(t, string(out), "kept version 1", "child: %s", out)

	// What the child recorded through the mount is in the volume.
	s := openTestStore(t, volume)
	assert.Equal(t, map[string]string{"a": "ka", "b": "kb", "d": "kd"}, pendingMap(t, s))
}

// TestKeyStoreBindMountChild is the child of
// TestFileKeyStoreKeepsVersion1InABindMountedFile; it does nothing in a
// normal run.
func TestKeyStoreBindMountChild(t *testing.T) {
	dir := os.Getenv(bindMountEnv)
	if dir == "" {
		t.Skip("runs only as a child process")
	}
	keys := filepath.Join(dir, "keys")
	if err := syscall.Mount(filepath.Join(dir, "volume"), keys, "", syscall.MS_BIND, ""); err != nil {
		fmt.Println("cannot bind-mount:", err)
		return
	}
	// A version 1 file that salvage repairs is rewritten, or not opened:
	// its damage must not stay in a file new records are appended to.
	damaged := version1File()
	damaged[len(keylog.V1Header().Append(nil))+keylog.FrameHeaderSize+2] ^= 0xff // in the first frame
	require.NoError(t, os.WriteFile(keys, damaged, 0o600))
	_, err := OpenFileKeyStore(keys, WithSalvage())
	require.Error(t, err, "a repaired version 1 file that cannot be replaced is not opened")
	data, err := os.ReadFile(keys)
	require.NoError(t, err)
	require.Equal(t, damaged, data, "and is left as it was")

	require.NoError(t, os.WriteFile(keys, version1File(), 0o600))
	checkKeepsVersion1(t, keys)
	if !t.Failed() {
		fmt.Println("kept version 1")
	}
}
