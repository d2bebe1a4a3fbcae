package idemhttp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/internal/keylog"
)

// Test-only options for knobs that are not part of the API.

func withCompactMinSize(n int64) FileOption {
	return func(c *fileConfig) { c.compactMinSize = n }
}

func withSyncEachOp() FileOption {
	return func(c *fileConfig) { c.syncEachOp = true }
}

// openTestStore opens a store that is closed when the test ends.
func openTestStore(t testing.TB, path string, opts ...FileOption) *FileKeyStore {
	t.Helper()
	s, err := OpenFileKeyStore(path, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

// pendingMap lists the pending keys of s by operation.
func pendingMap(t testing.TB, s KeyStore) map[string]string {
	t.Helper()
	ps, err := s.Pending(context.Background())
	require.NoError(t, err)
	m := make(map[string]string, len(ps))
	for _, p := range ps {
		m[p.Operation] = p.Key
	}
	return m
}

// reopen closes s and opens its file again.
func reopen(t testing.TB, s *FileKeyStore, opts ...FileOption) *FileKeyStore {
	t.Helper()
	require.NoError(t, s.Close())
	return openTestStore(t, s.Path(), opts...)
}

type storeStep struct {
	release bool
	op, key string
	want    string // key Acquire must return
}

func acq(op, key, want string) storeStep { return storeStep{op: op, key: key, want: want} }
func rel(op, key string) storeStep       { return storeStep{release: true, op: op, key: key} }

func TestFileKeyStoreAcquireRelease(t *testing.T) {
	tests := []struct {
		name    string
		steps   []storeStep
		pending map[string]string
	}{
		{"new key recorded", []storeStep{acq("a", "k1", "k1")}, map[string]string{"a": "k1"}},
		{"pending key wins over candidate", []storeStep{acq("a", "k1", "k1"), acq("a", "k2", "k1")}, map[string]string{"a": "k1"}},
		{"release forgets", []storeStep{acq("a", "k1", "k1"), rel("a", "k1")}, map[string]string{}},
		{"new key after release", []storeStep{acq("a", "k1", "k1"), rel("a", "k1"), acq("a", "k2", "k2")}, map[string]string{"a": "k2"}},
		{"release of another key is ignored", []storeStep{acq("a", "k1", "k1"), rel("a", "old")}, map[string]string{"a": "k1"}},
		{"release of unknown operation", []storeStep{rel("zzz", "k")}, map[string]string{}},
		{"operations are independent", []storeStep{acq("a", "k1", "k1"), acq("b", "k2", "k2"), rel("a", "k1")}, map[string]string{"b": "k2"}},
		{"longest id", []storeStep{acq(strings.Repeat("x", MaxOperationIDLen), "k", "k")}, map[string]string{strings.Repeat("x", MaxOperationIDLen): "k"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s := openTestStore(t, filepath.Join(t.TempDir(), "keys"))
			for _, st := range tt.steps {
				if st.release {
					require.NoError(t, s.Release(ctx, st.op, st.key))
					continue
				}
				got, err := s.Acquire(ctx, st.op, st.key)
				require.NoError(t, err)
				assert.Equal(t, st.want, got, "Acquire(%q, %q)", st.op, st.key)
			}
			assert.Equal(t, tt.pending, pendingMap(t, s), "before reopen")
			s = reopen(t, s)
			assert.Equal(t, tt.pending, pendingMap(t, s), "after reopen")
			assert.Equal(t, FileRecovery{}, s.Recovery())
		})
	}
}

func TestFileKeyStoreInvalidCalls(t *testing.T) {
	ctx := context.Background()
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	long := strings.Repeat("x", MaxOperationIDLen+1)
	s := openTestStore(t, filepath.Join(t.TempDir(), "keys"))
	tests := []struct {
		name string
		call func() error
		want error // nil: any error whose text contains text
		text string
	}{
		{"empty operation", func() error { _, err := s.Acquire(ctx, "", "k"); return err }, ErrInvalidOperation, ""},
		{"oversized operation", func() error { _, err := s.Acquire(ctx, long, "k"); return err }, ErrInvalidOperation, ""},
		{"release empty operation", func() error { return s.Release(ctx, "", "k") }, ErrInvalidOperation, ""},
		{"empty key", func() error { _, err := s.Acquire(ctx, "a", ""); return err }, nil, "must be 1 to 1024 bytes"},
		{"oversized key", func() error { _, err := s.Acquire(ctx, "a", strings.Repeat("k", 1025)); return err }, nil, "must be 1 to 1024 bytes"},
		{"cancelled acquire", func() error { _, err := s.Acquire(cancelled, "a", "k"); return err }, context.Canceled, ""},
		{"cancelled release", func() error { return s.Release(cancelled, "a", "k") }, context.Canceled, ""},
		{"cancelled pending", func() error { _, err := s.Pending(cancelled); return err }, context.Canceled, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			require.Error(t, err)
			if tt.want != nil {
				assert.ErrorIs(t, err, tt.want)
			}
			assert.Contains(t, err.Error(), tt.text)
		})
	}
	assert.Empty(t, pendingMap(t, s), "failed calls record nothing")
}

func TestFileKeyStoreClosed(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t, filepath.Join(t.TempDir(), "keys"))
	_, err := s.Acquire(ctx, "a", "k")
	require.NoError(t, err)
	require.NoError(t, s.Close())
	assert.NoError(t, s.Close(), "second Close")

	_, err = s.Acquire(ctx, "b", "k")
	assert.ErrorIs(t, err, ErrStoreClosed)
	assert.ErrorIs(t, s.Release(ctx, "a", "k"), ErrStoreClosed)
	_, err = s.Pending(ctx)
	assert.ErrorIs(t, err, ErrStoreClosed)
}

