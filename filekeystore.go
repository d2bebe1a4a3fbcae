package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/idemhttp/idemhttp/internal/keylog"
)

var (
	// ErrStoreLocked is returned by [OpenFileKeyStore] when another
	// FileKeyStore, in this process or another, has the file open. The lock
	// is released by [FileKeyStore.Close] and when the holding process dies.
	ErrStoreLocked = errors.New("idemhttp: key store is in use by another FileKeyStore")

	// ErrStoreClosed is returned by the methods of a [FileKeyStore] after
	// [FileKeyStore.Close].
	ErrStoreClosed = errors.New("idemhttp: key store is closed")

	// ErrStoreCorrupt is matched, with [errors.Is], by every [*CorruptError].
	ErrStoreCorrupt = errors.New("idemhttp: key store is corrupt")
)

// CorruptError reports damage in a key store file that is not a torn final
// write: bytes that were once acknowledged as durable and no longer read
// back. errors.Is(err, ErrStoreCorrupt) holds for every CorruptError.
type CorruptError struct {
	// Path is the store file.
	Path string
	// Offset is the byte offset of the damaged frame (0 for the file header).
	Offset int64
	// Reason says what is wrong at Offset.
	Reason string
}

// Error describes the damage, with the path and the offset.
func (e *CorruptError) Error() string {
	return fmt.Sprintf("idemhttp: key store %s is corrupt at offset %d: %s", e.Path, e.Offset, e.Reason)
}

// Is reports whether target is [ErrStoreCorrupt].
func (e *CorruptError) Is(target error) bool { return target == ErrStoreCorrupt }

// maxKeyLen is the longest idempotency key a FileKeyStore records.
const maxKeyLen = keylog.MaxKeyLen

// Compaction defaults: rewrite once the file is at least compactMinSize
// bytes and at least compactRatio times the size of its live records.
const (
	compactMinSize = 1 << 20
	compactRatio   = 4
)

// A FileOption configures [OpenFileKeyStore].
type FileOption func(*fileConfig)

type fileConfig struct {
	staleAfter     time.Duration
	salvage        bool
	compactMinSize int64 // 0 disables compaction
	syncEachOp     bool  // one frame and one fsync per record: no group commit
	now            func() time.Time
	// sync makes a written frame durable: (*os.File).Sync, unless a test
	// makes it fail.
	sync func(*os.File) error
}

// WithStaleAfter makes [FileKeyStore.Pending] mark operations whose key is
// older than d as Stale. Servers forget keys after their retention window
// (typically 24 hours); retrying a stale operation may execute it again.
// Zero, the default, never marks an operation stale.
func WithStaleAfter(d time.Duration) FileOption {
	return func(c *fileConfig) { c.staleAfter = d }
}

// WithSalvage makes [OpenFileKeyStore] keep the readable records of a
// corrupt file instead of failing with [ErrStoreCorrupt]. The damaged frames
// are dropped, listed by [FileKeyStore.Recovery], and the file is rewritten
// without them. A dropped record can make a released operation pending again
// (its key is then reused, which is safe) or lose a pending key (the next
// attempt of that operation gets a new key, which a server cannot match to
// the earlier attempts). Copy the file first if you want to keep the
// evidence.
func WithSalvage() FileOption {
	return func(c *fileConfig) { c.salvage = true }
}

// FileRecovery describes the repairs [OpenFileKeyStore] made to the file.
type FileRecovery struct {
	// TrimmedBytes is the length of the torn final write that was cut off:
	// records a crash interrupted before they were acknowledged.
	TrimmedBytes int64
	// Skipped lists the damaged frames that [WithSalvage] dropped.
	Skipped []*CorruptError
}

