// Package respcodec is the compact binary form in which shared stores (a
// database's bytea, a Redis string) keep an [idemserver.Response].
//
// The first byte is the format version, so that a later release reads what
// an earlier one wrote. Version 1:
//
//	version  one byte, 1
//	status   uvarint
//	flags    one byte; bit 0: the body was omitted; other bits are zero
//	fields   uvarint count of header fields, then per field: uvarint
//	         len(name), name, uvarint count of values, then per value
//	         uvarint len(value), value
//	body     uvarint len(body), body; nothing follows
//
// Version 2 is the middleware's own packed form of a response
// ([idemserver.PackedResponse]), after the version byte, so that a store
// that implements [idemserver.PackedStore] keeps and returns what the
// middleware records and replays without converting it:
//
//	version  one byte, 2
//	packed   the bytes of [idemserver.PackedResponse.AppendBinary]
//
// [Append] writes version 1 and [AppendPacked] version 2; [Decode] and
// [DecodePacked] read both.
//
// Decode refuses what it cannot read with certainty: an encoding of a
// version it does not know fails with an error wrapping [ErrUnknownVersion]
// (written by a newer release; a store reports it, and the middleware
// answers 503 rather than replay something it misread), and a damaged one
// with an error wrapping [ErrCorrupt]. It never returns a response that
// differs from the one encoded.
package respcodec

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"

	"github.com/idemhttp/idemhttp/idemserver"

	"github.com/idemhttp/idemhttp/internal/varint"
)

// Version is the format version that [Append] writes.
const Version = 1

// PackedVersion is the format version that [AppendPacked] writes.
const PackedVersion = 2

// Errors of [Decode]. Use errors.Is to test for them.
var (
	// ErrUnknownVersion means the encoding has a format version that this
	// release cannot read.
	ErrUnknownVersion = errors.New("respcodec: unknown format version")
	// ErrCorrupt means the encoding is not a valid one of its version.
	ErrCorrupt = errors.New("respcodec: corrupt encoding")
)

const flagOmitted = 1

// Size returns the length of the encoding of resp.
func Size(resp *idemserver.Response) int {
	n := 1 + varint.Len(uint64(resp.Status)) + 1 + varint.Len(uint64(len(resp.Header)))
	for name, values := range resp.Header {
		n += varint.Len(uint64(len(name))) + len(name) + varint.Len(uint64(len(values)))
		for _, v := range values {
			n += varint.Len(uint64(len(v))) + len(v)
		}
	}
	body := len(resp.Body)
	if resp.BodyOmitted {
		body = 0
	}
	return n + varint.Len(uint64(body)) + body
}

// Append appends the encoding of resp to b and returns the extended
// buffer. The body of a response whose BodyOmitted is set is not encoded.
func Append(b []byte, resp *idemserver.Response) []byte {
	b = append(b, Version)
	b = binary.AppendUvarint(b, uint64(resp.Status))
	flags := byte(0)
	if resp.BodyOmitted {
		flags |= flagOmitted
	}
	b = append(b, flags)
	b = binary.AppendUvarint(b, uint64(len(resp.Header)))
	for name, values := range resp.Header {
		b = appendString(b, name)
		b = binary.AppendUvarint(b, uint64(len(values)))
		for _, v := range values {
			b = appendString(b, v)
		}
	}
	if resp.BodyOmitted {
		return append(b, 0)
	}
	b = binary.AppendUvarint(b, uint64(len(resp.Body)))
	return append(b, resp.Body...)
}

// Encode returns the encoding of resp.
func Encode(resp *idemserver.Response) []byte {
	return Append(make([]byte, 0, Size(resp)), resp)
}

// AppendPacked appends the encoding of p, in version [PackedVersion], to b
// and returns the extended buffer.
func AppendPacked(b []byte, p idemserver.PackedResponse) []byte {
	b, _ = p.AppendBinary(append(b, PackedVersion)) // AppendBinary never fails
	return b
}

// DecodePacked returns, in packed form, the response that s encodes, in
// either version. The encoding of version 2 is checked and shared, not
// copied; one of version 1 is decoded and packed anew.
func DecodePacked(s string) (idemserver.PackedResponse, error) {
	if len(s) > 0 && s[0] == PackedVersion {
		return parsePacked(s[1:])
	}
	resp, err := Decode([]byte(s))
	if err != nil {
		return idemserver.PackedResponse{}, err
	}
	return idemserver.PackResponse(resp), nil
}