func TestOpenFileKeyStoreErrors(t *testing.T) {
	header := newHeaderBytes(t)
	badVersion := append([]byte(nil), header...)
	badVersion[8] = 9
	tests := []struct {
		name    string
		setup   func(t *testing.T, dir string) string // returns the path to open
		want    error
		text    string
		keepRaw bool // the file must be left as it was
	}{
		{"path is a directory", func(t *testing.T, dir string) string { return dir }, nil, "is a directory", false},
		{"parent is a file", func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "f")
			require.NoError(t, os.WriteFile(p, nil, 0o600))
			return filepath.Join(p, "keys")
		}, nil, "not a directory", false},
		{"missing parent", func(t *testing.T, dir string) string { return filepath.Join(dir, "no", "keys") }, os.ErrNotExist, "", false},
		{"not a key store", func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "keys")
			require.NoError(t, os.WriteFile(p, []byte("some other program's data, longer than a header"), 0o600))
			return p
		}, ErrStoreCorrupt, "not an idemhttp key store", true},
		{"short foreign file", func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "keys")
			require.NoError(t, os.WriteFile(p, []byte("hello"), 0o600))
			return p
		}, ErrStoreCorrupt, "not an idemhttp key store", true},
		{"short foreign file starting with zeros", func(t *testing.T, dir string) string {
			// Only a header's first 12 bytes are the same in every file;
			// a file that does not start with them is no header torn
			// after them, however short.
			p := filepath.Join(dir, "keys")
			require.NoError(t, os.WriteFile(p, append(make([]byte, 12), "payroll"...), 0o600))
			return p
		}, ErrStoreCorrupt, "not an idemhttp key store", true},
		{"short foreign file starting as a header", func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "keys")
			require.NoError(t, os.WriteFile(p, append([]byte("IDEM\x00\x00\x00\x00\x00\x00\x00\x00"), "payroll"...), 0o600))
			return p
		}, ErrStoreCorrupt, "not an idemhttp key store", true},
		{"future version", func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "keys")
			require.NoError(t, os.WriteFile(p, badVersion, 0o600))
			return p
		}, nil, "header checksum", true},
		{"unknown flags", func(t *testing.T, dir string) string {
			// A later release that marks its files with a flag this one
			// does not know must not have them read as plain version 1.
			p := filepath.Join(dir, "keys")
			h := append([]byte(nil), header...)
			h[10] = 1
			keylogPutHeaderCRC(h)
			require.NoError(t, os.WriteFile(p, h, 0o600))
			return p
		}, nil, "unsupported format flags 0x0001", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.setup(t, t.TempDir())
			before, _ := os.ReadFile(p)
			s, err := OpenFileKeyStore(p)
			require.Error(t, err)
			assert.Nil(t, s)
			if tt.want != nil {
				assert.ErrorIs(t, err, tt.want)
			}
			assert.Contains(t, err.Error(), tt.text)
			if tt.keepRaw {
				after, _ := os.ReadFile(p)
				assert.Equal(t, before, after, "the file was modified")
			}
		})
	}
}

