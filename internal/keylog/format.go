// Package keylog is the on-disk format of the file key store: a versioned
// file header followed by checksummed frames, each frame holding the records
// of one commit. docs/keystore-format.md describes the layout byte by byte.
package keylog

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"

	"github.com/idemhttp/idemhttp/internal/varint"
)

const (
	// Magic opens every key store file.
	Magic = "IDEMKEYS"
	// Version is the format version this package writes. It also reads
	// version 1, whose frames' checksums have no salt.
	Version = 2
	// HeaderSize is the size of the file header this package writes:
	// magic, version, flags, salt and a CRC-32C of the preceding 20 bytes.
	HeaderSize = 24
	// headerSizeV1 is the size of a version 1 header, which has no salt.
	headerSizeV1 = 16
	// SaltSize is the size of a file's salt.
	SaltSize = 8
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
	// ErrShortHeader means the file ends inside its header.
	ErrShortHeader = errors.New("file shorter than its header")
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
	if e.Version == 1 || e.Version == Version {
		return fmt.Sprintf("unsupported format flags %#04x (this build reads versions 1 and %d without flags)", e.Flags, Version)
	}
	return fmt.Sprintf("unsupported format version %d (this build reads versions 1 and %d)", e.Version, Version)
}

// A Header is what a file's header says about the frames that follow it:
// the format version and, from version 2 on, the salt their checksums
// start from.
//
// The salt is random, made when the file is, and never leaves the file.
// Operation ids and keys are opaque bytes, so a record can hold bytes laid
// out as a frame; when recovery searches damaged bytes for the next frame,
// such a frame would be taken for a real one if its checksums were
// computable without the file. Checksums continued from the salt are not:
// a frame made outside the file fails them.
type Header struct {
	version uint16
	salt    [SaltSize]byte
	seed    uint32 // the CRC-32C of the salt, from which frame checksums continue
}

// NewHeader returns the header of a new file: the current version, with
// a salt from crypto/rand.
func NewHeader() (Header, error) {
	h := Header{version: Version}
	if _, err := rand.Read(h.salt[:]); err != nil {
		return Header{}, fmt.Errorf("make the file's salt: %w", err)
	}
	h.seed = checksum(h.salt[:])
	return h, nil
}

// V1Header returns the header of a version 1 file, whose checksums have
// no salt.
func V1Header() Header { return Header{version: 1} }

// Version returns the format version of the file.
func (h Header) Version() uint16 { return h.version }

// Size returns the size of the header in the file.
func (h Header) Size() int64 {
	if h.version == 1 {
		return headerSizeV1
	}
	return HeaderSize
}

// Append appends the header to b.
func (h Header) Append(b []byte) []byte {
	start := len(b)
	b = append(b, Magic...)
	b = binary.LittleEndian.AppendUint16(b, h.version)
	b = binary.LittleEndian.AppendUint16(b, 0) // flags
	if h.version != 1 {
		b = append(b, h.salt[:]...)
	}
	return binary.LittleEndian.AppendUint32(b, checksum(b[start:]))
}

// ReadHeader parses the header at the start of b, the first bytes of a
// file (at least [HeaderSize] of them, unless the file is shorter). A
// version this package does not know is taken to lay out its first 24
// bytes as version 2 does, so that its header's checksum can be told from
// damage; once that checks, it is refused with a [*VersionError].
func ReadHeader(b []byte) (Header, error) {
	if len(b) < len(Magic) || string(b[:len(Magic)]) != Magic {
		return Header{}, ErrNotKeyLog
	}
	if len(b) < len(Magic)+4 {
		return Header{}, ErrShortHeader
	}
	h := Header{version: binary.LittleEndian.Uint16(b[8:])}
	n := int(h.Size())
	if len(b) < n {
		return Header{}, ErrShortHeader
	}
	if checksum(b[:n-4]) != binary.LittleEndian.Uint32(b[n-4:]) {
		return Header{}, ErrHeaderChecksum
	}
	flags := binary.LittleEndian.Uint16(b[10:])
	if (h.version != 1 && h.version != Version) || flags != 0 {
		return Header{}, &VersionError{Version: h.version, Flags: flags}
	}
	if h.version != 1 {
		copy(h.salt[:], b[12:])
		h.seed = checksum(h.salt[:])
	}
	return h, nil
}

// IsUnfinishedHeader reports whether b, a whole file of at most
// [HeaderSize] bytes that is not a complete header, is what a crash while
// creating the file can leave behind: the start of a header, followed by
// nothing or by zero bytes (a file system may show an extent that was
// allocated but never written as zeros). The salt is random, so any bytes
// may stand where it goes, after the whole magic, version and flags.
// Nothing was ever stored in such a file: records are appended only after
// the header is durable.
func IsUnfinishedHeader(b []byte) bool {
	if len(b) > HeaderSize {
		return false
	}
	if _, err := ReadHeader(b); err == nil {
		return false // complete
	}
	v1 := V1Header().Append(nil)
	if len(b) <= len(v1) && prefixThenZeros(b, v1) {
		return true
	}
	// The part of a current header that does not vary: magic, version
	// and flags. Once it is whole, the salt and the checksum after it may
	// be anything; before, only zeros follow what was written, as in a
	// header whose salt is zeros.
	zeroSalt := Header{version: Version}.Append(nil)
	fixed := zeroSalt[:len(Magic)+4]
	if len(b) >= len(fixed) && string(b[:len(fixed)]) == string(fixed) {
		return true
	}
	return prefixThenZeros(b, zeroSalt)
}

// prefixThenZeros reports whether b is a prefix of full followed by zero
// bytes.
func prefixThenZeros(b, full []byte) bool {
	i := 0
	for i < len(b) && b[i] == full[i] {
		i++
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
// in frame, with checksums continued from the file's salt.
func (h Header) PutFrameHeader(frame []byte) {
	body := frame[FrameHeaderSize:]
	binary.LittleEndian.PutUint32(frame[0:], uint32(len(body)))
	binary.LittleEndian.PutUint32(frame[4:], h.checksum(body))
	binary.LittleEndian.PutUint32(frame[8:], h.checksum(frame[:8]))
}

// ParseFrameHeader validates a frame header and returns the body length and
// checksum it announces. ok is false when the header fails its own checksum
// or announces an impossible length.
func (h Header) ParseFrameHeader(fh []byte) (bodyLen int, bodyCRC uint32, ok bool) {
	if len(fh) < FrameHeaderSize || h.checksum(fh[:8]) != binary.LittleEndian.Uint32(fh[8:]) {
		return 0, 0, false
	}
	n := binary.LittleEndian.Uint32(fh[0:])
	if n == 0 || n > MaxFrameBody {
		return 0, 0, false
	}
	return int(n), binary.LittleEndian.Uint32(fh[4:]), true
}

// BodyOK reports whether body matches the checksum from its frame header.
func (h Header) BodyOK(body []byte, crc uint32) bool { return h.checksum(body) == crc }

// checksum is the CRC-32C of the salt followed by b: a frame's checksum.
// Version 1 has no salt.
func (h Header) checksum(b []byte) uint32 { return crc32.Update(h.seed, castagnoli, b) }

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
