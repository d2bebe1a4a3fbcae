package idemserver

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/idemhttp/idemhttp/internal/varint"
)

// A packed response is the form in which the middleware holds back a
// response and [MemoryStore] keeps it: one string, which the garbage
// collector need not scan, and out of which a replay takes its header
// fields and body without copying them.
//
//	status        uvarint
//	flags         one byte; bit 0: the body was omitted
//	fields length uvarint, the number of bytes of the fields that follow
//	fields        per field: uvarint len(name), name, uvarint count of
//	              values, then per value uvarint len(value), value
//	body          the rest
//
// The fields carry their own length, rather than a count, so that the
// recorder can append Content-Length once the body is known.
//
// internal/respcodec translates between this form and its own without a
// Response in between (its fields are written alike); its tests check the
// translations against PackResponse and Response, so a change here shows
// there.
type packedParts struct {
	status  int
	omitted bool
	fields  []byte
	body    []byte
}

// size returns the length of the packed form of p.
func (p packedParts) size() int {
	return varint.Len(uint64(p.status)) + 1 + varint.Len(uint64(len(p.fields))) + len(p.fields) + len(p.body)
}

// flags returns the flags byte of p's packed form.
func (p packedParts) flags() byte {
	if p.omitted {
		return 1
	}
	return 0
}

// writeTo appends the packed form of p to b.
func (p packedParts) writeTo(b *strings.Builder) {
	varint.Write(b, uint64(p.status))
	b.WriteByte(p.flags())
	varint.Write(b, uint64(len(p.fields)))
	b.Write(p.fields)
	b.Write(p.body)
}

// A PackedResponse is a [Response] in packed form: one block of bytes
// holding the status, the header fields and the body, in the form in which
// the middleware records a response. A replay writes its header fields and
// body straight from it, without decoding it into a Response first, and a
// store can keep it as it is: see [PackedStore]. The zero value holds no
// response.
//
// Its bytes are opaque: a store keeps what [PackedResponse.AppendBinary]
// gives it and hands back what [ParsePackedResponse] makes of the same
// bytes.
type PackedResponse struct {
	// s is the packed form; when it is empty, parts holds the pieces of a
	// response that is not zero, not yet joined.
	s     string
	parts packedParts
}

// PackResponse returns resp in packed form, with header fields that
// [Response] allows and a copy of its body. A nil resp gives the zero
// PackedResponse.
func PackResponse(resp *Response) PackedResponse {
	if resp == nil {
		return PackedResponse{}
	}
	p := partsOf(resp)
	var b strings.Builder
	b.Grow(p.size())
	p.writeTo(&b)
	return PackedResponse{s: b.String()}
}

// ParsePackedResponse returns the response whose packed form is data, as
// [PackedResponse.AppendBinary] wrote it. It checks the form, and fails
// rather than replay damaged bytes. The result shares data's memory.
func ParsePackedResponse(data string) (PackedResponse, error) {
	if err := checkPacked(data); err != nil {
		return PackedResponse{}, fmt.Errorf("idemserver: malformed packed response: %w", err)
	}
	return PackedResponse{s: data}, nil
}

// packedOf returns the PackedResponse of parts p, which it shares.
func packedOf(p packedParts) PackedResponse { return PackedResponse{parts: p} }

// IsZero reports whether p holds no response.
func (p PackedResponse) IsZero() bool { return p.s == "" && p.parts.status == 0 }

// Len returns the number of bytes of p's packed form; zero for no response.
func (p PackedResponse) Len() int {
	switch {
	case p.s != "":
		return len(p.s)
	case p.IsZero():
		return 0
	}
	return p.parts.size()
}

// AppendBinary appends p's packed form to b, which a store can keep and
// give back through [ParsePackedResponse]. It implements
// [encoding.BinaryAppender] and never fails.
func (p PackedResponse) AppendBinary(b []byte) ([]byte, error) {
	switch {
	case p.s != "":
		return append(b, p.s...), nil
	case p.IsZero():
		return b, nil
	}
	b = binary.AppendUvarint(b, uint64(p.parts.status))
	b = append(b, p.parts.flags())
	b = binary.AppendUvarint(b, uint64(len(p.parts.fields)))
	b = append(b, p.parts.fields...)
	return append(b, p.parts.body...), nil
}

// Response returns p decoded into a Response of its own, or nil for no
// response.
func (p PackedResponse) Response() *Response {
	if p.IsZero() {
		return nil
	}
	return p.view().response()
}

// writeTo appends p's packed form to b.
func (p PackedResponse) writeTo(b *strings.Builder) {
	if p.s != "" {
		b.WriteString(p.s)
		return
	}
	if !p.IsZero() {
		p.parts.writeTo(b)
	}
}