func TestOpenFileKeyStoreReadOnlyDirectory(t *testing.T) {
	if os.Geteuid() == 0 || runtime.GOOS == "windows" {
		t.Skip("needs a user that permissions apply to")
	}
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o500))
	t.Cleanup(func() { os.Chmod(dir, 0o700) })
	p := filepath.Join(dir, "keys")
	_, err := OpenFileKeyStore(p)
	require.ErrorIs(t, err, os.ErrPermission)
	assert.Contains(t, err.Error(), p)
}

func TestOpenFileKeyStoreUnsupportedVersion(t *testing.T) {
	// A well-formed header of a later version, laid out as version 2's.
	h := newHeaderBytes(t)
	h[8] = 3
	keylogPutHeaderCRC(h)
	p := filepath.Join(t.TempDir(), "keys")
	require.NoError(t, os.WriteFile(p, h, 0o600))
	_, err := OpenFileKeyStore(p)
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrStoreCorrupt)
	assert.Contains(t, err.Error(), "unsupported format version 3")
	after, err := os.ReadFile(p)
	require.NoError(t, err)
	assert.Equal(t, h, after, "the file is left as it was")
}

// newHeaderBytes returns the header of a new store file.
func newHeaderBytes(t *testing.T) []byte {
	t.Helper()
	h, err := keylog.NewHeader()
	require.NoError(t, err)
	return h.Append(nil)
}

// keylogPutHeaderCRC fills in the checksum of a file header, its last 4
// bytes.
func keylogPutHeaderCRC(h []byte) {
	n := len(h) - 4
	binary.LittleEndian.PutUint32(h[n:], crc32.Checksum(h[:n], crc32.MakeTable(crc32.Castagnoli)))
}

// headersOfEachVersion returns a header of each version a store reads,
// by name: the current one, and version 1, which an earlier release may
// have left half written.
func headersOfEachVersion(t *testing.T) map[string][]byte {
	return map[string][]byte{"current": newHeaderBytes(t), "v1": keylog.V1Header().Append(nil)}
}

func TestFileKeyStoreCreatesTornHeader(t *testing.T) {
	// A crash while the file is being created can leave the start of its
	// header (size n), or the header's extent allocated but unwritten,
	// which some file systems show as zeros: the start of the header, then
	// zeros, no longer than a header. Nothing was ever stored in such a
	// file, so it is created afresh.
	for version, header := range headersOfEachVersion(t) {
		for n := 0; n < len(header); n++ {
			for _, size := range slices.Compact([]int{n, n + 1, len(header)}) {
				t.Run(fmt.Sprintf("%s/%d header bytes of %d", version, n, size), func(t *testing.T) {
					p := filepath.Join(t.TempDir(), "keys")
					b := append(append([]byte(nil), header[:n]...), make([]byte, size-n)...)
					require.NoError(t, os.WriteFile(p, b, 0o600))
					s := openTestStore(t, p)
					_, err := s.Acquire(context.Background(), "a", "k")
					require.NoError(t, err)
					s = reopen(t, s)
					assert.Equal(t, map[string]string{"a": "k"}, pendingMap(t, s))
				})
			}
		}
	}
}

func TestFileKeyStoreRefusesZerosPastAHeader(t *testing.T) {
	// Past a header's length, the header was made durable before anything
	// was appended: zeros there are damage, and the store refuses it
	// rather than start afresh over records it cannot read.
	p := filepath.Join(t.TempDir(), "keys")
	b := make([]byte, keylog.HeaderSize+1)
	require.NoError(t, os.WriteFile(p, b, 0o600))
	_, err := OpenFileKeyStore(p)
	require.ErrorIs(t, err, ErrStoreCorrupt)
	after, err := os.ReadFile(p)
	require.NoError(t, err)
	assert.Equal(t, b, after, "the file is left as it was")
}

func TestFileKeyStoreLockedInProcess(t *testing.T) {
	p := filepath.Join(t.TempDir(), "keys")
	s := openTestStore(t, p)
	_, err := OpenFileKeyStore(p)
	require.ErrorIs(t, err, ErrStoreLocked)
	assert.Contains(t, err.Error(), p)

	require.NoError(t, s.Close())
	s2, err := OpenFileKeyStore(p)
	require.NoError(t, err, "Close releases the lock")
	require.NoError(t, s2.Close())
}

