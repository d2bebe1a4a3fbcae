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

func frameOf(records ...[]byte) []byte {
	f := make([]byte, FrameHeaderSize)
	for _, r := range records {
		f = append(f, r...)
	}
	PutFrameHeader(f)
	return f
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
	h := AppendHeader(nil)
	require.Len(t, h, HeaderSize)
	assert.NoError(t, CheckHeader(h))
	for n := range HeaderSize {
		assert.True(t, IsUnfinishedHeader(h[:n]), "prefix %d", n)
		zeros := append(append([]byte(nil), h[:n]...), make([]byte, HeaderSize-n)...)
		assert.True(t, IsUnfinishedHeader(zeros), "prefix %d, then zeros", n)
	}
	assert.False(t, IsUnfinishedHeader(h), "a complete header")
	assert.False(t, IsUnfinishedHeader([]byte("IDEMX")))
	assert.False(t, IsUnfinishedHeader(append(h[:4:4], 0, 0, 'x')), "a byte after the zeros")
	assert.False(t, IsUnfinishedHeader(make([]byte, HeaderSize+1)), "longer than a header")
	bad := append([]byte(nil), h...)
	bad[0] = 'X'
	assert.ErrorIs(t, CheckHeader(bad), ErrNotKeyLog)
	bad = append([]byte(nil), h...)
	bad[10] = 1
	assert.ErrorIs(t, CheckHeader(bad), ErrHeaderChecksum)
}

func TestScannerResyncsPastDamage(t *testing.T) {
	f1 := frameOf(AppendAcquire(nil, "a", "ka", 1))
	f2 := frameOf(AppendAcquire(nil, "b", "kb", 2))
	f3 := frameOf(AppendRelease(nil, "a", "ka"))
	file := append(append(append(AppendHeader(nil), f1...), f2...), f3...)
	f2at := int64(HeaderSize + len(f1))
	file[f2at+FrameHeaderSize+3] ^= 1 // damage f2's body

	sc := NewScanner(bytes.NewReader(file), int64(len(file)))
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
	file := AppendHeader(nil)
	file = append(file, frameOf(AppendAcquire(nil, "op", "key", 7), AppendRelease(nil, "op", "key"))...)
	file = append(file, frameOf(AppendAcquire(nil, "x", "y", 8))...)
	f.Add(file)
	f.Add(file[:len(file)-3])
	f.Add(AppendHeader(nil))
	f.Fuzz(func(t *testing.T, data []byte) {
		sc := NewScanner(bytes.NewReader(data), int64(len(data)))
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
