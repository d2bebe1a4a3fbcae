package keylog

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// frameOf returns a frame of a file with header h, holding records.
func frameOf(h Header, records ...[]byte) []byte {
	f := make([]byte, FrameHeaderSize)
	for _, r := range records {
		f = append(f, r...)
	}
	h.PutFrameHeader(f)
	return f
}

func newHeader(t testing.TB) Header {
	t.Helper()
	h, err := NewHeader()
	require.NoError(t, err)
	return h
}

func TestRecordsRoundTrip(t *testing.T) {
	long := strings.Repeat("x", MaxOperationLen)
	tests := []struct {
		name string
		want Record
	}{
		{"acquire", Record{Kind: KindAcquire, Created: 1_700_000_000_123_456_789, Operation: []byte("op"), Key: []byte("key")}},
		{"acquire before 1970", Record{Kind: KindAcquire, Created: -5, Operation: []byte("o"), Key: []byte("k")}},
		{"release", Record{Kind: KindRelease, Operation: []byte("op"), Key: []byte("key")}},
		{"longest fields", Record{Kind: KindAcquire, Operation: []byte(long), Key: []byte(long)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b []byte
			if tt.want.Kind == KindAcquire {
				b = AppendAcquire(nil, string(tt.want.Operation), string(tt.want.Key), tt.want.Created)
				assert.Len(t, b, AcquireSize(len(tt.want.Operation), len(tt.want.Key)))
			} else {
				b = AppendRelease(nil, string(tt.want.Operation), string(tt.want.Key))
			}
			got, err := DecodeRecords(append(b, b...), nil)
			require.NoError(t, err)
			assert.Equal(t, []Record{tt.want, tt.want}, got)
		})
	}
}

func TestDecodeRecordsRejects(t *testing.T) {
	good := AppendRelease(nil, "op", "key")
	tests := []struct {
		name string
		body []byte
	}{
		{"unknown type", []byte{9, 1, 'a', 1, 'b'}},
		{"short acquire", []byte{byte(KindAcquire), 1, 2, 3}},
		{"empty operation", []byte{byte(KindRelease), 0, 1, 'k'}},
		{"empty key", []byte{byte(KindRelease), 1, 'o', 0}},
		{"length past the end", []byte{byte(KindRelease), 5, 'o'}},
		{"oversized operation", append([]byte{byte(KindRelease), 0x81, 0x08}, make([]byte, 1025)...)},
		{"bad varint", []byte{byte(KindRelease), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}},
		{"good then truncated", append(append([]byte(nil), good...), good[:3]...)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prior := []Record{{Kind: KindRelease}}
			got, err := DecodeRecords(tt.body, prior)
			assert.Error(t, err)
			assert.Equal(t, prior, got, "no record is delivered from a malformed body")
		})
	}
}

func TestHeader(t *testing.T) {
	hv := newHeader(t)
	for _, tt := range []struct {
		name string
		h    Header
		size int
	}{
		{"current", hv, HeaderSize},
		{"version 1", V1Header(), 16},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := tt.h.Append(nil)
			require.Len(t, b, tt.size)
			assert.Equal(t, int64(tt.size), tt.h.Size())
			got, err := ReadHeader(b)
			require.NoError(t, err)
			assert.Equal(t, tt.h, got)
			got, err = ReadHeader(append(b, "frames"...))
			require.NoError(t, err, "the bytes after the header are not the header's")
			assert.Equal(t, tt.h, got)
			for n := range len(b) {
				assert.True(t, IsUnfinishedHeader(b[:n]), "prefix %d", n)
				zeros := append(append([]byte(nil), b[:n]...), make([]byte, len(b)-n)...)
				assert.True(t, IsUnfinishedHeader(zeros), "prefix %d, then zeros", n)
				_, err := ReadHeader(b[:n])
				assert.Error(t, err, "prefix %d", n)
			}
			assert.False(t, IsUnfinishedHeader(b), "a complete header")
			bad := append([]byte(nil), b...)
			bad[0] = 'X'
			assert.ErrorIs(t, headerErr(ReadHeader(bad)), ErrNotKeyLog)
			bad = append([]byte(nil), b...)
			bad[10] = 1
			assert.ErrorIs(t, headerErr(ReadHeader(bad)), ErrHeaderChecksum)
			bad = append([]byte(nil), b...)
			bad[len(b)-1] ^= 1
			assert.ErrorIs(t, headerErr(ReadHeader(bad)), ErrHeaderChecksum)
		})
	}
	assert.False(t, IsUnfinishedHeader([]byte("IDEMX")))
	assert.False(t, IsUnfinishedHeader([]byte("IDEM\x00\x00x")), "a byte after the zeros")
	assert.False(t, IsUnfinishedHeader(append(make([]byte, 12), "x"...)), "a byte after zeros where the salt goes")
	assert.False(t, IsUnfinishedHeader([]byte("IDEMKEYS\x00\x00\x00\x00x")), "a byte after zeros where the version goes")
	assert.True(t, IsUnfinishedHeader(append(hv.Append(nil)[:12], 0, 0, 0, 7, 0)), "any salt, after whole magic, version and flags")
	assert.False(t, IsUnfinishedHeader(append(V1Header().Append(nil), 0, 0)), "a complete header, then a torn frame")
	assert.False(t, IsUnfinishedHeader(make([]byte, HeaderSize+1)), "longer than a header")
	assert.NotEqual(t, hv, newHeader(t), "each file has a salt of its own")
}

