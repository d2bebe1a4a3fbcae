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
	"slices"
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

// Size returns the length of the encoding of resp, or a little more when
// resp has a field without a name, which the encoding leaves out.
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
	// The fields go in the order of their names, so that one response has
	// one encoding: a completion sent again is then recognised by its
	// bytes. A field without a name is left out: net/http does not send
	// it, and Decode refuses it.
	var buf [16]string // most responses have fewer fields: no allocation
	names := buf[:0]
	for name := range resp.Header {
		if name != "" {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	b = binary.AppendUvarint(b, uint64(len(names)))
	for _, name := range names {
		values := resp.Header[name]
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
	resp := &idemserver.Response{Status: l.status, BodyOmitted: l.omitted}
	if l.nfields > 0 {
		// The names and values become substrings of one string.
		s := string(b[l.fields:l.fieldsEnd])
		all := make([]string, l.nvalues)
		resp.Header = make(http.Header, l.nfields)
		d := decoder[string]{b: s}
		for range l.nfields {
			name := d.str()
			n := int(d.uvarint())
			values := all[:n:n]
			all = all[n:]
			for j := range values {
				values[j] = d.str()
			}
			if _, dup := resp.Header[name]; dup {
				return nil, errDuplicate(name)
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
	status           int
	flags            byte
	omitted          bool
	nfields, nvalues int
	// fields and fieldsEnd delimit the header fields, in the form that
	// Append writes them; body is where the body starts.
	fields, fieldsEnd, body int
}

// scan checks the encoding b and returns its layout.
func scan[T ~string | ~[]byte](b T) (layout, error) {
	var l layout
	if len(b) == 0 {
		return l, fmt.Errorf("%w: empty", ErrCorrupt)
	}
	if b[0] != Version {
		return l, fmt.Errorf("%w %d (this release reads version %d)", ErrUnknownVersion, b[0], Version)
	}
	d := decoder[T]{b: b, i: 1}
	status := d.uvarint()
	if d.err == nil && (status < 100 || status > 999) {
		d.fail("status %d", status)
	}
	flags := d.byte()
	if d.err == nil && flags&^flagOmitted != 0 {
		d.fail("unknown flags %#x", flags)
	}
	l.status, l.flags, l.omitted = int(status), flags, flags&flagOmitted != 0
	l.nfields = d.count(2) // a field takes at least two bytes
	l.fields = d.i
	for range l.nfields {
		if d.err == nil && d.i < len(b) && b[d.i] == 0 {
			d.fail("a header field without a name")
		}
		d.bytes()
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
	case n > 0 && l.omitted:
		return l, fmt.Errorf("%w: a body, and the flag that says it was omitted", ErrCorrupt)
	}
	return l, nil
}

// errDuplicate is the error of an encoding that holds field name twice,
// which scan leaves to its callers: Decode finds it in the map it builds.
func errDuplicate(name string) error {
	return fmt.Errorf("%w: field %q twice", ErrCorrupt, name)
}

// duplicateField returns a name that two of the n checked fields share.
func duplicateField[T ~string | ~[]byte](fields T, n int) (string, bool) {
	if n < 2 {
		return "", false
	}
	names := make([]T, 0, 16)
	d := decoder[T]{b: fields}
	for range n {
		l := int(d.uvarint())
		name := d.b[d.i : d.i+l]
		d.i += l
		for _, prev := range names {
			if string(prev) == string(name) {
				return string(name), true
			}
		}
		names = append(names, name)
		for range d.uvarint() {
			d.bytes()
		}
	}
	return "", false
}

// Packed returns the response that enc encodes as an
// [idemserver.PackedResponse], without making it a Response first: the
// fields of both forms are written alike, so they are copied whole. It
// checks enc as Decode does. The result has memory of its own.
//
// It relies on the packed form that package idemserver documents beside
// [idemserver.PackedResponse]; the package's tests check that the two
// translations agree with PackResponse and Response.
func Packed(enc string) (idemserver.PackedResponse, error) {
	l, err := scan(enc)
	if err != nil {
		return idemserver.PackedResponse{}, err
	}
	fields, body := enc[l.fields:l.fieldsEnd], enc[l.body:]
	if name, ok := duplicateField(fields, l.nfields); ok {
		return idemserver.PackedResponse{}, errDuplicate(name)
	}
	var b strings.Builder
	b.Grow(varint.Len(uint64(l.status)) + 1 + varint.Len(uint64(len(fields))) + len(fields) + len(body))
	varint.Write(&b, uint64(l.status))
	b.WriteByte(l.flags) // the same bits in both forms
	varint.Write(&b, uint64(len(fields)))
	b.WriteString(fields)
	b.WriteString(body)
	return idemserver.ParsePackedResponse(b.String())
}

// AppendPacked appends an encoding of the packed response p to dst, one
// that Decode reads as it reads Append's of p.Response(), without making
// it a Response first; its fields keep p's order, where Append sorts them.
// A zero p, or packed bytes that are not a response, give an error.
func AppendPacked(dst []byte, p idemserver.PackedResponse) ([]byte, error) {
	if p.IsZero() {
		return dst, fmt.Errorf("%w: no response", ErrCorrupt)
	}
	packed, _ := p.AppendBinary(nil) // never fails
	// status uvarint, flags byte, uvarint length of the fields, fields,
	// then the body.
	d := decoder[[]byte]{b: packed}
	status := d.uvarint()
	flags := d.byte()
	flen := d.uvarint()
	if d.err != nil || flen > uint64(len(packed)-d.i) {
		return dst, fmt.Errorf("%w: packed response", ErrCorrupt)
	}
	fields, body := packed[d.i:d.i+int(flen)], packed[d.i+int(flen):]
	n := 0
	for f := (decoder[[]byte]{b: fields}); f.i < len(fields) && f.err == nil; n++ {
		if fields[f.i] == 0 {
			return dst, fmt.Errorf("%w: a header field without a name", ErrCorrupt)
		}
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
type decoder[T ~string | ~[]byte] struct {
	b   T
	i   int
	err error
}

func (d *decoder[T]) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s at byte %d", ErrCorrupt, fmt.Sprintf(format, args...), d.i)
	}
}

func (d *decoder[T]) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := varint.Uvarint(d.b[d.i:])
	if n <= 0 || n != varint.Len(v) {
		// Only the shortest form is valid, so that each response has one
		// encoding (up to the order of its fields).
		d.fail("bad uvarint")
		return 0
	}
	d.i += n
	return v
}

func (d *decoder[T]) byte() byte {
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
func (d *decoder[T]) count(min int) int {
	v := d.uvarint()
	if d.err == nil && v > uint64((len(d.b)-d.i)/min) {
		d.fail("count %d larger than the encoding", v)
		return 0
	}
	return int(v)
}

// bytes skips a length-prefixed string.
func (d *decoder[T]) bytes() {
	n := d.uvarint()
	if d.err == nil && n > uint64(len(d.b)-d.i) {
		d.fail("length %d past the end", n)
		return
	}
	d.i += int(n)
}

// str reads a length-prefixed string of a checked encoding.
func (d *decoder[T]) str() T {
	n := int(d.uvarint())
	v := d.b[d.i : d.i+n]
	d.i += n
	return v
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}
