package idemserver

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"
	"time"
)

// ReplayedHeader is the header field, set to "true", that marks a replayed
// response.
const ReplayedHeader = "Idempotent-Replayed"

// recorder is the ResponseWriter the handler of a claimed request writes
// to. It keeps the status, the header fields as they were when the status
// was written, and the body up to a limit, and holds everything back from
// the client until the outcome has been stored, so that a client never sees
// a response that a retry would not get again.
//
// The header map the handler gets is the client's own, as under net/http,
// and it may already hold fields set by middleware in front of this one (a
// request id, CORS fields). Those belong to the request, not the response:
// only the fields the handler set are stored, that is those it added and
// those whose values it changed (an outer Content-Type it replaced, a Vary
// it appended to). A replay writes them over its own request's fields and
// leaves the others alone, so an outer field the handler deleted is still
// in the replay, with the value of the replay's own request: a stored
// response can add fields, not remove them.
//
// The client gets the fields as they were at WriteHeader, however the
// handler changes the map after it (through w.Header() or a map it kept
// from before): under net/http such changes have no effect either, except
// for trailers, which still reach the client as they would there.
//
// Two things make it pass the response through early: a Flush, which a
// streaming handler uses to reach the client now, and a body larger than
// the limit. From then on it writes through to the client, still recording
// the body while it fits. Neither does when hold is set: then the whole
// response waits for the outcome, and a body past the limit is kept for
// the client but not stored.
//
// The fields and the body are recorded in buffers the middleware reuses
// (see [buffers]); the fields are kept in packed form (see [packedParts]),
// ready for the store.
type recorder struct {
	w      http.ResponseWriter
	limit  int64
	allow  map[string]bool // fields replayed though withheld by default
	status int
	// fields holds three runs of packed fields, one after the other: the
	// fields of the header map before the handler touched it (up to
	// outerEnd), all of them at WriteHeader (up to sentEnd), and the
	// replayable fields the handler set, to be stored (the rest).
	fields []byte
	// int32, to keep claimedRequest in its size class; packed fields
	// never come near 2 GiB.
	outerEnd int32
	sentEnd  int32
	length   [1]string // the body's length, once finished, as a field value
	// unwritten is how many more bytes the body may have by the
	// Content-Length the handler declared, noLength if it declared none,
	// or cutShort once a Write past it was refused before the body had
	// filled it.
	unwritten int64
	body      []byte
	err       error
	// The flags are together, so that claimedRequest stays in a smaller
	// size class.
	begun       bool // the outer fields are recorded
	hasLength   bool // the stored fields include Content-Length
	wroteHeader bool
	releases    bool // the response ends the claim by releasing it; see ReleasesResponse
	streaming   bool // status and headers have gone to the client
	tooLarge    bool // the body is not stored: it passed the limit, or is cut; see finish
	hold        bool // never let the response through early; see ResponseHolder and ClaimResult.Hold
	http1       bool // the client speaks HTTP/1; see unsniffed
}

// begin records the fields the header map holds before the handler first
// reaches it, which are not the handler's. Every method through which the
// handler can reach the map calls it first.
func (c *recorder) begin() {
	if c.begun {
		return
	}
	c.begun = true
	c.fields = c.fields[:0]
	if h := c.w.Header(); len(h) > 0 {
		c.fields = appendFields(c.fields, h)
	}
	c.outerEnd = int32(len(c.fields))
}

// resetHeader puts the client's header map back as it was before the
// handler first reached it, for a response the middleware writes in place
// of the handler's.
func (c *recorder) resetHeader() {
	if !c.begun {
		return
	}
	h := c.w.Header()
	clear(h)
	fieldsInto(h, string(c.fields[:c.outerEnd]))
}

// Header returns the client's header map, as net/http does. Fields set in
// it only reach the client when the recorder lets the response through,
// and then as they were at WriteHeader; see [recorder].
func (c *recorder) Header() http.Header {
	c.begin()
	return c.w.Header()
}

// WriteHeader records the status code. Informational (1xx) responses other
// than 101 go to the client at once, as net/http sends them, unless the
// store holds responses: then they are dropped, since nothing may reach the
// client before the outcome is kept (a hint sent before a commit that then
// fails would describe a response the client never gets), and a replay
// carries none either.
func (c *recorder) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	if c.wroteHeader {
		return
	}
	c.begin()
	h := c.w.Header()
	if code < 200 && code != http.StatusSwitchingProtocols {
		if !c.hold {
			c.w.WriteHeader(code)
		}
		return
	}
	c.wroteHeader = true
	c.status = code
	c.releases = ReleasesResponse(code, h)
	c.unwritten = declaredLength(h)
	c.fields = appendFields(c.fields[:c.outerEnd], h)
	c.sentEnd = int32(len(c.fields))
	if !c.releases {
		c.fields, c.hasLength = appendReplayable(c.fields, h, c.allow, c.fields[:c.outerEnd])
		if c.unsniffed(h) {
			c.fields = appendHeaderField(c.fields, "Content-Type")
		}
	}
}

