package idemhttp

import (
	"bufio"
	"context"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/idemhttp/idemhttp/internal/benchpairs"
	"github.com/idemhttp/idemhttp/internal/keylog"
)

// BenchmarkFileKeyStorePairs measures durable Acquire+Release pairs of
// distinct operations, with group commit and with one fsync per record.
func BenchmarkFileKeyStorePairs(b *testing.B) {
	modes := []struct {
		name string
		opts []FileOption
	}{
		{"group-commit", nil},
		{"fsync-per-op", []FileOption{withSyncEachOp()}},
	}
	for _, mode := range modes {
		for _, g := range benchpairs.Goroutines {
			b.Run(mode.name+"/"+benchpairs.Name(g), func(b *testing.B) {
				ctx := context.Background()
				s := openTestStore(b, filepath.Join(b.TempDir(), "keys"), mode.opts...)
				benchpairs.Run(b, g, func(i int) error {
					op := benchpairs.Operation(i)
					key, err := s.Acquire(ctx, op, benchpairs.Key(i))
					if err != nil {
						return err
					}
					return s.Release(ctx, op, key)
				})
			})
		}
	}
}

// BenchmarkOpenFileKeyStore measures opening a store of a million pending
// keys, and reports the memory each key costs beyond its two strings.
func BenchmarkOpenFileKeyStore(b *testing.B) {
	const n = 1_000_000
	path := filepath.Join(b.TempDir(), "keys")
	strBytes := writePendingStore(b, path, n)
	var before, after runtime.MemStats
	first := true
	for b.Loop() {
		if first {
			runtime.GC()
			runtime.ReadMemStats(&before)
		}
		s, err := OpenFileKeyStore(path)
		if err != nil {
			b.Fatal(err)
		}
		if first {
			b.StopTimer()
			runtime.GC()
			runtime.ReadMemStats(&after)
			runtime.KeepAlive(s)
			b.ReportMetric(float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)-strBytes)/n, "overhead-B/key")
			b.StartTimer()
			first = false
		}
		s.Close()
	}
}

// writePendingStore writes a store of n pending keys, as compaction lays
// them out, and returns the bytes of their operation ids and keys.
func writePendingStore(b *testing.B, path string, n int) (strBytes int64) {
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	h, err := keylog.NewHeader()
	if err != nil {
		b.Fatal(err)
	}
	w := bufio.NewWriter(f)
	w.Write(h.Append(nil))
	frame := make([]byte, keylog.FrameHeaderSize, keylog.FrameHeaderSize+keylog.MaxFrameBody)
	flush := func() {
		h.PutFrameHeader(frame)
		w.Write(frame)
		frame = frame[:keylog.FrameHeaderSize]
	}
	for i := range n {
		op, key := benchpairs.Operation(i), benchpairs.Key(i)
		strBytes += int64(len(op) + len(key))
		if len(frame)+keylog.AcquireSize(len(op), len(key)) > keylog.FrameHeaderSize+keylog.MaxFrameBody {
			flush()
		}
		frame = keylog.AppendAcquire(frame, op, key, int64(i))
	}
	flush()
	if err := w.Flush(); err != nil {
		b.Fatal(err)
	}
	if err := f.Close(); err != nil {
		b.Fatal(err)
	}
	return strBytes
}
