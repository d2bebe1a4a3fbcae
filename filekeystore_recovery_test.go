package idemhttp

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhttp/idemhttp/internal/keylog"
)

// buildStore writes steps to a new store, one frame per storeStep, and returns
// its path.
func buildStore(t *testing.T, steps []storeStep) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "keys")
	s, err := OpenFileKeyStore(p)
	require.NoError(t, err)
	ctx := context.Background()
	for _, st := range steps {
		if st.release {
			require.NoError(t, s.Release(ctx, st.op, st.key))
		} else {
			_, err := s.Acquire(ctx, st.op, st.key)
			require.NoError(t, err)
		}
	}
	require.NoError(t, s.Close())
	return p
}

// writeVariant writes data as a store file in a new directory.
func writeVariant(t *testing.T, data []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "keys")
	require.NoError(t, os.WriteFile(p, data, 0o600))
	return p
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	require.NoError(t, err)
	return fi.Size()
}

func TestFileKeyStoreTrimsTornTail(t *testing.T) {
	earlier := []storeStep{acq("a", "ka", "ka"), acq("b", "kb", "kb"), acq("c", "kc", "kc"), rel("b", "kb")}
	want := map[string]string{"a": "ka", "c": "kc"}
	tests := []struct {
		name string
		last storeStep
	}{
		{"last record an acquire", acq("d", "kd", "kd")},
		{"last record a release", rel("a", "ka")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := buildStore(t, append(earlier, tt.last))
			data, err := os.ReadFile(p)
			require.NoError(t, err)
			offs := frameOffsets(t, p)
			lastStart := offs[len(offs)-2]
			for cut := lastStart; cut < int64(len(data)); cut++ {
				v := writeVariant(t, data[:cut])
				s, err := OpenFileKeyStore(v)
				require.NoError(t, err, "cut at %d", cut)
				assert.Equal(t, want, pendingMap(t, s), "cut at %d", cut)
				assert.Equal(t, cut-lastStart, s.Recovery().TrimmedBytes, "cut at %d", cut)
				require.NoError(t, s.Close())
				assert.Equal(t, lastStart, fileSize(t, v), "cut at %d: the torn tail is trimmed", cut)
			}
		})
	}
}

func TestFileKeyStoreTrimsGarbageTail(t *testing.T) {
	p := buildStore(t, []storeStep{acq("a", "ka", "ka")})
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	tests := []struct {
		name string
		tail []byte
	}{
		{"zeros, as a file extended by a crash", make([]byte, 4096)},
		{"a header of a frame never written", []byte{16, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8}},
		{"text", []byte("not a frame at all")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := writeVariant(t, append(append([]byte(nil), data...), tt.tail...))
			s := openTestStore(t, v)
			assert.Equal(t, map[string]string{"a": "ka"}, pendingMap(t, s))
			assert.Equal(t, int64(len(tt.tail)), s.Recovery().TrimmedBytes)
			_, err := s.Acquire(context.Background(), "b", "kb")
			require.NoError(t, err)
			s = reopen(t, s)
			assert.Equal(t, map[string]string{"a": "ka", "b": "kb"}, pendingMap(t, s))
		})
	}
}

func TestFileKeyStoreDetectsCorruption(t *testing.T) {
	// Five frames; every byte of the second one is damaged in turn.
	var steps []storeStep
	for i := range 5 {
		steps = append(steps, acq(fmt.Sprint("op", i), fmt.Sprint("key", i), fmt.Sprint("key", i)))
	}
	p := buildStore(t, steps)
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	offs := frameOffsets(t, p)
	from, to := offs[1], offs[2]
	salvaged := map[string]string{"op0": "key0", "op2": "key2", "op3": "key3", "op4": "key4"}
	for at := from; at < to; at++ {
		damaged := append([]byte(nil), data...)
		damaged[at] ^= 0x5a
		v := writeVariant(t, damaged)

		_, err := OpenFileKeyStore(v)
		require.ErrorIs(t, err, ErrStoreCorrupt, "byte %d", at)
		var ce *CorruptError
		require.ErrorAs(t, err, &ce)
		assert.Equal(t, from, ce.Offset, "byte %d", at)
		assert.Contains(t, err.Error(), fmt.Sprintf("offset %d", from))
		after, _ := os.ReadFile(v)
		assert.Equal(t, damaged, after, "byte %d: a strict open must not change a corrupt file", at)

		s, err := OpenFileKeyStore(v, WithSalvage())
		require.NoError(t, err, "byte %d", at)
		assert.Equal(t, salvaged, pendingMap(t, s), "byte %d", at)
		if rec := s.Recovery(); assert.Len(t, rec.Skipped, 1, "byte %d", at) {
			assert.Equal(t, from, rec.Skipped[0].Offset)
		}
		require.NoError(t, s.Close())

		s, err = OpenFileKeyStore(v)
		require.NoError(t, err, "byte %d: salvage rewrote the file", at)
		assert.Equal(t, salvaged, pendingMap(t, s), "byte %d", at)
		require.NoError(t, s.Close())
	}
}

