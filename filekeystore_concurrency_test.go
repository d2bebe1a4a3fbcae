package idemhttp

import (
	"context"
	"fmt"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestFileKeyStoreConcurrent(t *testing.T) {
	const goroutines, rounds = 32, 40
	tests := []struct {
		name       string
		compactMin int64
	}{
		{"without compaction", 0},
		{"compacting all the time", 2 << 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			s := openTestStore(t, filepath.Join(t.TempDir(), "keys"), withCompactMinSize(tt.compactMin))
			shared := make([][goroutines]string, rounds)
			// Halfway through, a compactor starts rewriting the file over and
			// over until the workers are done, so compactions certainly
			// overlap their appends; the store starts its own ones too.
			half, done := make(chan struct{}), make(chan struct{})
			var halfOnce sync.Once
			forced := 0
			var compactor sync.WaitGroup
			if tt.compactMin > 0 {
				compactor.Go(func() {
					<-half
					for {
						compactNow(s)
						forced++
						select {
						case <-done:
							return
						default:
						}
					}
				})
			}
			var wg sync.WaitGroup
			for g := range goroutines {
				wg.Go(func() {
					for r := range rounds {
						if r == rounds/2 {
							halfOnce.Do(func() { close(half) })
						}
						// Distinct ids: a third stay pending.
						op := fmt.Sprintf("g%d-%d", g, r)
						key, err := s.Acquire(ctx, op, "k-"+op)
						if !assert.NoError(t, err) || !assert.Equal(t, "k-"+op, key) {
							return
						}
						if r%3 != 0 {
							assert.NoError(t, s.Release(ctx, op, key))
						}
						// One id for everyone: one key for everyone.
						shared[r][g], err = s.Acquire(ctx, fmt.Sprint("shared-", r), fmt.Sprintf("g%d-r%d", g, r))
						assert.NoError(t, err)
						// A hot id acquired and released by everyone.
						hot, err := s.Acquire(ctx, "hot", fmt.Sprintf("hot-g%d-r%d", g, r))
						assert.NoError(t, err)
						assert.NoError(t, s.Release(ctx, "hot", hot))
					}
				})
			}
			wg.Wait()
			close(done)
			compactor.Wait()

			want := map[string]string{}
			for r := range rounds {
				for g := range goroutines {
					if r%3 == 0 {
						op := fmt.Sprintf("g%d-%d", g, r)
						want[op] = "k-" + op
					}
					assert.Equal(t, shared[r][0], shared[r][g], "round %d: goroutine %d got another key", r, g)
				}
				want[fmt.Sprint("shared-", r)] = shared[r][0]
			}
			assert.Equal(t, want, pendingMap(t, s))
			old := s
			s = reopen(t, s)
			assert.Equal(t, want, pendingMap(t, s), "after reopen")
			if tt.compactMin > 0 {
				require.Positive(t, forced)
				assert.GreaterOrEqual(t, old.compactions, forced, "every compaction forced while the workers ran completed")
			}
		})
	}
}

func TestFileKeyStoreCompaction(t *testing.T) {
	ctx := context.Background()
	p := filepath.Join(t.TempDir(), "keys")
	s, err := OpenFileKeyStore(p, withCompactMinSize(4<<10))
	require.NoError(t, err)
	want := map[string]string{}
	for i := range 10 {
		op := fmt.Sprint("live-", i)
		want[op] = "k-" + op
		_, err := s.Acquire(ctx, op, "k-"+op)
		require.NoError(t, err)
	}
	for i := range 1000 {
		op := fmt.Sprint("done-", i)
		_, err := s.Acquire(ctx, op, "k-"+op)
		require.NoError(t, err)
		require.NoError(t, s.Release(ctx, op, "k-"+op))
	}
	// 1000 pairs of 76 bytes were appended.
	compactNow(s)
	assert.Greater(t, s.compactions, 1, "compaction ran by itself too")
	assert.Less(t, fileSize(t, p), int64(1<<10), "only the live records are left")
	require.NoError(t, s.Close())

	s = openTestStore(t, p)
	assert.Equal(t, want, pendingMap(t, s))
	assert.Equal(t, FileRecovery{}, s.Recovery())
}

// compactNow waits for a running compaction, then runs one.
func compactNow(s *FileKeyStore) {
	s.mu.Lock()
	for s.compacting != nil {
		ch := s.compacting
		s.mu.Unlock()
		<-ch
		s.mu.Lock()
	}
	done := make(chan struct{})
	s.compacting = done
	s.mu.Unlock()
	s.compact(done)
}

// The compaction snapshot is the state of the file, not of memory: a key
// whose release is still queued is kept, a key whose acquire is still
// queued is not.
func TestFileKeyStoreCompactionSnapshot(t *testing.T) {
	ctx := context.Background()
	s := openTestStore(t, filepath.Join(t.TempDir(), "keys"))
	for _, op := range []string{"a", "b"} {
		_, err := s.Acquire(ctx, op, "k-"+op)
		require.NoError(t, err)
	}
	release := holdFlusher(s)
	var wg sync.WaitGroup
	wg.Go(func() { assert.NoError(t, s.Release(ctx, "a", "k-a")) })
	waitQueued(s, 1)
	wg.Go(func() { _, err := s.Acquire(ctx, "c", "k-c"); assert.NoError(t, err) })
	waitQueued(s, 2)

	s.mu.Lock()
	var ops []string
	for _, r := range s.snapshotLocked() {
		ops = append(ops, r.op+"="+r.e.key())
	}
	s.mu.Unlock()
	release()
	wg.Wait()
	sort.Strings(ops)
	assert.Equal(t, []string{"a=k-a", "b=k-b"}, ops)
	assert.Equal(t, map[string]string{"b": "k-b", "c": "k-c"}, pendingMap(t, s))
}

func TestFileKeyStoreSecondCloseWaitsForTheFirst(t *testing.T) {
	p := filepath.Join(t.TempDir(), "keys")
	// Closed only in the bubble, which makes the channel later Closes wait on.
	s, err := OpenFileKeyStore(p)
	require.NoError(t, err)
	synctest.Test(t, func(t *testing.T) {
		// A compaction in progress holds the first Close.
		compaction := make(chan struct{})
		s.mu.Lock()
		s.compacting = compaction
		s.mu.Unlock()
		first := make(chan error, 1)
		go func() { first <- s.Close() }()
		synctest.Wait()
		second := make(chan error, 1)
		go func() { second <- s.Close() }()
		synctest.Wait()
		select {
		case err := <-second:
			// It returned while the first still holds the file: the file
			// must not be locked any more, or a reopen would fail.
			assert.NoError(t, err)
			s2, err := OpenFileKeyStore(p)
			if assert.NoError(t, err, "the second Close returned while the first still held the file") {
				assert.NoError(t, s2.Close())
			}
			second <- nil
		default:
		}
		close(compaction)
		assert.NoError(t, <-first)
		assert.NoError(t, <-second)
	})
	s2, err := OpenFileKeyStore(p)
	require.NoError(t, err, "both Closes released the file")
	require.NoError(t, s2.Close())
}