// FileKeyStore is a [KeyStore] kept in one append-only file, so that pending
// keys survive process crashes and power loss. A call that records or
// releases a key returns nil only after the change is on stable storage
// (fsync); concurrent callers share one fsync (group commit), so throughput
// grows with concurrency. Released records are compacted away in the
// background by rewriting the live ones to a temporary file that atomically
// replaces the store.
//
// If a write or an fsync fails, nothing can be known about what reached the
// disk, so the store cuts the file back to its end before that write (so
// that none of the records it held, none acknowledged, is read back from
// the page cache as if it were on disk) and fails every later call with
// that error; reopening the file recovers what is there.
//
// Only one FileKeyStore at a time, in any process, may have a file open;
// the file format is described in docs/keystore-format.md. A FileKeyStore
// is safe for concurrent use by multiple goroutines.
type FileKeyStore struct {
	path     string
	cfg      fileConfig
	unlock   func()
	recovery FileRecovery
	hdr      keylog.Header // the file's: its frames are checksummed with its salt

	mu      sync.Mutex
	entries map[string]entryValue // pending keys by operation id
	// inflight holds the sequence numbers of acquire records not yet
	// durable, by operation id.
	inflight map[string]uint64
	// liveBytes is the encoded size of the acquire records of entries.
	liveBytes int64

	// The log. f and size change only while flushing is held.
	f    *os.File
	size int64 // file size including frames being written

	// Group commit. Records are numbered in the order they are queued;
	// queue holds the encoded records after writtenSeq.
	queue      []byte
	qmeta      []queued
	nextSeq    uint64 // last sequence number handed out
	writtenSeq uint64 // last record taken by a flush
	durableSeq uint64 // last record on stable storage
	releaseSeq uint64 // last release record queued
	flushing   bool   // a flush or a compaction swap owns the file
	flushed    chan struct{}
	frame      []byte   // the flusher's buffers
	taken      []queued //
	err        error    // sticky write failure

	closed         bool
	closeDone      chan struct{} // closed when the first Close has released the file
	compacting     chan struct{} // closed when the running compaction ends
	compactRetryAt int64
	compactions    int // completed, for tests

	flights flights // the operations calls are sending
}

// queued describes a record waiting in FileKeyStore.queue.
type queued struct {
	end     int // end offset in queue
	seq     uint64
	op      string
	release bool
	// For releases: the released entry and the sequence number of its
	// acquire record (0 if durable), which compaction must still write
	// until the release record is.
	e      entryValue
	acqSeq uint64
}

// OpenFileKeyStore opens the key store at path, creating it if it does not
// exist, and locks it. It replays the file to rebuild the pending keys. A
// torn final write left by a crash is trimmed (see [FileKeyStore.Recovery]);
// damage anywhere else fails with a [*CorruptError] unless [WithSalvage] is
// given. A store that another FileKeyStore has open fails with
// [ErrStoreLocked]. A file written by a release that used format version 1
// is rewritten in the current version, which those releases cannot open;
// one that cannot be replaced keeps version 1 (see docs/keystore-format.md).
func OpenFileKeyStore(path string, opts ...FileOption) (*FileKeyStore, error) {
	cfg := fileConfig{compactMinSize: compactMinSize, now: time.Now, sync: (*os.File).Sync}
	for _, o := range opts {
		o(&cfg)
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return nil, fmt.Errorf("idemhttp: open key store %s: is a directory; give the path of a file", path)
	}
	f, file, unlock, err := openLocked(path)
	if err != nil {
		return nil, err
	}
	s := &FileKeyStore{
		path:     file,
		cfg:      cfg,
		unlock:   unlock,
		f:        f,
		entries:  make(map[string]entryValue),
		inflight: make(map[string]uint64),
		flushed:  make(chan struct{}),
	}
	if err := s.load(); err != nil {
		s.f.Close()
		unlock()
		return nil, err
	}
	s.mu.Lock()
	s.maybeCompactLocked()
	s.mu.Unlock()
	return s, nil
}

