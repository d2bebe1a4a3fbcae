package keylog

import (
	"bufio"
	"errors"
	"fmt"
	"io"
)

// BadFrame reports bytes that are not a valid frame.
type BadFrame struct {
	// Offset is where the bad frame starts.
	Offset int64
	// Next is the offset of the next valid frame after Offset, or -1 when no
	// valid frame follows: the bad bytes are a torn tail.
	Next int64
	// Reason says what is wrong.
	Reason string
}

// Error implements the error interface.
func (e *BadFrame) Error() string {
	return fmt.Sprintf("bad frame at offset %d: %s", e.Offset, e.Reason)
}

// Torn reports whether nothing valid follows the bad frame, which is what an
// append interrupted by a crash leaves behind.
func (e *BadFrame) Torn() bool { return e.Next < 0 }

// A Scanner reads the frames of a key store file in order.
type Scanner struct {
	h    Header
	r    io.ReaderAt
	size int64
	off  int64
	br   *bufio.Reader
	hdr  [FrameHeaderSize]byte
	body []byte
}

// NewScanner returns a Scanner over the first size bytes of r, a file
// whose header is h, starting at the first frame, just after the header.
func NewScanner(r io.ReaderAt, size int64, h Header) *Scanner {
	s := &Scanner{h: h, r: r, size: size}
	s.Reset(h.Size())
	return s
}

// Reset moves the scanner to the frame at off.
func (s *Scanner) Reset(off int64) {
	s.off = off
	sr := io.NewSectionReader(s.r, off, max(s.size-off, 0))
	if s.br == nil {
		s.br = bufio.NewReaderSize(sr, 1<<20)
	} else {
		s.br.Reset(sr)
	}
}

// Next returns the offset and body of the next frame. The body is valid
// until the next call. At the end of the file Next returns io.EOF; at bytes
// that do not form a valid frame it returns a *BadFrame without moving, so
// the caller decides whether to stop or to Reset to BadFrame.Next.
func (s *Scanner) Next() (off int64, body []byte, err error) {
	off = s.off
	remain := s.size - off
	if remain == 0 {
		return off, nil, io.EOF
	}
	if remain < FrameHeaderSize {
		return off, nil, s.bad(off, "incomplete frame header")
	}
	if _, err := io.ReadFull(s.br, s.hdr[:]); err != nil {
		return off, nil, readErr(err)
	}
	n, crc, ok := s.h.ParseFrameHeader(s.hdr[:])
	if !ok {
		return off, nil, s.bad(off, "frame header checksum mismatch")
	}
	if int64(n) > remain-FrameHeaderSize {
		// The header checks out, so its length is trusted: this is the
		// last write, cut short. Nothing inside it is searched for frames;
		// a record's opaque bytes can hold one.
		return off, nil, &BadFrame{Offset: off, Next: -1, Reason: "frame extends past the end of the file"}
	}
	if cap(s.body) < n {
		s.body = make([]byte, n)
	}
	body = s.body[:n]
	if _, err := io.ReadFull(s.br, body); err != nil {
		return off, nil, readErr(err)
	}
	if !s.h.BodyOK(body, crc) {
		// The header checks out, so the damage ends where its length says:
		// the search for the next frame starts there, never inside the
		// body, whose records' opaque bytes can hold a frame.
		end := off + FrameHeaderSize + int64(n)
		if end == s.size {
			return off, nil, &BadFrame{Offset: off, Next: -1, Reason: "frame checksum mismatch"}
		}
		// A frame with bytes after its end was not the last write: frames
		// are appended only after the previous one is fsynced, so this one
		// was acknowledged, and its damage is corruption, never a torn
		// tail. Resume at the next valid frame, or just after it.
		next, err := s.Resync(end)
		if err != nil {
			return off, nil, err
		}
		if next < 0 {
			next = end
		}
		return off, nil, &BadFrame{Offset: off, Next: next, Reason: "frame checksum mismatch"}
	}
	s.off += FrameHeaderSize + int64(n)
	return off, body, nil
}

func readErr(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("file shrank while being read: %w", io.ErrUnexpectedEOF)
	}
	return err
}

func (s *Scanner) bad(off int64, reason string) error {
	next, err := s.Resync(off + 1)
	if err != nil {
		return err
	}
	return &BadFrame{Offset: off, Next: next, Reason: reason}
}

// Resync returns the offset of the first valid frame at or after from, or
// -1 if there is none. A candidate must pass the frame header checksum
// before its body is read, so scanning garbage costs one small checksum per
// byte.
func (s *Scanner) Resync(from int64) (int64, error) {
	const window = 64 << 10
	buf := make([]byte, window+FrameHeaderSize-1)
	var body []byte
	for base := from; base+FrameHeaderSize <= s.size; base += window {
		n, err := s.r.ReadAt(buf[:min(int64(len(buf)), s.size-base)], base)
		if err != nil && !errors.Is(err, io.EOF) {
			return 0, err
		}
		for i := 0; i+FrameHeaderSize <= n && i < window; i++ {
			bl, crc, ok := s.h.ParseFrameHeader(buf[i:])
			at := base + int64(i)
			if !ok || int64(bl) > s.size-at-FrameHeaderSize {
				continue
			}
			if cap(body) < bl {
				body = make([]byte, bl)
			}
			if _, err := s.r.ReadAt(body[:bl], at+FrameHeaderSize); err != nil {
				return 0, err
			}
			if s.h.BodyOK(body[:bl], crc) {
				return at, nil
			}
		}
	}
	return -1, nil
}