// The values of recorder.unwritten that are not a count of bytes.
const (
	noLength = -1 // no Content-Length was declared
	cutShort = -2 // a Write was refused before the body filled its length
)

// declaredLength returns the Content-Length declared in h, as net/http
// reads it at WriteHeader, or noLength if there is none it takes as one.
func declaredLength(h http.Header) int64 {
	if cl := h.Get("Content-Length"); cl != "" {
		if n, err := strconv.ParseInt(cl, 10, 64); err == nil && n >= 0 {
			return n
		}
	}
	return noLength
}

// unsniffed reports whether net/http sends the response whose fields are h
// without a Content-Type and without sniffing one from the body: over
// HTTP/1, when the handler set a Transfer-Encoding and neither a
// Content-Type nor a Content-Encoding. A replay goes without the
// Transfer-Encoding, which is never stored, so such a response is stored
// with a Content-Type without a value, which net/http sends as no field
// and does not sniff behind. Over HTTP/2, net/http ignores the field and
// sniffs as usual.
func (c *recorder) unsniffed(h http.Header) bool {
	if !c.http1 || !bodyAllowed(c.status) {
		return false
	}
	if _, ok := h["Content-Type"]; ok {
		return false
	}
	return h.Get("Transfer-Encoding") != "" && h.Get("Content-Encoding") == ""
}

// Write records p, or passes it through once the response is streaming.
// As under net/http, it fails with [http.ErrBodyNotAllowed] when the status
// allows no body (204, 304), and with [http.ErrContentLength] when p would
// take the body past the Content-Length the handler declared (and so does
// every later Write), and records nothing.
func (c *recorder) Write(p []byte) (int, error) { return write(c, p) }

// WriteString is Write for a string. With it, a handler that writes a
// string (io.WriteString) does not have it copied into a new byte slice
// first, which net/http's own ResponseWriter spares it too.
func (c *recorder) WriteString(s string) (int, error) { return write(c, s) }

// write is Write and WriteString.
func write[T []byte | string](c *recorder, p T) (int, error) {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
	}
	if len(p) == 0 {
		return 0, nil
	}
	if !bodyAllowed(c.status) {
		return 0, http.ErrBodyNotAllowed
	}
	if c.unwritten != noLength {
		// net/http would refuse p, and so send a body that a replay of
		// one recorded with p would not match. It refuses every later
		// write too (as this does: no p is shorter than cutShort), so a
		// body short of the declared length stays short.
		if int64(len(p)) > c.unwritten {
			if c.unwritten > 0 {
				c.unwritten = cutShort
			}
			return 0, http.ErrContentLength
		}
		c.unwritten -= int64(len(p))
	}
	if !c.tooLarge && int64(len(c.body))+int64(len(p)) > c.limit {
		c.tooLarge = true
		if !c.hold {
			if !c.streaming {
				c.startStreaming()
			}
			c.body = nil
		}
	}
	if !c.tooLarge || c.hold {
		c.body = append(c.body, p...)
		if !c.streaming {
			return len(p), nil
		}
	}
	if c.err != nil {
		return 0, c.err
	}
	var n int
	var err error
	switch p := any(p).(type) {
	case []byte:
		n, err = c.w.Write(p)
	case string:
		n, err = io.WriteString(c.w, p)
	}
	if err != nil {
		c.err = err
	}
	return n, err
}

// FlushError lets the response through: what was recorded goes to the
// client, and later writes follow at once. The response is still stored
// when the handler returns, but the client may see it before then. For a
// store that holds responses (see [ResponseHolder] and [ClaimResult.Hold])
// it does nothing.
func (c *recorder) FlushError() error {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
	}
	if c.hold {
		return nil
	}
	if !c.streaming {
		c.startStreaming()
	}
	if c.err != nil {
		return c.err
	}
	err := http.NewResponseController(c.w).Flush()
	if err != nil && !errors.Is(err, http.ErrNotSupported) {
		c.err = err
	}
	return err
}

// Flush implements [http.Flusher]; see FlushError.
func (c *recorder) Flush() { _ = c.FlushError() }

// Hijack refuses: the outcome of a hijacked connection cannot be recorded or
// replayed.
func (c *recorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return nil, nil, fmt.Errorf("idemserver: a keyed request cannot hijack its connection: %w", http.ErrNotSupported)
}