// openLocked opens and locks the store file, and returns it with its path,
// symbolic links resolved: a compaction replaces the file, and replacing a
// link to it instead would leave the file behind, unlocked, for another
// store to open by its own name. The lock is taken on the file the path
// names after the lock is granted: a compaction may have renamed a new file
// over it while this open was waiting.
func openLocked(path string) (*os.File, string, func(), error) {
	for attempt := 0; ; attempt++ {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return nil, "", nil, fmt.Errorf("idemhttp: open key store: %w", err)
		}
		// Resolved once the file exists: a link may name one not yet made.
		// Where a path cannot be resolved (some Windows volumes), it is
		// used as it is, as it was before links were resolved.
		file, err := filepath.EvalSymlinks(path)
		if err != nil {
			file = path
		}
		unlock, err := lockStore(f, file)
		if err != nil {
			f.Close()
			if errors.Is(err, ErrStoreLocked) {
				return nil, "", nil, fmt.Errorf("%w: %s", ErrStoreLocked, path)
			}
			return nil, "", nil, fmt.Errorf("idemhttp: lock key store %s: %w", path, err)
		}
		fi, ferr := f.Stat()
		pi, perr := os.Stat(file)
		if ferr == nil && perr == nil && os.SameFile(fi, pi) {
			return f, file, unlock, nil
		}
		f.Close()
		unlock()
		if attempt == 10 {
			return nil, "", nil, fmt.Errorf("idemhttp: open key store %s: file keeps being replaced", path)
		}
	}
}

func (s *FileKeyStore) corrupt(off int64, reason string) *CorruptError {
	return &CorruptError{Path: s.path, Offset: off, Reason: reason}
}

// load replays the file into s.entries, repairing a torn tail, and leaves
// s.size at the end of the last good frame.
func (s *FileKeyStore) load() error {
	os.Remove(s.tempPath()) // a compaction the last owner did not finish
	fi, err := s.f.Stat()
	if err != nil {
		return fmt.Errorf("idemhttp: open key store: %w", err)
	}
	size := fi.Size()
	hdr := make([]byte, keylog.HeaderSize)
	n, err := s.f.ReadAt(hdr, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("idemhttp: read key store %s: %w", s.path, err)
	}
	if size <= keylog.HeaderSize && keylog.IsUnfinishedHeader(hdr[:n]) {
		return s.create()
	}
	h, err := keylog.ReadHeader(hdr[:n])
	if err != nil {
		var ve *keylog.VersionError
		if errors.As(err, &ve) {
			return fmt.Errorf("idemhttp: key store %s: %w", s.path, err)
		}
		return s.corrupt(0, err.Error())
	}
	s.hdr = h

	// The last owner may have crashed between writing the header and
	// syncing the directory; what this store acknowledges must not rest on
	// a directory entry that a power loss could still undo.
	if err := syncDir(filepath.Dir(s.path)); err != nil {
		return fmt.Errorf("idemhttp: open key store %s: %w", s.path, err)
	}

	sc := keylog.NewScanner(s.f, size, s.hdr)
	var recs []keylog.Record
	for {
		off, body, err := sc.Next()
		if errors.Is(err, io.EOF) {
			s.size = off
			break
		}
		var bad *keylog.BadFrame
		switch {
		case errors.As(err, &bad) && bad.Torn():
			if err := s.trim(off, size); err != nil {
				return err
			}
			s.recovery.TrimmedBytes = size - off
			s.size = off
		case errors.As(err, &bad):
			if !s.cfg.salvage {
				return s.corrupt(off, bad.Reason)
			}
			s.recovery.Skipped = append(s.recovery.Skipped, s.corrupt(off, bad.Reason))
			sc.Reset(bad.Next)
			continue
		case err != nil:
			return fmt.Errorf("idemhttp: read key store %s: %w", s.path, err)
		default:
			recs, err = keylog.DecodeRecords(body, recs[:0])
			if err != nil {
				ce := s.corrupt(off, err.Error())
				if !s.cfg.salvage {
					return ce
				}
				s.recovery.Skipped = append(s.recovery.Skipped, ce)
			}
			for _, r := range recs {
				s.replay(r)
			}
			continue
		}
		break
	}
	// What was read may be a write whose process died before its fsync,
	// still only in the page cache; this store hands its keys out as
	// durable, so they must be. A trim has synced already.
	if s.recovery.TrimmedBytes == 0 {
		if err := s.f.Sync(); err != nil {
			return fmt.Errorf("idemhttp: open key store %s: %w", s.path, err)
		}
	}
	s.countLiveBytes()
	switch {
	case s.hdr.Version() != keylog.Version:
		return s.upgrade()
	case len(s.recovery.Skipped) > 0:
		// Rewrite now, so the damage is gone before anything is appended
		// after it and the next strict open succeeds.
		return s.rewrite(s.snapshotLocked())
	}
	return nil
}