// view returns the pieces of p, which must not be zero, for a replay.
func (p PackedResponse) view() packed {
	if p.s != "" {
		return unpack(p.s)
	}
	return packed{status: p.parts.status, omitted: p.parts.omitted,
		fields: string(p.parts.fields), body: string(p.parts.body)}
}

// checkPacked reports what is wrong with data as a packed response.
func checkPacked(data string) error {
	status, n := varint.Uvarint(data)
	if n <= 0 || status > 999 || !replayableStatus(int(status)) {
		return errors.New("bad status")
	}
	data = data[n:]
	if len(data) == 0 || data[0] > 1 {
		return errors.New("bad flags")
	}
	fields, _, ok := cutPacked(data[1:])
	if !ok {
		return errors.New("bad length of the header fields")
	}
	for len(fields) > 0 {
		name, rest, ok := cutPacked(fields)
		if !ok || name == "" {
			return errors.New("bad header field name")
		}
		count, n := varint.Uvarint(rest)
		if n <= 0 || count > uint64(len(rest)-n) { // a value takes a byte at least
			return errors.New("bad value count of header field " + strconv.Quote(name))
		}
		fields = rest[n:]
		for range count {
			if _, fields, ok = cutPacked(fields); !ok {
				return errors.New("bad value of header field " + strconv.Quote(name))
			}
		}
	}
	return nil
}

// replayableStatus reports whether a stored response may have status: one
// the recorder stores, a final status or 101 (interim ones go to the client
// at once). A replay of any other would panic in WriteHeader or, for a 1xx,
// reach the client as an interim response followed by a 200.
func replayableStatus(status int) bool {
	return status == http.StatusSwitchingProtocols || status >= 200 && status <= 999
}

// cutPacked reads from s a uvarint length and that many bytes, and returns
// them and what follows; ok is false when s is too short.
func cutPacked(s string) (v, rest string, ok bool) {
	l, n := varint.Uvarint(s)
	if n <= 0 || l > uint64(len(s)-n) {
		return "", "", false
	}
	return s[n : n+int(l)], s[n+int(l):], true
}

// partsOf returns the parts of resp.
func partsOf(resp *Response) packedParts {
	return packedParts{
		status:  resp.Status,
		omitted: resp.BodyOmitted,
		fields:  appendFields(nil, resp.Header),
		body:    resp.Body,
	}
}

// packed is the view of a packed response; its strings share the packed
// string's memory.
type packed struct {
	status  int
	omitted bool
	fields  string
	body    string
}

// unpack splits s, which packedParts.writeTo made or checkPacked checked.
func unpack(s string) packed {
	i := 0
	next := func() int {
		v, n := varint.Uvarint(s[i:])
		i += n
		return int(v)
	}
	var p packed
	p.status = next()
	p.omitted = s[i]&1 != 0
	i++
	n := next()
	p.fields = s[i : i+n]
	p.body = s[i+n:]
	return p
}

// appendFields appends the fields of h to b in packed form.
func appendFields(b []byte, h http.Header) []byte {
	for k, vs := range h {
		b = appendHeaderField(b, k, vs...)
	}
	return b
}

// appendHeaderField appends one field with its values to b in packed form.
func appendHeaderField(b []byte, name string, values ...string) []byte {
	b = binary.AppendUvarint(b, uint64(len(name)))
	b = append(b, name...)
	b = binary.AppendUvarint(b, uint64(len(values)))
	for _, v := range values {
		b = binary.AppendUvarint(b, uint64(len(v)))
		b = append(b, v...)
	}
	return b
}

// nextField splits the first field off the packed fields b: its name,
// the number of its values and the values, still packed. It returns the
// fields after it in rest.
func nextField(b []byte) (name []byte, count int, values, rest []byte) {
	n, w := binary.Uvarint(b)
	name, b = b[w:w+int(n)], b[w+int(n):]
	nv, w := binary.Uvarint(b)
	b = b[w:]
	end := 0
	for range nv {
		n, w := binary.Uvarint(b[end:])
		end += w + int(n)
	}
	return name, int(nv), b[:end], b[end:]
}

// valuesEqual reports whether the count packed values are vs.
func valuesEqual(count int, values []byte, vs []string) bool {
	if count != len(vs) {
		return false
	}
	for _, v := range vs {
		n, w := binary.Uvarint(values)
		if string(values[w:w+int(n)]) != v {
			return false
		}
		values = values[w+int(n):]
	}
	return true
}