func TestFileKeyStoreLockedAcrossProcesses(t *testing.T) {
	if !crossProcessLocking {
		t.Skip("this platform locks only within the process")
	}
	p := filepath.Join(t.TempDir(), "keys")
	s := openTestStore(t, p)
	assert.Equal(t, "locked", runChild(t, "lock", p), "while this process holds the store")
	require.NoError(t, s.Close())
	assert.Equal(t, "opened", runChild(t, "lock", p), "after Close")
}

// childEnv makes the test binary act as a child process of a test.
const childEnv = "IDEMHTTP_KEYSTORE_CHILD"

// runChild runs the test binary as a child in mode on path and returns what
// it printed.
func runChild(t *testing.T, mode, path string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestKeyStoreChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), childEnv+"="+mode+":"+path)
	out, err := cmd.Output()
	require.NoError(t, err, "child: %s", out)
	return strings.TrimSpace(string(out))
}

// TestKeyStoreChild is the child process of the multi-process tests; it
// does nothing in a normal run.
func TestKeyStoreChild(t *testing.T) {
	mode, path, ok := strings.Cut(os.Getenv(childEnv), ":")
	if !ok {
		t.Skip("runs only as a child process")
	}
	switch mode {
	case "lock":
		s, err := OpenFileKeyStore(path)
		switch {
		case errors.Is(err, ErrStoreLocked):
			fmt.Println("locked")
		case err != nil:
			fmt.Println("error:", err)
		default:
			s.Close()
			fmt.Println("opened")
		}
	case "crash":
		crashChild(path)
	case "upgrade":
		upgradeChild(path)
	case "restart-a", "restart-b":
		restartChild(mode, path)
	case "hold", "hold-slow":
		holdChild(mode, path)
	default:
		fmt.Println("unknown mode", mode)
	}
	os.Exit(0)
}

func TestFileKeyStorePendingOrderAndStale(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		p := filepath.Join(t.TempDir(), "keys")
		s, err := OpenFileKeyStore(p, WithStaleAfter(90*time.Minute))
		require.NoError(t, err)
		start := time.Now()
		for _, op := range []string{"c-first", "a-second", "b-third"} {
			_, err := s.Acquire(ctx, op, "key-"+op)
			require.NoError(t, err)
			time.Sleep(time.Hour)
		}
		// Now: c-first is 3h old, a-second 2h, b-third 1h.
		want := []PendingOperation{
			{Operation: "c-first", Key: "key-c-first", Created: start, Stale: true},
			{Operation: "a-second", Key: "key-a-second", Created: start.Add(time.Hour), Stale: true},
			{Operation: "b-third", Key: "key-b-third", Created: start.Add(2 * time.Hour), Stale: false},
		}
		assertPending(t, want, s)
		require.NoError(t, s.Close())

		s, err = OpenFileKeyStore(p, WithStaleAfter(90*time.Minute))
		require.NoError(t, err)
		assertPending(t, want, s)
		require.NoError(t, s.Close())

		s, err = OpenFileKeyStore(p)
		require.NoError(t, err)
		ps, err := s.Pending(ctx)
		require.NoError(t, err)
		for _, p := range ps {
			assert.False(t, p.Stale, "no max age, nothing stale: %s", p.Operation)
		}
		require.NoError(t, s.Close())
	})
}

func TestMemoryKeyStoreStale(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		s := &MemoryKeyStore{StaleAfter: 90 * time.Minute}
		start := time.Now()
		for _, op := range []string{"b", "a"} {
			_, err := s.Acquire(ctx, op, "key-"+op)
			require.NoError(t, err)
			time.Sleep(time.Hour)
		}
		assertPending(t, []PendingOperation{
			{Operation: "b", Key: "key-b", Created: start, Stale: true},
			{Operation: "a", Key: "key-a", Created: start.Add(time.Hour)},
		}, s)
	})
}

func assertPending(t *testing.T, want []PendingOperation, s KeyStore) {
	t.Helper()
	got, err := s.Pending(context.Background())
	require.NoError(t, err)
	require.Len(t, got, len(want))
	for i := range want {
		assert.Equal(t, want[i].Operation, got[i].Operation, "operation %d", i)
		assert.Equal(t, want[i].Key, got[i].Key, "key %d", i)
		assert.True(t, want[i].Created.Equal(got[i].Created), "created %d: want %v, got %v", i, want[i].Created, got[i].Created)
		assert.Equal(t, want[i].Stale, got[i].Stale, "stale %d", i)
	}
}

