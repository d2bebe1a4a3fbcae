// Package keylog is the on-disk format of the file key store: a versioned
// file header followed by checksummed frames, each frame holding the records
// of one commit. docs/keystore-format.md describes the layout byte by byte.
package keylog

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"

	"github.com/idemhttp/idemhttp/internal/varint"
)

const (
	// Magic opens every key store file.
	Magic = "IDEMKEYS"
	// Version is the format version this package writes and reads.
	Version = 1
	// HeaderSize is the size of the file header: magic, version, flags and
	// a CRC-32C of the preceding 12 bytes.
	HeaderSize = 16
	// FrameHeaderSize is the size of a frame header: body length, CRC-32C
	// of the body and CRC-32C of the first 8 header bytes.
	FrameHeaderSize = 12
	// MaxFrameBody is the largest frame body a writer produces and a reader
	// accepts.
	MaxFrameBody = 1 << 20
	// MaxOperationLen is the longest operation id a record may hold.
	MaxOperationLen = 1024
	// MaxKeyLen is the longest idempotency key a record may hold.
	MaxKeyLen = 1024
)

// Kind is the type of a record.
type Kind byte

const (
	// KindAcquire records a pending key: operation, key and creation time.
	KindAcquire Kind = 1
	// KindRelease forgets the pending key of an operation.
	KindRelease Kind = 2
)