// upgrade rewrites a file of an earlier version, whose frames' checksums
// have no salt, in this one before anything is appended to it. A file that
// cannot be replaced (its directory is read-only, it is a bind mount, or
// the platform replaces no open file) keeps its version, as the release
// that wrote it did, and the next open tries again: refusing to open it
// would take its pending keys away. A salvaged file is rewritten or not
// opened, since its damage must not stay.
func (s *FileKeyStore) upgrade() error {
	old, f := s.hdr, s.f
	var err error
	if s.hdr, err = keylog.NewHeader(); err != nil {
		return fmt.Errorf("idemhttp: rewrite key store %s: %w", s.path, err)
	}
	err = s.rewrite(s.snapshotLocked())
	// rewrite moves s.f to the new file once it has replaced the old one.
	if err != nil && s.f == f && len(s.recovery.Skipped) == 0 {
		s.hdr = old // not replaced: the file is as it was
		return nil
	}
	return err
}

// create writes the header of a new (or torn, header-less) store file.
func (s *FileKeyStore) create() error {
	var err error
	s.hdr, err = keylog.NewHeader()
	if err == nil {
		err = s.f.Truncate(0)
	}
	if err == nil {
		_, err = s.f.WriteAt(s.hdr.Append(nil), 0)
	}
	if err == nil {
		err = s.f.Sync()
	}
	if err == nil {
		err = syncDir(filepath.Dir(s.path))
	}
	if err != nil {
		return fmt.Errorf("idemhttp: create key store %s: %w", s.path, err)
	}
	s.size = s.hdr.Size()
	return nil
}

// trim cuts a torn tail off the file at off.
func (s *FileKeyStore) trim(off, size int64) error {
	err := s.f.Truncate(off)
	if err == nil {
		err = s.f.Sync()
	}
	if err != nil {
		return fmt.Errorf("idemhttp: trim torn tail of key store %s at offset %d (size %d): %w", s.path, off, size, err)
	}
	return nil
}

// replay applies one record read from the file.
func (s *FileKeyStore) replay(r keylog.Record) {
	switch r.Kind {
	case keylog.KindAcquire:
		// A later acquire replaces an earlier one. One map write, no lookup:
		// this is most of what opening a large store does.
		op, e := newEntry(string(r.Operation), string(r.Key), r.Created)
		s.entries[op] = e
	case keylog.KindRelease:
		if e, ok := s.entries[string(r.Operation)]; ok && e.key() == string(r.Key) {
			delete(s.entries, string(r.Operation))
		}
	}
}

// countLiveBytes sets liveBytes from the entries.
func (s *FileKeyStore) countLiveBytes() {
	s.liveBytes = 0
	for op, e := range s.entries {
		s.liveBytes += int64(keylog.AcquireSize(len(op), len(e.key())))
	}
}

// Recovery reports what [OpenFileKeyStore] repaired when it opened the file.
func (s *FileKeyStore) Recovery() FileRecovery {
	r := s.recovery
	r.Skipped = append([]*CorruptError(nil), r.Skipped...)
	return r
}

// Path returns the path of the store file, with symbolic links resolved.
func (s *FileKeyStore) Path() string { return s.path }

func (s *FileKeyStore) operationFlights() *flights { return &s.flights }

