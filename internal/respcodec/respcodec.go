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
	"strings"

	"github.com/idemhttp/idemhttp/idemserver"

	"github.com/idemhttp/idemhttp/internal/varint"
)

// Version is the format version that [Append] writes.
const Version = 1

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

// Decode returns the response that b encodes. The response's body shares
// b's memory; its header names and values share one new string. A response
// without header fields has a nil Header, and one without a body a nil Body.
func Decode(b []byte) (*idemserver.Response, error) {
	l, err := scan(b)
	if err != nil {
		return nil, err
	}
	resp := &idemserver.Response{Status: int(l.status), BodyOmitted: l.flags&flagOmitted != 0}
	if l.nfields > 0 {
		// The names and values become substrings of one string.
		s := string(b[l.fields:l.fieldsEnd])
		all := make([]string, l.nvalues)
		resp.Header = make(http.Header, l.nfields)
		d := decoder{b: b, i: l.fields}
		str := func() string {
			n := int(d.uvarint())
			v := s[d.i-l.fields : d.i-l.fields+n]
			d.i += n
			return v
		}
		for range l.nfields {
			name := str()
			n := int(d.uvarint())
			values := all[:n:n]
			all = all[n:]
			for j := range values {
				values[j] = str()
			}
			resp.Header[name] = values
		}
	}
	if l.body < len(b) {
		resp.Body = b[l.body:len(b):len(b)]
	}
	return resp, nil
}

// layout is where the parts of a valid encoding lie.
type layout struct {
	status            uint64
	flags             byte
	nfields, nvalues  int
	fields, fieldsEnd int // the header fields, as encoded
	body              int // the body runs from here to the end
}

// scan checks b as Decode does, and returns its layout.
func scan(b []byte) (layout, error) {
	var l layout
	if len(b) == 0 {
		return l, fmt.Errorf("%w: empty", ErrCorrupt)
	}
	if b[0] != Version {
		return l, fmt.Errorf("%w %d (this release reads version %d)", ErrUnknownVersion, b[0], Version)
	}
	d := decoder{b: b, i: 1}
	l.status = d.uvarint()
	if d.err == nil && (l.status < 100 || l.status > 999) {
		d.fail("status %d", l.status)
	}
	l.flags = d.byte()
	if d.err == nil && l.flags&^flagOmitted != 0 {
		d.fail("unknown flags %#x", l.flags)
	}
	l.nfields = d.count(2) // a field takes at least two bytes
	l.fields = d.i
	names := make(map[string]struct{}, min(l.nfields, 64))
	for range l.nfields {
		start := d.i
		d.bytes()
		if d.err != nil {
			return l, d.err
		}
		name := b[start:d.i]
		_, w := binary.Uvarint(name)
		if _, dup := names[string(name[w:])]; dup {
			return l, fmt.Errorf("%w: field %q twice", ErrCorrupt, name[w:])
		}
		names[string(name[w:])] = struct{}{}
		n := d.count(1)
		l.nvalues += n
		for range n {
			d.bytes()
		}
	}
	l.fieldsEnd = d.i
	n := d.uvarint()
	l.body = d.i
	switch {
	case d.err != nil:
		return l, d.err
	case n != uint64(len(b)-d.i):
		return l, fmt.Errorf("%w: body of %d bytes in %d remaining", ErrCorrupt, n, len(b)-d.i)
	case n > 0 && l.flags&flagOmitted != 0:
		return l, fmt.Errorf("%w: a body, and the flag that says it was omitted", ErrCorrupt)
	}
	return l, nil
}

// Packed returns the response that enc encodes as an
// [idemserver.PackedResponse], without making it a Response first: the
// header fields are encoded alike in both forms, so they are copied whole.
// It checks enc as Decode does. The result has memory of its own.
//
// It relies on the packed form that package idemserver documents beside
// [idemserver.PackedResponse]; the tests check that the translations agree
// with PackResponse and Response.
func Packed(enc string) (idemserver.PackedResponse, error) {
	b := []byte(enc)
	l, err := scan(b)
	if err != nil {
		return idemserver.PackedResponse{}, err
	}
	fields, body := b[l.fields:l.fieldsEnd], b[l.body:]
	var p strings.Builder
	p.Grow(varint.Len(l.status) + 1 + varint.Len(uint64(len(fields))) + len(fields) + len(body))
	var n [binary.MaxVarintLen64]byte
	p.Write(binary.AppendUvarint(n[:0], l.status))
	p.WriteByte(l.flags) // the same bit in both forms
	p.Write(binary.AppendUvarint(n[:0], uint64(len(fields))))
	p.Write(fields)
	p.Write(body)
	return idemserver.ParsePackedResponse(p.String())
}

// AppendPacked appends the encoding of the packed response p to dst, as
// Append would of p.Response(), without making it a Response first. A zero
// p, or packed bytes that are not a response, give an error.
func AppendPacked(dst []byte, p idemserver.PackedResponse) ([]byte, error) {
	if p.IsZero() {
		return dst, fmt.Errorf("%w: no response", ErrCorrupt)
	}
	packed, _ := p.AppendBinary(nil) // never fails
	// The packed form: status uvarint, flags byte, uvarint length of the
	// fields, the fields, then the body.
	d := decoder{b: packed}
	status := d.uvarint()
	flags := d.byte()
	flen := d.uvarint()
	if d.err != nil || flen > uint64(len(packed)-d.i) {
		return dst, fmt.Errorf("%w: packed response", ErrCorrupt)
	}
	fields, body := packed[d.i:d.i+int(flen)], packed[d.i+int(flen):]
	n := 0
	for f := (decoder{b: fields}); f.i < len(fields); n++ {
		f.bytes()
		for range f.uvarint() {
			f.bytes()
		}
		if f.err != nil {
			return dst, fmt.Errorf("%w: packed response fields", ErrCorrupt)
		}
	}
	if flags&flagOmitted != 0 {
		body = nil
	}
	dst = append(dst, Version)
	dst = binary.AppendUvarint(dst, status)
	dst = append(dst, flags)
	dst = binary.AppendUvarint(dst, uint64(n))
	dst = append(dst, fields...)
	dst = binary.AppendUvarint(dst, uint64(len(body)))
	return append(dst, body...), nil
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