func TestFileKeyStoreCorruptHeader(t *testing.T) {
	p := buildStore(t, []storeStep{acq("a", "ka", "ka")})
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	for at := range keylog.HeaderSize {
		damaged := append([]byte(nil), data...)
		damaged[at] ^= 0x01
		v := writeVariant(t, damaged)
		for _, opts := range [][]FileOption{nil, {WithSalvage()}} {
			_, err := OpenFileKeyStore(v, opts...)
			require.ErrorIs(t, err, ErrStoreCorrupt, "byte %d", at)
			var ce *CorruptError
			require.ErrorAs(t, err, &ce)
			assert.Zero(t, ce.Offset)
		}
	}
}

// A damaged final frame cannot be told from a torn write: it is trimmed.
// This is the one place a flipped bit loses a record silently, and the
// reason every acknowledged record is behind an fsync.
func TestFileKeyStoreDamagedLastFrameIsTrimmed(t *testing.T) {
	p := buildStore(t, []storeStep{acq("a", "ka", "ka"), acq("b", "kb", "kb")})
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	data[len(data)-1] ^= 0xff
	s := openTestStore(t, writeVariant(t, data))
	assert.Equal(t, map[string]string{"a": "ka"}, pendingMap(t, s))
	assert.Positive(t, s.Recovery().TrimmedBytes)
}

// Only the last frame can be unacknowledged: a damaged frame followed by a
// torn one is corruption, not a longer torn tail, and salvage keeps what
// follows it.
func TestDamagedFrameBeforeTornTailIsCorruption(t *testing.T) {
	p := buildStore(t, []storeStep{acq("a", "ka", "ka"), acq("b", "kb", "kb"), acq("c", "kc", "kc")})
	offs := frameOffsets(t, p) // a, b, c, end
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	data[offs[1]-1] ^= 0xff // bit rot at the end of a's body
	data = data[:offs[3]-3] // a crash while c was written

	_, err = OpenFileKeyStore(writeVariant(t, data))
	var ce *CorruptError
	require.ErrorAs(t, err, &ce, "acknowledged record a must not vanish as a torn tail")
	assert.Equal(t, offs[0], ce.Offset)

	s, err := OpenFileKeyStore(writeVariant(t, data), WithSalvage())
	require.NoError(t, err)
	defer s.Close()
	assert.Equal(t, map[string]string{"b": "kb"}, pendingMap(t, s), "salvage keeps b, drops damaged a and torn c")
}

// An operation id is opaque bytes, so it can hold a whole frame: one that
// would give another operation a key of the id's choosing. A frame whose
// header checks out has a trusted length, so recovery never looks for
// frames inside it: not in a torn one, and not in a damaged one skipped by
// salvage.
func TestFileKeyStoreFrameInsideRecordIsNotRead(t *testing.T) {
	forged := frameOf(keylog.AppendAcquire(nil, "victim", "forged", 1))
	smuggler := "order-" + string(forged) + "-end"
	steps := []storeStep{acq("victim", "kv", "kv"), acq(smuggler, "ks", "ks"), acq("c", "kc", "kc")}
	p := buildStore(t, steps)
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	offs := frameOffsets(t, p) // victim, smuggler, c, end
	tests := []recoveryCase{
		{
			name:    "torn after the forged frame",
			data:    data[:offs[2]-1],
			want:    map[string]string{"victim": "kv"},
			trimmed: offs[2] - 1 - offs[1],
		},
		{
			name:    "damaged before the forged frame, salvaged",
			data:    flipByte(data, offs[1]+keylog.FrameHeaderSize),
			opts:    []FileOption{WithSalvage()},
			want:    map[string]string{"victim": "kv", "c": "kc"},
			skipped: []int64{offs[1]},
		},
	}
	checkRecoveries(t, tests)
}