// The recorder has no Unwrap method: a handler, or a library it calls, that
// unwrapped it would reach the client's ResponseWriter, and what it wrote
// there, or a connection it hijacked there, would reach the client and not
// the store, or reach it before a transactional store's commit. So the
// controls of [http.ResponseController] that do not write are its own,
// and pass through to the client's writer.

// SetReadDeadline sets the deadline for reading the client's connection;
// see [http.ResponseController.SetReadDeadline].
func (c *recorder) SetReadDeadline(deadline time.Time) error {
	return http.NewResponseController(c.w).SetReadDeadline(deadline)
}

// SetWriteDeadline sets the deadline for writing to the client's
// connection; see [http.ResponseController.SetWriteDeadline]. The recorder
// writes a response held back after the handler returns, under the same
// deadline.
func (c *recorder) SetWriteDeadline(deadline time.Time) error {
	return http.NewResponseController(c.w).SetWriteDeadline(deadline)
}

// EnableFullDuplex lets the handler read the request body while it writes
// the response; see [http.ResponseController.EnableFullDuplex]. The
// middleware has read the body already.
func (c *recorder) EnableFullDuplex() error {
	return http.NewResponseController(c.w).EnableFullDuplex()
}

// startStreaming sends the status, the headers and the recorded body.
func (c *recorder) startStreaming() {
	c.streaming = true
	c.writeHeader()
	if len(c.body) > 0 {
		if _, err := c.w.Write(c.body); err != nil {
			c.err = err
		}
	}
}

// finish completes a response the handler left without a status, and
// adds Content-Length to the recorded fields of a response to be stored.
// head says that it answers a HEAD request, whose body no client gets.
//
// A response that may be cut is stored without its body, as one too large
// to store is: one shorter than the Content-Length the handler declared
// (net/http cuts the connection after it, and every replay would be cut
// too), and a streamed one without a declared length whose write or flush
// to the client failed (the client went away; the handler was told, and
// may have stopped short of the body's end, so a replay of what it wrote
// could pass a cut body off as whole). A body that filled its declared
// length is whole however its delivery went: a client may even have had
// all of it before a last flush failed (over HTTP/2, one that closes the
// body once it has read its length resets the stream), and a replay is
// that answer. A response to HEAD declares the length of a body it does
// not send, and is whole without it.
func (c *recorder) finish(head bool) {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
	}
	short := c.unwritten > 0 || c.unwritten == cutShort
	if !head && (short && bodyAllowed(c.status) || c.err != nil && c.unwritten == noLength) {
		c.tooLarge = true
	}
	c.length[0] = strconv.Itoa(len(c.body))
	if !c.tooLarge && !c.releases && bodyAllowed(c.status) && !c.hasLength {
		c.fields = appendHeaderField(c.fields, "Content-Length", c.length[0])
	}
}

// deliver sends a response that has not been let through yet.
func (c *recorder) deliver() {
	if c.streaming {
		return
	}
	c.writeHeader()
	if len(c.body) > 0 {
		_, _ = c.w.Write(c.body)
	}
}

// writeHeader sends the status with the header fields as they were at
// WriteHeader. If the handler changed the map since, it is set back first,
// and the trailers set in it then are copied in after, where net/http
// looks for them when the handler returns: fields declared in Trailer, and
// those named with http.TrailerPrefix.
func (c *recorder) writeHeader() {
	h := c.w.Header()
	var late http.Header
	if !sameFields(h, c.fields[c.outerEnd:c.sentEnd]) {
		late = h.Clone()
		clear(h)
		fieldsInto(h, string(c.fields[c.outerEnd:c.sentEnd]))
	}
	switch {
	case c.streaming && !c.tooLarge:
		c.fixType(h)
	case !c.streaming && bodyAllowed(c.status) && h["Content-Length"] == nil && h["Transfer-Encoding"] == nil && h["Trailer"] == nil:
		h["Content-Length"] = c.length[:] // the recorder's own array: no allocation
	}
	c.w.WriteHeader(c.status)
	declared := h["Trailer"]
	for k, vv := range late {
		if strings.HasPrefix(k, http.TrailerPrefix) || trailerDeclared(declared, k) {
			h[k] = vv
		}
	}
}

// fixType sets, in h, the Content-Type of a response that a flush lets
// through before its body is complete, if the handler set none, and stores
// it with the response. net/http would sniff the type from the first bytes
// it is handed, or send none if the body has not begun, whereas a replay,
// written whole, would be sniffed from the whole body: the two could
// differ. So the recorder sniffs the body recorded so far, as net/http
// would, and a response flushed before its body has a Content-Type without
// a value, which net/http sends as no field and does not sniff behind. A
// response that net/http sends without sniffing needs none (see unsniffed),
// and neither does one that streams because it is too large to store: its
// replay does not carry its body or the fields that describe it.
func (c *recorder) fixType(h http.Header) {
	if _, ok := h["Content-Type"]; ok || !bodyAllowed(c.status) ||
		h.Get("Content-Encoding") != "" || c.unsniffed(h) {
		return
	}
	var typ []string
	if len(c.body) > 0 {
		typ = []string{http.DetectContentType(c.body)}
	}
	h["Content-Type"] = typ
	if !c.releases {
		c.fields = appendHeaderField(c.fields, "Content-Type", typ...)
	}
}