// holdFlusher makes s's file busy, as a long fsync would, until the
// returned function is called.
func holdFlusher(s *FileKeyStore) (release func()) {
	s.mu.Lock()
	s.acquireFlusherLocked()
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		s.releaseFlusherLocked()
		s.mu.Unlock()
	}
}

// waitQueued waits until n records wait in s's queue.
func waitQueued(s *FileKeyStore, n int) {
	for {
		s.mu.Lock()
		q := len(s.qmeta)
		s.mu.Unlock()
		if q >= n {
			return
		}
		runtime.Gosched()
	}
}

func frameCount(t *testing.T, path string) int {
	t.Helper()
	return len(frameOffsets(t, path)) - 1
}

// frameOffsets lists the offsets at which the frames of the store file at
// path start, followed by the file size.
func frameOffsets(t *testing.T, path string) []int64 {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	fi, err := f.Stat()
	require.NoError(t, err)
	hdr := make([]byte, keylog.HeaderSize)
	n, err := f.ReadAt(hdr, 0)
	require.True(t, err == nil || errors.Is(err, io.EOF), "%v", err)
	h, err := keylog.ReadHeader(hdr[:n])
	require.NoError(t, err)
	sc := keylog.NewScanner(f, fi.Size(), h)
	var offs []int64
	for {
		off, _, err := sc.Next()
		offs = append(offs, off)
		if errors.Is(err, io.EOF) {
			return offs
		}
		require.NoError(t, err)
	}
}

// queueBehindFlusher makes n calls while the file is busy, so that they all
// queue, then lets them through and returns their errors.
func queueBehindFlusher(s *FileKeyStore, n int, call func(i int) error) []error {
	release := holdFlusher(s)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { errs[i] = call(i) })
	}
	waitQueued(s, n)
	release()
	wg.Wait()
	return errs
}

// abandonAcquire queues an Acquire behind a busy flusher and cancels it.
// The file stays busy until release is called.
func abandonAcquire(t *testing.T, s *FileKeyStore, op, key string) (release func()) {
	t.Helper()
	release = holdFlusher(s)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() {
		_, err := s.Acquire(ctx, op, key)
		done <- err
	}()
	waitQueued(s, 1)
	cancel()
	assert.ErrorIs(t, <-done, context.Canceled)
	return release
}

func TestFileKeyStoreCommits(t *testing.T) {
	const callers = 64
	tests := []struct {
		name   string
		opts   []FileOption
		frames int
	}{
		{"group commit: one write and fsync for all", nil, 1},
		{"fsync per op: one each", []FileOption{withSyncEachOp()}, callers},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "keys")
			s := openTestStore(t, p, tt.opts...)
			errs := queueBehindFlusher(s, callers, func(i int) error {
				_, err := s.Acquire(context.Background(), fmt.Sprint("op-", i), fmt.Sprint("key-", i))
				return err
			})
			for i, err := range errs {
				require.NoError(t, err, "caller %d", i)
			}
			require.NoError(t, s.Close())
			assert.Equal(t, tt.frames, frameCount(t, p))
		})
	}
}

func TestFileKeyStoreCancelWhileWaiting(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t, filepath.Join(t.TempDir(), "keys"))
	release := abandonAcquire(t, s, "a", "k1")
	assert.Empty(t, pendingMap(t, s), "not durable, not listed")
	release()

	key, err := s.Acquire(ctx, "a", "k2")
	require.NoError(t, err)
	assert.Equal(t, "k1", key, "the cancelled call's key was recorded and is reused")
	s = reopen(t, s)
	assert.Equal(t, map[string]string{"a": "k1"}, pendingMap(t, s))
}

func TestFileKeyStoreCloseFlushesQueue(t *testing.T) {
	p := filepath.Join(t.TempDir(), "keys")
	s := openTestStore(t, p)
	abandonAcquire(t, s, "a", "k")()
	require.NoError(t, s.Close())
	s = openTestStore(t, p)
	assert.Equal(t, map[string]string{"a": "k"}, pendingMap(t, s), "Close wrote the abandoned record")
}
