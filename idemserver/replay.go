package idemserver

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"
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
	w           http.ResponseWriter
	limit       int64
	allow       map[string]bool // fields replayed though withheld by default
	status      int
	fields      []byte    // replayable fields when the status was written, packed
	hasLength   bool      // fields include Content-Length
	length      [1]string // the body's length, once finished, as a field value
	body        []byte
	wroteHeader bool
	streaming   bool // status and headers have gone to the client
	tooLarge    bool // the body passed the limit and is not stored
	hold        bool // never let the response through early; see ResponseHolder
	err         error
	late        http.Header // what Header returns after WriteHeader, made on first use
}

// Header returns the client's header map until WriteHeader: fields set
// there only reach the client when the recorder lets the response through.
// After WriteHeader it returns a copy, as changes made then have no effect
// under net/http either; only trailers set in it reach the client, and the
// first response stays identical to its replays.
func (c *recorder) Header() http.Header {
	if !c.wroteHeader {
		return c.w.Header()
	}
	if c.late == nil {
		c.late = c.w.Header().Clone()
	}
	return c.late
}

// WriteHeader records the status code. Informational (1xx) responses other
// than 101 go to the client at once, as net/http sends them.
func (c *recorder) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	if c.wroteHeader {
		return
	}
	if code < 200 && code != http.StatusSwitchingProtocols {
		c.w.WriteHeader(code)
		return
	}
	c.wroteHeader = true
	c.status = code
	if !released(code) {
		c.fields, c.hasLength = appendReplayable(c.fields[:0], c.w.Header(), c.allow)
	}
}

// Write records p, or passes it through once the response is streaming.
func (c *recorder) Write(p []byte) (int, error) {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
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
	n, err := c.w.Write(p)
	if err != nil {
		c.err = err
	}
	return n, err
}

// FlushError lets the response through: what was recorded goes to the
// client, and later writes follow at once. The response is still stored
// when the handler returns, but the client may see it before then. For a
// store that holds responses (see [ResponseHolder]) it does nothing.
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
	return http.NewResponseController(c.w).Flush()
}

// Flush implements [http.Flusher]; see FlushError.
func (c *recorder) Flush() { _ = c.FlushError() }

// Hijack refuses: the outcome of a hijacked connection cannot be recorded or
// replayed. Without this method, [http.ResponseController] would reach the
// client's connection through Unwrap.
func (c *recorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return nil, nil, fmt.Errorf("idemserver: a keyed request cannot hijack its connection: %w", http.ErrNotSupported)
}

// Unwrap returns the client's ResponseWriter, so that
// [http.ResponseController] can set deadlines and enable full duplex.
func (c *recorder) Unwrap() http.ResponseWriter { return c.w }

// startStreaming sends the status, the headers and the recorded body.
func (c *recorder) startStreaming() {
	c.streaming = true
	c.w.WriteHeader(c.status)
	if len(c.body) > 0 {
		if _, err := c.w.Write(c.body); err != nil {
			c.err = err
		}
	}
}

// finish completes a response the handler left without a status, and
// adds Content-Length to the recorded fields of a response to be stored.
func (c *recorder) finish() {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
	}
	c.length[0] = strconv.Itoa(len(c.body))
	if !c.tooLarge && !released(c.status) && bodyAllowed(c.status) && !c.hasLength {
		c.fields = appendHeaderField(c.fields, "Content-Length", c.length[0])
	}
}

// deliver sends a response that has not been let through yet, and the
// trailers of one that has.
func (c *recorder) deliver() {
	defer c.sendTrailers()
	if c.streaming {
		return
	}
	h := c.w.Header()
	if bodyAllowed(c.status) && h["Content-Length"] == nil && h["Transfer-Encoding"] == nil && h["Trailer"] == nil {
		h["Content-Length"] = c.length[:] // the recorder's own array: no allocation
	}
	c.w.WriteHeader(c.status)
	if len(c.body) > 0 {
		_, _ = c.w.Write(c.body)
	}
}

// sendTrailers copies the trailer values the handler set after WriteHeader
// into the client's header map, where net/http looks for them when the
// handler returns: fields declared in Trailer, and those named with
// http.TrailerPrefix.
func (c *recorder) sendTrailers() {
	if c.late == nil {
		return
	}
	live := c.w.Header()
	declared := live["Trailer"]
	for k, vv := range c.late {
		if strings.HasPrefix(k, http.TrailerPrefix) || trailerDeclared(declared, k) {
			live[k] = vv
		}
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
	if c.tooLarge {
		return packedParts{status: c.status, omitted: true, fields: c.fields}
	}
	return packedParts{status: c.status, fields: c.fields, body: c.body}
}

// response returns what the recorder holds, after finish, as a Response of
// its own to store.
func (c *recorder) response() *Response {
	h := make(http.Header)
	fieldsInto(h, string(c.fields))
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
	bufs.fields, bufs.respBody = c.fields, c.body
	c.fields, c.body = nil, nil
}

// replayable returns a copy of h without the fields that must not be
// replayed; see appendReplayable.
func replayable(h http.Header, allow map[string]bool) http.Header {
	b, _ := appendReplayable(nil, h, allow)
	out := make(http.Header)
	fieldsInto(out, string(b))
	return out
}

// appendReplayable appends to b, packed, the fields of h that may be
// replayed: all but the hop-by-hop fields, those named in Connection,
// trailers, and Set-Cookie unless allow names it. It also reports whether
// Content-Length is among them.
func appendReplayable(b []byte, h http.Header, allow map[string]bool) ([]byte, bool) {
	// Most responses have no Connection field, so the fields are appended
	// in one pass; only when it finds one are they appended again without
	// the fields it names.
	start := len(b)
	b, hasLength, connection := appendKept(b, h, allow, nil)
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
	b, hasLength, _ = appendKept(b[:start], h, allow, named)
	return b, hasLength
}

// appendKept is appendReplayable with the fields named in Connection given
// as named. It also reports whether h has a Connection field.
func appendKept(b []byte, h http.Header, allow, named map[string]bool) (_ []byte, hasLength, connection bool) {
	for k, vs := range h {
		ck := textproto.CanonicalMIMEHeaderKey(k)
		if hopByHop(ck) || named[ck] || strings.HasPrefix(k, http.TrailerPrefix) ||
			ck == ReplayedHeader || (ck == "Set-Cookie" && !allow[ck]) {
			connection = connection || ck == "Connection"
			continue
		}
		hasLength = hasLength || k == "Content-Length"
		b = appendHeaderField(b, k, vs...)
	}
	return b, hasLength, connection
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