// A Record is one decoded record. Operation and Key alias the frame body
// they were decoded from and are valid only as long as that buffer is.
type Record struct {
	Kind      Kind
	Created   int64 // Unix nanoseconds; zero for releases
	Operation []byte
	Key       []byte
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// Header errors.
var (
	// ErrNotKeyLog means the file does not start with [Magic].
	ErrNotKeyLog = errors.New("not an idemhttp key store")
	// ErrHeaderChecksum means the file header fails its checksum.
	ErrHeaderChecksum = errors.New("file header checksum mismatch")
)

// VersionError reports a file written in a format version, or with
// header flags, this package cannot read: a later release's file, which is
// refused rather than read, repaired or salvaged as this release's.
type VersionError struct {
	Version uint16
	Flags   uint16
}

// Error implements the error interface.
func (e *VersionError) Error() string {
	if e.Version == Version {
		return fmt.Sprintf("unsupported format flags %#04x (this build reads version %d without flags)", e.Flags, Version)
	}
	return fmt.Sprintf("unsupported format version %d (this build reads version %d)", e.Version, Version)
}

// AppendHeader appends the file header to b.
func AppendHeader(b []byte) []byte {
	start := len(b)
	b = append(b, Magic...)
	b = binary.LittleEndian.AppendUint16(b, Version)
	b = binary.LittleEndian.AppendUint16(b, 0) // flags
	return binary.LittleEndian.AppendUint32(b, checksum(b[start:]))
}

// CheckHeader validates a file header of [HeaderSize] bytes.
func CheckHeader(h []byte) error {
	if len(h) < HeaderSize || string(h[:len(Magic)]) != Magic {
		return ErrNotKeyLog
	}
	if checksum(h[:12]) != binary.LittleEndian.Uint32(h[12:]) {
		return ErrHeaderChecksum
	}
	v, flags := binary.LittleEndian.Uint16(h[8:]), binary.LittleEndian.Uint16(h[10:])
	if v != Version || flags != 0 {
		return &VersionError{Version: v, Flags: flags}
	}
	return nil
}

// IsUnfinishedHeader reports whether b, a whole file of at most a
// header's length that is not a complete header, is what a crash while
// creating the file can leave behind: the start of a header, followed by
// nothing or by zero bytes (a file system may show an extent that was
// allocated but never written as zeros). Nothing was ever stored in such a
// file: records are appended only after the header is durable.
func IsUnfinishedHeader(b []byte) bool {
	full := AppendHeader(nil)
	if len(b) > len(full) {
		return false
	}
	i := 0
	for i < len(b) && b[i] == full[i] {
		i++
	}
	if i == len(full) {
		return false // complete
	}
	for _, c := range b[i:] {
		if c != 0 {
			return false
		}
	}
	return true
}

// AcquireSize is the encoded size of an acquire record.
func AcquireSize(opLen, keyLen int) int {
	return 1 + 8 + varint.Len(uint64(opLen)) + opLen + varint.Len(uint64(keyLen)) + keyLen
}

// AppendAcquire appends an acquire record to b.
func AppendAcquire(b []byte, op, key string, created int64) []byte {
	b = append(b, byte(KindAcquire))
	b = binary.LittleEndian.AppendUint64(b, uint64(created))
	return appendOpKey(b, op, key)
}

// AppendRelease appends a release record to b.
func AppendRelease(b []byte, op, key string) []byte {
	b = append(b, byte(KindRelease))
	return appendOpKey(b, op, key)
}

func appendOpKey(b []byte, op, key string) []byte {
	b = binary.AppendUvarint(b, uint64(len(op)))
	b = append(b, op...)
	b = binary.AppendUvarint(b, uint64(len(key)))
	return append(b, key...)
}

// PutFrameHeader fills frame[:FrameHeaderSize] for the body that follows it
// in frame.
func PutFrameHeader(frame []byte) {
	body := frame[FrameHeaderSize:]
	binary.LittleEndian.PutUint32(frame[0:], uint32(len(body)))
	binary.LittleEndian.PutUint32(frame[4:], checksum(body))
	binary.LittleEndian.PutUint32(frame[8:], checksum(frame[:8]))
}

// ParseFrameHeader validates a frame header and returns the body length and
// checksum it announces. ok is false when the header fails its own checksum
// or announces an impossible length.
func ParseFrameHeader(h []byte) (bodyLen int, bodyCRC uint32, ok bool) {
	if len(h) < FrameHeaderSize || checksum(h[:8]) != binary.LittleEndian.Uint32(h[8:]) {
		return 0, 0, false
	}
	n := binary.LittleEndian.Uint32(h[0:])
	if n == 0 || n > MaxFrameBody {
		return 0, 0, false
	}
	return int(n), binary.LittleEndian.Uint32(h[4:]), true
}

// BodyOK reports whether body matches the checksum from its frame header.
func BodyOK(body []byte, crc uint32) bool { return checksum(body) == crc }

// DecodeRecords appends the records of a frame body to recs. If any record
// is malformed it returns recs unchanged and an error: a frame applies
// entirely or not at all.
func DecodeRecords(body []byte, recs []Record) ([]Record, error) {
	n := len(recs)
	for off := 0; off < len(body); {
		r, w, err := decodeRecord(body[off:])
		if err != nil {
			return recs[:n], fmt.Errorf("record at body offset %d: %w", off, err)
		}
		recs = append(recs, r)
		off += w
	}
	return recs, nil
}

func decodeRecord(b []byte) (Record, int, error) {
	var r Record
	if len(b) == 0 {
		return r, 0, errors.New("empty record")
	}
	r.Kind = Kind(b[0])
	off := 1
	switch r.Kind {
	case KindAcquire:
		if len(b) < off+8 {
			return r, 0, errors.New("short acquire record")
		}
		r.Created = int64(binary.LittleEndian.Uint64(b[off:]))
		off += 8
	case KindRelease:
	default:
		return r, 0, fmt.Errorf("unknown record type %d", b[0])
	}
	var err error
	if r.Operation, off, err = field(b, off, MaxOperationLen, "operation"); err != nil {
		return r, 0, err
	}
	if r.Key, off, err = field(b, off, MaxKeyLen, "key"); err != nil {
		return r, 0, err
	}
	return r, off, nil
}

func field(b []byte, off, limit int, name string) ([]byte, int, error) {
	n, w := binary.Uvarint(b[off:])
	if w <= 0 {
		return nil, 0, fmt.Errorf("bad %s length", name)
	}
	off += w
	if n == 0 || n > uint64(limit) || n > uint64(len(b)-off) {
		return nil, 0, fmt.Errorf("%s length %d out of range", name, n)
	}
	return b[off : off+int(n)], off + int(n), nil
}
