package idemhttp

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/idemhttp/idemhttp/internal/keylog"
)

// liveRecord is a pending key as compaction writes it.
type liveRecord struct {
	op string
	e  entryValue
}

func (s *FileKeyStore) tempPath() string { return s.path + ".compact" }

// maybeCompactLocked starts a background compaction once the file is mostly
// released records. At most one runs at a time and Close waits for it.
func (s *FileKeyStore) maybeCompactLocked() {
	if s.compacting != nil || s.closed || s.err != nil || s.cfg.compactMinSize <= 0 {
		return
	}
	if s.size < s.cfg.compactMinSize || s.size < s.compactRetryAt ||
		s.size < compactRatio*(s.hdr.Size()+s.liveBytes) {
		return
	}
	done := make(chan struct{})
	s.compacting = done
	go s.compact(done)
}

// snapshotLocked returns the pending keys as the file holds them once every
// record taken by a flush is written: records still queued are left out, and
// keys whose release is still queued are put back.
func (s *FileKeyStore) snapshotLocked() []liveRecord {
	live := make([]liveRecord, 0, len(s.entries))
	for op, e := range s.entries {
		if s.inflight[op] <= s.writtenSeq {
			live = append(live, liveRecord{op, e})
		}
	}
	for _, q := range s.qmeta {
		if q.release && q.acqSeq <= s.writtenSeq {
			live = append(live, liveRecord{q.op, q.e})
		}
	}
	return live
}

// compact rewrites the store without its released records. The live
// records are written while callers go on appending to the old file; only
// copying what they appended meanwhile, the final fsync and the rename hold
// them up.
func (s *FileKeyStore) compact(done chan struct{}) {
	defer func() {
		s.mu.Lock()
		s.compacting = nil
		s.mu.Unlock()
		close(done)
	}()
	s.mu.Lock()
	base := s.size
	live := s.snapshotLocked()
	s.mu.Unlock()

	stopped := func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.closed || s.err != nil
	}
	tf, n, err := s.writeCompacted(live, stopped)
	if err != nil {
		s.compactFailed(nil)
		return
	}

	s.mu.Lock()
	if s.closed || s.err != nil {
		s.mu.Unlock()
		s.discard(tf)
		return
	}
	s.acquireFlusherLocked()
	if s.closed || s.err != nil {
		s.releaseFlusherLocked()
		s.mu.Unlock()
		s.discard(tf)
		return
	}
	end, old := s.size, s.f
	s.mu.Unlock()

	_, err = io.Copy(io.NewOffsetWriter(tf, n), io.NewSectionReader(old, base, end-base))
	if err == nil {
		err = tf.Sync()
	}
	if err == nil {
		err = os.Rename(s.tempPath(), s.path)
	}
	if err != nil {
		s.compactFailed(tf)
		return
	}
	err = syncDir(filepath.Dir(s.path))

	s.mu.Lock()
	s.f, s.size = tf, n+end-base
	s.compactions++
	if err != nil {
		s.err = fmt.Errorf("idemhttp: key store %s: compaction rename not durable; the store must be reopened: %w", s.path, err)
	}
	s.releaseFlusherLocked()
	s.mu.Unlock()
	old.Close()
}

// compactFailed gives up a compaction that has not replaced the store; the
// old file is intact. The next attempt waits for the file to double. If tf
// is not nil the caller holds the flusher role, which is released.
func (s *FileKeyStore) compactFailed(tf *os.File) {
	s.mu.Lock()
	s.compactRetryAt = 2 * s.size
	if tf != nil {
		s.releaseFlusherLocked()
	}
	s.mu.Unlock()
	if tf != nil {
		s.discard(tf)
	}
}

func (s *FileKeyStore) discard(tf *os.File) {
	tf.Close()
	os.Remove(tf.Name())
}

// writeCompacted writes a complete, fsynced store file holding live to the
// temporary path, locked so it is never visible unlocked once renamed. It
// returns the file and its size. stopped is polled between frames.
func (s *FileKeyStore) writeCompacted(live []liveRecord, stopped func() bool) (*os.File, int64, error) {
	// The new file takes the old one's place, so it gets the mode the
	// operator gave the old one (umask aside: hence the Chmod).
	perm := os.FileMode(0o600)
	if fi, err := os.Stat(s.path); err == nil {
		perm = fi.Mode().Perm()
	}
	// Whatever holds the temporary name goes first, and O_EXCL creates the
	// file without following a symbolic link planted there, whose target
	// O_TRUNC would truncate and the rename would make the store.
	if err := os.Remove(s.tempPath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, 0, err
	}
	tf, err := os.OpenFile(s.tempPath(), os.O_RDWR|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return nil, 0, err
	}
	if err := tf.Chmod(perm); err != nil {
		s.discard(tf)
		return nil, 0, err
	}
	if err := lockTemp(tf); err != nil {
		s.discard(tf)
		return nil, 0, err
	}
	w := bufio.NewWriterSize(tf, keylog.MaxFrameBody+keylog.FrameHeaderSize)
	// The file's salt stays: the frames appended to the old file while
	// this one was written are copied as they are.
	size := s.hdr.Size()
	_, err = w.Write(s.hdr.Append(nil))
	frame := make([]byte, keylog.FrameHeaderSize, keylog.FrameHeaderSize+keylog.MaxFrameBody)
	flush := func() {
		if err != nil || len(frame) == keylog.FrameHeaderSize {
			return
		}
		s.hdr.PutFrameHeader(frame)
		_, err = w.Write(frame)
		size += int64(len(frame))
		frame = frame[:keylog.FrameHeaderSize]
		if err == nil && stopped() {
			err = ErrStoreClosed
		}
	}
	for _, r := range live {
		key := r.e.key()
		if len(frame)-keylog.FrameHeaderSize+keylog.AcquireSize(len(r.op), len(key)) > keylog.MaxFrameBody {
			flush()
		}
		frame = keylog.AppendAcquire(frame, r.op, key, r.e.created())
	}
	flush()
	if err == nil {
		err = w.Flush()
	}
	if err == nil {
		err = tf.Sync()
	}
	if err != nil {
		s.discard(tf)
		return nil, 0, err
	}
	return tf, size, nil
}

// rewrite replaces the store file with one holding only live. It is used
// at open, before any caller can append.
func (s *FileKeyStore) rewrite(live []liveRecord) error {
	tf, n, err := s.writeCompacted(live, func() bool { return false })
	if err == nil {
		if err = os.Rename(s.tempPath(), s.path); err != nil {
			s.discard(tf)
		}
	}
	if err != nil {
		return fmt.Errorf("idemhttp: rewrite key store %s: %w", s.path, err)
	}
	s.f.Close()
	s.f, s.size = tf, n
	if err := syncDir(filepath.Dir(s.path)); err != nil {
		return fmt.Errorf("idemhttp: rewrite key store %s: %w", s.path, err)
	}
	return nil
}