// Acquire implements [KeyStore]. It returns nil only once the key it
// returns is on stable storage. candidate must be 1 to 1024 bytes long. If
// ctx ends while Acquire waits for the disk, Acquire returns ctx's error;
// the record may still become durable, and a later Acquire of the same
// operation then returns the same key.
func (s *FileKeyStore) Acquire(ctx context.Context, operation, candidate string) (string, error) {
	if err := ValidateOperation(operation); err != nil {
		return "", err
	}
	if candidate == "" || len(candidate) > maxKeyLen {
		return "", fmt.Errorf("idemhttp: idempotency key for operation %q must be 1 to %d bytes, not %d", operation, maxKeyLen, len(candidate))
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.usableLocked(); err != nil {
		return "", err
	}
	if e, ok := s.entries[operation]; ok {
		if err := s.waitLocked(ctx, s.inflight[operation]); err != nil {
			return "", err
		}
		return e.key(), nil
	}
	op, e := newEntry(operation, candidate, s.cfg.now().UnixNano())
	key := e.key()
	s.queue = keylog.AppendAcquire(s.queue, op, key, e.created())
	seq := s.enqueuedLocked(queued{op: op})
	s.entries[op] = e
	s.inflight[op] = seq
	s.liveBytes += int64(keylog.AcquireSize(len(op), len(key)))
	if err := s.waitLocked(ctx, seq); err != nil {
		return "", err
	}
	return key, nil
}

// Release implements [KeyStore]. It returns nil only once the release is on
// stable storage. If ctx ends while Release waits for the disk, Release
// returns ctx's error and the release may still become durable.
func (s *FileKeyStore) Release(ctx context.Context, operation, key string) error {
	if err := ValidateOperation(operation); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.usableLocked(); err != nil {
		return err
	}
	e, ok := s.entries[operation]
	if !ok || e.key() != key {
		// Perhaps a concurrent Release of the same key is still on its way
		// to the disk: answer no sooner than it.
		return s.waitLocked(ctx, s.releaseSeq)
	}
	delete(s.entries, operation)
	s.flights.dropHanded(operation)
	s.liveBytes -= int64(keylog.AcquireSize(len(operation), len(key)))
	s.queue = keylog.AppendRelease(s.queue, operation, key)
	s.releaseSeq = s.enqueuedLocked(queued{release: true, op: operation, e: e, acqSeq: s.inflight[operation]})
	return s.waitLocked(ctx, s.releaseSeq)
}

// Pending implements [KeyStore]. It lists only keys already on stable
// storage, not those an Acquire is still waiting for. Operations whose key
// is older than the [WithStaleAfter] age are marked Stale.
func (s *FileKeyStore) Pending(ctx context.Context) ([]PendingOperation, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if err := s.usableLocked(); err != nil {
		s.mu.Unlock()
		return nil, err
	}
	out := make([]PendingOperation, 0, len(s.entries))
	for op, e := range s.entries {
		if _, ok := s.inflight[op]; !ok {
			out = append(out, PendingOperation{Operation: op, Key: e.key(), Created: e.createdTime()})
		}
	}
	s.mu.Unlock()
	markStale(out, s.cfg.staleAfter, s.cfg.now())
	sortPending(out)
	return out, nil
}

// markStale sets Stale on the operations created more than maxAge before
// now. A zero maxAge marks none.
func markStale(ops []PendingOperation, maxAge time.Duration, now time.Time) {
	if maxAge <= 0 {
		return
	}
	for i := range ops {
		ops[i].Stale = now.Sub(ops[i].Created) > maxAge
	}
}

// Close flushes records still queued, waits for a running compaction to
// stop, and closes the file, releasing its lock. Calls made after Close fail
// with [ErrStoreClosed]; calls already waiting for the disk complete. Close
// is idempotent: later calls wait for the first to release the file, and
// return nil.
func (s *FileKeyStore) Close() error {
	s.mu.Lock()
	if s.closed {
		done := s.closeDone
		s.mu.Unlock()
		<-done
		return nil
	}
	s.closed = true
	s.closeDone = make(chan struct{})
	defer close(s.closeDone)
	compacting := s.compacting
	s.mu.Unlock()
	if compacting != nil {
		<-compacting
	}
	s.mu.Lock()
	err := s.waitLocked(context.Background(), s.nextSeq)
	for s.flushing { // a failed flush leaves no leader running, a good one neither
		ch := s.flushed
		s.mu.Unlock()
		<-ch
		s.mu.Lock()
	}
	f := s.f
	s.mu.Unlock()
	if cerr := f.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("idemhttp: close key store %s: %w", s.path, cerr)
	}
	s.unlock()
	return err
}

