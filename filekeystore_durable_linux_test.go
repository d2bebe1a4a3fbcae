package idemhttp

import (
	"context"
	"encoding/binary"
	"errors"
	"io/fs"
	"os"
	"runtime"
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A process killed between the write of a frame and its fsync leaves the
// frame in the page cache, where the next process reads it as if it were
// on disk, and a power loss before the kernel writes it back loses it.
// What the store reads when it opens is what it then acknowledges (Pending
// lists it, Acquire returns its key without writing), so it must be on
// stable storage before the open returns: otherwise a resumed operation
// sends a key that a power loss can still forget, and the attempt after
// the reboot sends a new one.
func TestFileKeyStoreOpenMakesWhatItReadsDurable(t *testing.T) {
	p := buildStore(t, []storeStep{acq("a", "ka", "ka"), acq("b", "kb", "kb")})
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	offs := frameOffsets(t, p)
	lastStart := offs[len(offs)-2]

	// The first frame is on disk; the second was written by a process
	// that died before its fsync.
	v := writeVariant(t, data[:lastStart])
	f, err := os.OpenFile(v, os.O_RDWR, 0)
	require.NoError(t, err)
	require.NoError(t, f.Sync())
	_, err = f.WriteAt(data[lastStart:], lastStart)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	if !fileHasDirtyPages(t, v) {
		t.Skip("the kernel wrote the page back before the store opened; nothing to show")
	}

	s := openTestStore(t, v)
	key, err := s.Acquire(context.Background(), "b", "other")
	require.NoError(t, err)
	require.Equal(t, "kb", key, "the key read from the file is the operation's")
	assert.False(t, fileHasDirtyPages(t, v), "a key the store hands out is on stable storage")
}

// fileHasDirtyPages reports whether any page of the file at path is in the
// page cache with changes not yet written to the disk. It reads the page
// flags the kernel exports to root, and skips the test where it cannot.
func fileHasDirtyPages(t *testing.T, path string) bool {
	t.Helper()
	const kpfDirty = 1 << 4 // KPF_DIRTY, Documentation/admin-guide/mm/pagemap.rst
	kf, err := os.Open("/proc/kpageflags")
	if errors.Is(err, fs.ErrPermission) || errors.Is(err, fs.ErrNotExist) {
		t.Skipf("page flags unreadable: %v", err)
	}
	require.NoError(t, err)
	defer kf.Close()
	pm, err := os.Open("/proc/self/pagemap")
	require.NoError(t, err)
	defer pm.Close()

	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	fi, err := f.Stat()
	require.NoError(t, err)
	m, err := syscall.Mmap(int(f.Fd()), 0, int(fi.Size()), syscall.PROT_READ, syscall.MAP_SHARED)
	require.NoError(t, err)
	defer syscall.Munmap(m)
	require.NoError(t, syscall.Madvise(m, syscall.MADV_WILLNEED))

	ps := os.Getpagesize()
	dirty := false
	var b [8]byte
	var sum byte
	for off := 0; off < len(m); off += ps {
		sum += m[off] // maps the page in, so that pagemap has its frame
		_, err := pm.ReadAt(b[:], int64(uintptr(unsafe.Pointer(&m[off]))/uintptr(ps))*8)
		require.NoError(t, err)
		e := binary.LittleEndian.Uint64(b[:])
		if e>>63 == 0 || e&(1<<55-1) == 0 {
			t.Skipf("page frame numbers unreadable (pagemap entry %#x)", e)
		}
		_, err = kf.ReadAt(b[:], int64(e&(1<<55-1))*8)
		require.NoError(t, err)
		dirty = dirty || binary.LittleEndian.Uint64(b[:])&kpfDirty != 0
	}
	runtime.KeepAlive(sum)
	return dirty
}