// findField returns the values, packed, of the field name in the packed
// fields b, and whether b has it.
func findField(b []byte, name string) (count int, values []byte, ok bool) {
	for len(b) > 0 {
		k, count, values, rest := nextField(b)
		if string(k) == name {
			return count, values, true
		}
		b = rest
	}
	return 0, nil, false
}

// hasField reports whether the packed fields b hold the field name with
// exactly the values vs.
func hasField(b []byte, name string, vs []string) bool {
	count, values, ok := findField(b, name)
	return ok && valuesEqual(count, values, vs)
}

// sameFields reports whether h holds exactly the packed fields b.
func sameFields(h http.Header, b []byte) bool {
	n := 0
	for ; len(b) > 0; n++ {
		k, count, values, rest := nextField(b)
		vs, ok := h[string(k)]
		if !ok || !valuesEqual(count, values, vs) {
			return false
		}
		b = rest
	}
	return n == len(h)
}

// samePacked reports whether the packed responses a and b are the same
// response, whatever the order in which their fields were packed (a
// header map's, which differs from one walk to the next).
func samePacked(a, b string) bool {
	if a == b {
		return true
	}
	pa, pb := unpack(a), unpack(b)
	return pa.status == pb.status && pa.omitted == pb.omitted && pa.body == pb.body &&
		len(pa.fields) == len(pb.fields) && sameFields(pa.header(), []byte(pb.fields))
}

// fieldsInto sets the packed fields in h, each replacing any values h had
// for its name, and then sets the extra fields, given as name and value
// pairs. The values are substrings of fields, and all of them share one
// new array, so that a later Add to h cannot write into another field.
func fieldsInto(h http.Header, fields string, extra ...string) {
	values := len(extra) / 2
	for i := 0; i < len(fields); {
		n, w := varint.Uvarint(fields[i:])
		i += w + int(n)
		nv, w := varint.Uvarint(fields[i:])
		i += w
		values += int(nv)
		for range nv {
			n, w := varint.Uvarint(fields[i:])
			i += w + int(n)
		}
	}
	all := make([]string, values)
	str := func(i *int) string {
		n, w := varint.Uvarint(fields[*i:])
		s := fields[*i+w : *i+w+int(n)]
		*i += w + int(n)
		return s
	}
	for i := 0; i < len(fields); {
		k := str(&i)
		nv, w := varint.Uvarint(fields[i:])
		i += w
		vs := all[:nv:nv]
		all = all[nv:]
		for j := range vs {
			vs[j] = str(&i)
		}
		h[k] = vs
	}
	for j := 0; j+1 < len(extra); j += 2 {
		all[0] = extra[j+1]
		h[extra[j]] = all[:1:1]
		all = all[1:]
	}
}

// header returns the packed fields as a new header map, or nil if there
// are none.
func (p packed) header() http.Header {
	if p.fields == "" {
		return nil
	}
	h := make(http.Header)
	fieldsInto(h, p.fields)
	return h
}

// response returns the packed response as a Response. Its body is a copy.
func (p packed) response() *Response {
	resp := &Response{Status: p.status, BodyOmitted: p.omitted, Header: p.header()}
	if p.body != "" {
		resp.Body = []byte(p.body)
	}
	return resp
}

// describesBody reports whether the field k describes a response's body, so
// that it is not replayed with the problem document that stands in for a
// body too large to store.
func describesBody(k string) bool {
	switch k {
	case "Etag", "Last-Modified", "Digest", "Repr-Digest":
		return true
	}
	return strings.HasPrefix(k, "Content-")
}

// replay writes a packed response, marked with [ReplayedHeader], without
// copying its fields or body.
func (p packed) replay(w http.ResponseWriter) {
	h := w.Header()
	if p.omitted {
		// The stored fields (Location, say) still hold; those that
		// describe the dropped body do not. Fields set in front of the
		// middleware for this request stay.
		fieldsInto(h, p.fields, ReplayedHeader, "true")
		stored := []byte(p.fields)
		for k := range h {
			if _, _, ok := findField(stored, k); ok && describesBody(k) {
				delete(h, k)
			}
		}
		writeProblem(w, ProblemResponseNotStored, p.status,
			"the request was processed with status "+strconv.Itoa(p.status)+
				", but its response was not kept for replay: it was too large, or cut short", "")
		return
	}
	fieldsInto(h, p.fields, ReplayedHeader, "true")
	if bodyAllowed(p.status) && h["Content-Length"] == nil && h["Transfer-Encoding"] == nil {
		h["Content-Length"] = []string{strconv.Itoa(len(p.body))}
	}
	w.WriteHeader(p.status)
	if p.body != "" {
		_, _ = io.WriteString(w, p.body)
	}
}