// parsePacked returns the packed response s, or an error wrapping
// ErrCorrupt.
func parsePacked(s string) (idemserver.PackedResponse, error) {
	p, err := idemserver.ParsePackedResponse(s)
	if err != nil {
		return idemserver.PackedResponse{}, fmt.Errorf("%w: version %d: %v", ErrCorrupt, PackedVersion, err)
	}
	return p, nil
}

// Decode returns the response that b encodes, in either version. The body
// of a version 1 response shares b's memory, and its header names and
// values share one new string; a version 2 response shares nothing with b.
// A response without header fields has a nil Header, and one without a
// body a nil Body.
func Decode(b []byte) (*idemserver.Response, error) {
	if len(b) == 0 {
		return nil, fmt.Errorf("%w: empty", ErrCorrupt)
	}
	switch b[0] {
	case Version:
	case PackedVersion:
		p, err := parsePacked(string(b[1:]))
		if err != nil {
			return nil, err
		}
		return p.Response(), nil
	default:
		return nil, fmt.Errorf("%w %d (this release reads versions %d and %d)", ErrUnknownVersion, b[0], Version, PackedVersion)
	}
	d := decoder{b: b, i: 1}
	status := d.uvarint()
	if d.err == nil && (status < 100 || status > 999) {
		d.fail("status %d", status)
	}
	flags := d.byte()
	if d.err == nil && flags&^flagOmitted != 0 {
		d.fail("unknown flags %#x", flags)
	}
	nfields := d.count(2) // a field takes at least two bytes
	if d.err != nil {
		return nil, d.err
	}
	resp := &idemserver.Response{Status: int(status), BodyOmitted: flags&flagOmitted != 0}
	if nfields > 0 {
		// The names and values become substrings of one string.
		start := d.i
		var nvalues int
		for range nfields {
			d.bytes()
			n := d.count(1)
			nvalues += n
			for range n {
				d.bytes()
			}
		}
		if d.err != nil {
			return nil, d.err
		}
		s := string(b[start:d.i])
		all := make([]string, nvalues)
		resp.Header = make(http.Header, nfields)
		d = decoder{b: b, i: start}
		str := func() string {
			n := int(d.uvarint())
			v := s[d.i-start : d.i-start+n]
			d.i += n
			return v
		}
		for range nfields {
			name := str()
			n := int(d.uvarint())
			values := all[:n:n]
			all = all[n:]
			for j := range values {
				values[j] = str()
			}
			if _, dup := resp.Header[name]; dup {
				return nil, fmt.Errorf("%w: field %q twice", ErrCorrupt, name)
			}
			resp.Header[name] = values
		}
	}
	n := d.uvarint()
	switch {
	case d.err != nil:
		return nil, d.err
	case n != uint64(len(b)-d.i):
		return nil, fmt.Errorf("%w: body of %d bytes in %d remaining", ErrCorrupt, n, len(b)-d.i)
	case n > 0 && resp.BodyOmitted:
		return nil, fmt.Errorf("%w: a body, and the flag that says it was omitted", ErrCorrupt)
	case n > 0:
		resp.Body = b[d.i:len(b):len(b)]
	}
	return resp, nil
}

// decoder reads b from i; the first error sticks and makes every later
// read return zero.
type decoder struct {
	b   []byte
	i   int
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s at byte %d", ErrCorrupt, fmt.Sprintf(format, args...), d.i)
	}
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b[d.i:])
	if n <= 0 || n != varint.Len(v) {
		// Only the shortest form is valid, so that each response has one
		// encoding (up to the order of its fields).
		d.fail("bad uvarint")
		return 0
	}
	d.i += n
	return v
}

func (d *decoder) byte() byte {
	if d.err != nil {
		return 0
	}
	if d.i >= len(d.b) {
		d.fail("truncated")
		return 0
	}
	c := d.b[d.i]
	d.i++
	return c
}

// count reads a count of items that take at least min bytes each, and
// fails if the rest of the encoding cannot hold that many.
func (d *decoder) count(min int) int {
	v := d.uvarint()
	if d.err == nil && v > uint64((len(d.b)-d.i)/min) {
		d.fail("count %d larger than the encoding", v)
		return 0
	}
	return int(v)
}

// bytes skips a length-prefixed string.
func (d *decoder) bytes() {
	n := d.uvarint()
	if d.err == nil && n > uint64(len(d.b)-d.i) {
		d.fail("length %d past the end", n)
		return
	}
	d.i += int(n)
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}