// headerErr returns the error of a ReadHeader.
func headerErr(_ Header, err error) error { return err }

// TestFrameChecksumsHaveTheSalt checks that a frame made with one file's
// header, or with none, is not a frame of another file.
func TestFrameChecksumsHaveTheSalt(t *testing.T) {
	a, b := newHeader(t), newHeader(t)
	f := frameOf(a, AppendAcquire(nil, "op", "key", 1))
	n, crc, ok := a.ParseFrameHeader(f)
	require.True(t, ok)
	assert.True(t, a.BodyOK(f[FrameHeaderSize:FrameHeaderSize+n], crc))
	_, _, ok = b.ParseFrameHeader(f)
	assert.False(t, ok, "another file's frame")
	_, _, ok = V1Header().ParseFrameHeader(f)
	assert.False(t, ok, "a salted frame read without the salt")
	_, _, ok = a.ParseFrameHeader(frameOf(V1Header(), AppendAcquire(nil, "op", "key", 1)))
	assert.False(t, ok, "a frame made without the salt")
}

func TestScannerResyncsPastDamage(t *testing.T) {
	h := newHeader(t)
	f1 := frameOf(h, AppendAcquire(nil, "a", "ka", 1))
	f2 := frameOf(h, AppendAcquire(nil, "b", "kb", 2))
	f3 := frameOf(h, AppendRelease(nil, "a", "ka"))
	file := append(append(append(h.Append(nil), f1...), f2...), f3...)
	f2at := int64(HeaderSize + len(f1))
	file[f2at+FrameHeaderSize+3] ^= 1 // damage f2's body

	sc := NewScanner(bytes.NewReader(file), int64(len(file)), h)
	off, _, err := sc.Next()
	require.NoError(t, err)
	assert.Equal(t, int64(HeaderSize), off)
	_, _, err = sc.Next()
	var bad *BadFrame
	require.ErrorAs(t, err, &bad)
	assert.Equal(t, f2at, bad.Offset)
	assert.Equal(t, f2at+int64(len(f2)), bad.Next)
	assert.False(t, bad.Torn())
	sc.Reset(bad.Next)
	off, body, err := sc.Next()
	require.NoError(t, err)
	assert.Equal(t, bad.Next, off)
	assert.Equal(t, f3[FrameHeaderSize:], body)
	_, _, err = sc.Next()
	assert.ErrorIs(t, err, io.EOF)
}

// FuzzScan feeds arbitrary bytes to the scanner and the record decoder,
// skipping damage the way salvage does: no panic, and every step moves
// forward, so no hang.
func FuzzScan(f *testing.F) {
	h := newHeader(f)
	file := h.Append(nil)
	file = append(file, frameOf(h, AppendAcquire(nil, "op", "key", 7), AppendRelease(nil, "op", "key"))...)
	file = append(file, frameOf(h, AppendAcquire(nil, "x", "y", 8))...)
	f.Add(file)
	f.Add(file[:len(file)-3])
	f.Add(h.Append(nil))
	v1 := V1Header()
	f.Add(append(v1.Append(nil), frameOf(v1, AppendAcquire(nil, "op", "key", 7))...))
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := ReadHeader(data)
		if err != nil {
			h = V1Header()
		}
		sc := NewScanner(bytes.NewReader(data), int64(len(data)), h)
		last := int64(-1)
		for {
			off, body, err := sc.Next()
			if off <= last {
				t.Fatalf("no progress at offset %d", off)
			}
			last = off
			var bad *BadFrame
			switch {
			case errors.Is(err, io.EOF):
				return
			case errors.As(err, &bad):
				if bad.Torn() {
					return
				}
				if bad.Next <= bad.Offset {
					t.Fatalf("resync went back from %d to %d", bad.Offset, bad.Next)
				}
				sc.Reset(bad.Next)
			case err != nil:
				t.Fatal(err)
			default:
				recs, _ := DecodeRecords(body, nil)
				for _, r := range recs {
					if len(r.Operation) == 0 || len(r.Key) == 0 {
						t.Fatal("empty field decoded")
					}
				}
			}
		}
	})
}