// A torn write can leave a frame's body on the disk without its header,
// and recovery then searches that body for the next frame. An operation
// id is opaque bytes, so it can hold a frame that gives another operation
// a key of the id's choosing, and after it a frame header that announces
// more than the file holds, which would pass for a torn tail and cut off
// the frames after it. Made without the file's salt, neither is a frame
// of the file: a torn last frame is trimmed whole, and damage earlier in
// the file is skipped up to the next real frame, whose records are kept.
func TestFileKeyStoreFrameInsideHeaderlessFrameIsNotRead(t *testing.T) {
	forged := frameOf(keylog.AppendAcquire(nil, "victim", "forged", 1))
	endless := make([]byte, keylog.FrameHeaderSize)
	binary.LittleEndian.PutUint32(endless, keylog.MaxFrameBody)
	binary.LittleEndian.PutUint32(endless[8:], crc32.Checksum(endless[:8], crc32.MakeTable(crc32.Castagnoli)))
	smuggler := "order-" + string(forged) + string(endless)
	p := buildStore(t, []storeStep{acq("victim", "kv", "kv"), acq(smuggler, "ks", "ks"), acq("c", "kc", "kc")})
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	offs := frameOffsets(t, p) // victim, smuggler, c, end
	for i := offs[1]; i < offs[1]+keylog.FrameHeaderSize; i++ {
		data[i] = 0 // the smuggler's frame header never reached the disk
	}
	tests := []recoveryCase{
		{
			name:    "torn last write",
			data:    data[:offs[2]],
			want:    map[string]string{"victim": "kv"},
			trimmed: offs[2] - offs[1],
		},
		{
			name:    "torn last write, salvaged",
			data:    data[:offs[2]],
			opts:    []FileOption{WithSalvage()},
			want:    map[string]string{"victim": "kv"},
			trimmed: offs[2] - offs[1],
		},
		{
			name:      "damaged before another frame",
			data:      data,
			corruptAt: offs[1],
		},
		{
			name:    "damaged before another frame, salvaged",
			data:    data,
			opts:    []FileOption{WithSalvage()},
			want:    map[string]string{"victim": "kv", "c": "kc"},
			skipped: []int64{offs[1]},
		},
	}
	checkRecoveries(t, tests)
}

// A file of version 1, whose frames' checksums have no salt, is read, and
// rewritten in the current version before anything is appended to it.
func TestFileKeyStoreRewritesVersion1(t *testing.T) {
	// frameOf makes frames without a salt, as version 1 has them.
	data := keylog.V1Header().Append(nil)
	data = append(data, frameOf(keylog.AppendAcquire(nil, "a", "ka", 1), keylog.AppendAcquire(nil, "b", "kb", 2))...)
	data = append(data, frameOf(keylog.AppendRelease(nil, "a", "ka"))...)
	torn := frameOf(keylog.AppendAcquire(nil, "c", "kc", 3))
	data = append(data, torn[:len(torn)-1]...)
	p := writeVariant(t, data)

	s := openTestStore(t, p)
	assert.Equal(t, map[string]string{"b": "kb"}, pendingMap(t, s))
	assert.Equal(t, int64(len(torn)-1), s.Recovery().TrimmedBytes)
	header := make([]byte, keylog.HeaderSize)
	f, err := os.Open(p)
	require.NoError(t, err)
	_, err = io.ReadFull(f, header)
	require.NoError(t, f.Close())
	require.NoError(t, err)
	h, err := keylog.ReadHeader(header)
	require.NoError(t, err)
	assert.Equal(t, uint16(keylog.Version), h.Version(), "rewritten at open")

	_, err = s.Acquire(context.Background(), "d", "kd")
	require.NoError(t, err)
	s = reopen(t, s)
	assert.Equal(t, map[string]string{"b": "kb", "d": "kd"}, pendingMap(t, s))
	assert.Equal(t, FileRecovery{}, s.Recovery())
}