func (s *FileKeyStore) usableLocked() error {
	if s.closed {
		return ErrStoreClosed
	}
	return s.err
}

// enqueuedLocked numbers the record just appended to s.queue.
func (s *FileKeyStore) enqueuedLocked(q queued) uint64 {
	s.nextSeq++
	q.seq = s.nextSeq
	q.end = len(s.queue)
	s.qmeta = append(s.qmeta, q)
	return q.seq
}

// waitLocked returns once record seq is durable. If no flush is running the
// caller becomes the flusher and writes everything queued (up to a frame's
// worth) with one fsync; otherwise it waits for the running flush and looks
// again. No goroutine is left behind: the last waiter does the last flush.
func (s *FileKeyStore) waitLocked(ctx context.Context, seq uint64) error {
	for s.durableSeq < seq {
		if s.err != nil {
			return s.err
		}
		if !s.flushing {
			s.flushLocked()
			continue
		}
		ch := s.flushed
		s.mu.Unlock()
		select {
		case <-ch:
			s.mu.Lock()
		case <-ctx.Done():
			s.mu.Lock()
			if s.durableSeq >= seq {
				return nil
			}
			return ctx.Err()
		}
	}
	return nil
}

// acquireFlusherLocked waits until no flush is running and takes the file.
func (s *FileKeyStore) acquireFlusherLocked() {
	for s.flushing {
		ch := s.flushed
		s.mu.Unlock()
		<-ch
		s.mu.Lock()
	}
	s.flushing = true
}

// releaseFlusherLocked gives up the file and wakes the waiters.
func (s *FileKeyStore) releaseFlusherLocked() {
	s.flushing = false
	close(s.flushed)
	s.flushed = make(chan struct{})
}

// flushLocked writes the oldest queued records as one frame and fsyncs it.
// s.mu is released during the write and the fsync.
func (s *FileKeyStore) flushLocked() {
	n := 0
	for n < len(s.qmeta) && (n == 0 || s.qmeta[n].end <= keylog.MaxFrameBody) && !(s.cfg.syncEachOp && n == 1) {
		n++
	}
	if n == 0 {
		return
	}
	end := s.qmeta[n-1].end
	last := s.qmeta[n-1].seq
	taken := append(s.taken[:0], s.qmeta[:n]...)
	frame := append(s.frame[:0], make([]byte, keylog.FrameHeaderSize)...)
	frame = append(frame, s.queue[:end]...)
	s.queue = s.queue[:copy(s.queue, s.queue[end:])]
	s.qmeta = s.qmeta[:copy(s.qmeta, s.qmeta[n:])]
	for i := range s.qmeta {
		s.qmeta[i].end -= end
	}
	if len(s.queue) == 0 && cap(s.queue) > 4*keylog.MaxFrameBody {
		s.queue, s.qmeta = nil, nil
	}
	off := s.size
	s.size += int64(len(frame))
	s.writtenSeq = last
	f := s.f
	s.acquireFlusherLocked()
	s.mu.Unlock()

	s.hdr.PutFrameHeader(frame)
	_, err := f.WriteAt(frame, off)
	if err == nil {
		err = s.cfg.sync(f)
	}
	if err != nil {
		// After a failed fsync, Linux may mark the frame's pages clean
		// while they never reached the disk, and a reopen in the same
		// boot would read the frame back and hand out, as durable, keys
		// whose Acquire failed. Cut it off: none of it was acknowledged.
		if terr := f.Truncate(off); terr == nil {
			_ = s.cfg.sync(f)
		}
	}

	s.mu.Lock()
	s.frame, s.taken = frame, taken
	if err != nil {
		s.err = fmt.Errorf("idemhttp: key store %s: write failed; the store must be reopened: %w", s.path, err)
	} else {
		s.durableSeq = last
		for _, q := range taken {
			if !q.release && s.inflight[q.op] == q.seq {
				delete(s.inflight, q.op)
			}
		}
	}
	s.releaseFlusherLocked()
	s.maybeCompactLocked()
}