// trailerDeclared reports whether the Trailer field values name key.
func trailerDeclared(trailer []string, key string) bool {
	for _, v := range trailer {
		for name := range strings.SplitSeq(v, ",") {
			if http.CanonicalHeaderKey(strings.TrimSpace(name)) == key {
				return true
			}
		}
	}
	return false
}

// parts returns what the recorder holds, after finish, in the pieces of
// its packed form. They point into the recorder's buffers.
func (c *recorder) parts() packedParts {
	fields := c.fields[c.sentEnd:]
	if c.tooLarge {
		return packedParts{status: c.status, omitted: true, fields: fields}
	}
	return packedParts{status: c.status, fields: fields, body: c.body}
}

// response returns what the recorder holds, after finish, as a Response of
// its own to store.
func (c *recorder) response() *Response {
	h := make(http.Header)
	fieldsInto(h, string(c.fields[c.sentEnd:]))
	if c.tooLarge {
		return &Response{Status: c.status, Header: h, BodyOmitted: true}
	}
	resp := &Response{Status: c.status, Header: h}
	if len(c.body) > 0 {
		resp.Body = bytes.Clone(c.body)
	}
	return resp
}

// release lets go of the recorder's buffers, handing them back to bufs.
// A handler that wrongly writes after it returned can then no longer
// reach them.
func (c *recorder) release(bufs *buffers) {
	// Emptied: a run the store asked for again records its body into the
	// same buffer, and must not follow the discarded run's.
	bufs.fields, bufs.respBody = c.fields, c.body[:0]
	c.fields, c.body = nil, nil
}

// replayable returns a copy of h without the fields that must not be
// replayed; see appendReplayable.
func replayable(h http.Header, allow map[string]bool) http.Header {
	b, _ := appendReplayable(nil, h, allow, nil)
	out := make(http.Header)
	fieldsInto(out, string(b))
	return out
}

// appendReplayable appends to b, packed, the fields of h that may be
// replayed: all but the hop-by-hop fields, those named in Connection,
// trailers, Set-Cookie unless allow names it, and those that outer, in
// packed form, holds with the same values, which are not the handler's.
// It also reports whether Content-Length is among them.
func appendReplayable(b []byte, h http.Header, allow map[string]bool, outer []byte) ([]byte, bool) {
	// Most responses have no Connection field, so the fields are appended
	// in one pass; only when it finds one are they appended again without
	// the fields it names.
	start := len(b)
	b, hasLength, connection := appendKept(b, h, allow, nil, outer)
	if !connection {
		return b, hasLength
	}
	named := make(map[string]bool)
	for k, vs := range h {
		if !strings.EqualFold(k, "Connection") {
			continue
		}
		for _, v := range vs {
			for tok := range strings.SplitSeq(v, ",") {
				if tok = strings.TrimSpace(tok); tok != "" {
					named[textproto.CanonicalMIMEHeaderKey(tok)] = true
				}
			}
		}
	}
	b, hasLength, _ = appendKept(b[:start], h, allow, named, outer)
	return b, hasLength
}

// appendKept is appendReplayable with the fields named in Connection given
// as named. It also reports whether h has a Connection field.
func appendKept(b []byte, h http.Header, allow, named map[string]bool, outer []byte) (_ []byte, hasLength, connection bool) {
	for k, vs := range h {
		if !validFieldName(k) {
			// net/http drops such a field in silence, so the client never
			// received it: a replay sends what the client did.
			continue
		}
		ck := textproto.CanonicalMIMEHeaderKey(k)
		if hopByHop(ck) || named[ck] || strings.HasPrefix(k, http.TrailerPrefix) ||
			ck == ReplayedHeader || (ck == "Set-Cookie" && !allow[ck]) {
			connection = connection || ck == "Connection"
			continue
		}
		if len(outer) > 0 && hasField(outer, k, vs) {
			continue
		}
		hasLength = hasLength || k == "Content-Length"
		b = appendHeaderField(b, k, vs...)
	}
	return b, hasLength, connection
}

// validFieldName reports whether name is a field name, a token of RFC
// 9110, section 5.1: the names net/http writes.
func validFieldName(name string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

func hopByHop(k string) bool {
	switch k {
	case "Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	return strings.HasPrefix(k, "Proxy-")
}

// bodyAllowed reports whether a response with status may have a body.
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}