// version1File returns a store file of version 1 holding the pending keys
// version1Pending.
func version1File() []byte {
	data := keylog.V1Header().Append(nil)
	data = append(data, frameOf(keylog.AppendAcquire(nil, "a", "ka", 1), keylog.AppendAcquire(nil, "b", "kb", 2))...)
	return append(data, frameOf(keylog.AppendAcquire(nil, "c", "kc", 3), keylog.AppendRelease(nil, "c", "kc"))...)
}

var version1Pending = map[string]string{"a": "ka", "b": "kb"}

// checkKeepsVersion1 opens the version 1 file version1File wrote at path,
// which cannot be replaced, so cannot be rewritten in the current version:
// the store opens it as it is, records a key in it, and finds all its keys
// again, the file still of version 1.
func checkKeepsVersion1(t *testing.T, path string) {
	t.Helper()
	s, err := OpenFileKeyStore(path)
	require.NoError(t, err, "a version 1 file that cannot be replaced is opened as it is")
	assert.Equal(t, version1Pending, pendingMap(t, s))
	_, err = s.Acquire(context.Background(), "d", "kd")
	require.NoError(t, err)
	require.NoError(t, s.Close())

	s, err = OpenFileKeyStore(path)
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"a": "ka", "b": "kb", "d": "kd"}, pendingMap(t, s))
	assert.Equal(t, FileRecovery{}, s.Recovery())
	require.NoError(t, s.Close())
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	h, err := keylog.ReadHeader(data)
	require.NoError(t, err)
	assert.Equal(t, uint16(1), h.Version(), "the file stays of version 1")
}

// A version 1 file is rewritten in the current version by replacing it,
// which needs a directory it can be replaced in: in a read-only one the
// store keeps the file's version, as the release that wrote it did, rather
// than refuse to open its keys.
func TestFileKeyStoreKeepsVersion1InAReadOnlyDirectory(t *testing.T) {
	if os.Geteuid() == 0 || runtime.GOOS == "windows" {
		t.Skip("needs a user that permissions apply to")
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "keys")
	require.NoError(t, os.WriteFile(p, version1File(), 0o600))
	require.NoError(t, os.Chmod(dir, 0o500))
	t.Cleanup(func() { os.Chmod(dir, 0o700) })
	checkKeepsVersion1(t, p)
}

// recoveryCase is a store file and what opening it must find.
type recoveryCase struct {
	name string
	data []byte
	opts []FileOption
	// corruptAt, when not zero, is the offset of the damage for which a
	// strict open fails; the other fields are then not looked at.
	corruptAt int64
	want      map[string]string // the pending keys
	trimmed   int64             // Recovery().TrimmedBytes
	skipped   []int64           // the offsets of Recovery().Skipped
}

// checkRecoveries opens the file of each case and checks what it finds.
func checkRecoveries(t *testing.T, tests []recoveryCase) {
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := OpenFileKeyStore(writeVariant(t, tt.data), tt.opts...)
			if tt.corruptAt != 0 {
				var ce *CorruptError
				require.ErrorAs(t, err, &ce)
				assert.Equal(t, tt.corruptAt, ce.Offset)
				return
			}
			require.NoError(t, err)
			defer s.Close()
			assert.Equal(t, tt.want, pendingMap(t, s))
			rec := s.Recovery()
			assert.Equal(t, tt.trimmed, rec.TrimmedBytes)
			var skipped []int64
			for _, ce := range rec.Skipped {
				skipped = append(skipped, ce.Offset)
			}
			assert.Equal(t, tt.skipped, skipped)
		})
	}
}

// flipByte returns a copy of data with the byte at i inverted.
func flipByte(data []byte, i int64) []byte {
	d := append([]byte(nil), data...)
	d[i] ^= 0xff
	return d
}

// frameOf returns a frame holding records, as one can make it without
// the file it goes in: its checksums have no salt.
func frameOf(records ...[]byte) []byte {
	f := make([]byte, keylog.FrameHeaderSize)
	for _, r := range records {
		f = append(f, r...)
	}
	keylog.V1Header().PutFrameHeader(f)
	return f
}
