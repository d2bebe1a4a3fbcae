package idemserver

import (
	"bufio"
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
// the body while it fits.
type recorder struct {
	w           http.ResponseWriter
	limit       int64
	allow       map[string]bool // fields replayed though withheld by default
	status      int
	header      http.Header // replayable fields when the status was written
	body        []byte
	wroteHeader bool
	streaming   bool // status and headers have gone to the client
	tooLarge    bool // the body passed the limit and was dropped
	err         error
}

// Header returns the client's header map: fields set there only reach the
// client when the recorder lets the response through.
func (c *recorder) Header() http.Header { return c.w.Header() }

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
		c.header = replayable(c.w.Header(), c.allow)
	}
}

// Write records p, or passes it through once the response is streaming.
func (c *recorder) Write(p []byte) (int, error) {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
	}
	if !c.tooLarge && int64(len(c.body))+int64(len(p)) > c.limit {
		c.tooLarge = true
		if !c.streaming {
			c.startStreaming()
		}
		c.body = nil
	}
	if !c.tooLarge {
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
// when the handler returns, but the client may see it before then.
func (c *recorder) FlushError() error {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
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

// finish completes a response the handler left without a status.
func (c *recorder) finish() {
	if !c.wroteHeader {
		c.WriteHeader(http.StatusOK)
	}
}

// deliver sends a response that has not been let through yet. stored, if
// not nil, is the stored form of the response, whose Content-Length it
// reuses.
func (c *recorder) deliver(stored *Response) {
	if c.streaming {
		return
	}
	h := c.w.Header()
	if bodyAllowed(c.status) && h["Content-Length"] == nil && h["Transfer-Encoding"] == nil {
		if cl := stored.contentLength(); cl != nil {
			h["Content-Length"] = cl
		} else {
			h["Content-Length"] = []string{strconv.Itoa(len(c.body))}
		}
	}
	c.w.WriteHeader(c.status)
	if len(c.body) > 0 {
		_, _ = c.w.Write(c.body)
	}
}

// response returns what the recorder holds as a Response to store.
func (c *recorder) response() *Response {
	if c.tooLarge {
		return &Response{Status: c.status, BodyOmitted: true}
	}
	h := c.header
	if bodyAllowed(c.status) && h["Content-Length"] == nil && h["Transfer-Encoding"] == nil {
		h["Content-Length"] = []string{strconv.Itoa(len(c.body))}
	}
	return &Response{Status: c.status, Header: h, Body: c.body}
}

// replayable returns a copy of h without the fields that must not be
// replayed: hop-by-hop fields, those named in Connection, trailers, and
// Set-Cookie unless allow names it. The copy's values share one array.
func replayable(h http.Header, allow map[string]bool) http.Header {
	var named map[string]bool
	for k, vs := range h {
		if !strings.EqualFold(k, "Connection") {
			continue
		}
		for _, v := range vs {
			for tok := range strings.SplitSeq(v, ",") {
				if tok = strings.TrimSpace(tok); tok != "" {
					if named == nil {
						named = make(map[string]bool)
					}
					named[textproto.CanonicalMIMEHeaderKey(tok)] = true
				}
			}
		}
	}
	drop := func(k string) bool {
		ck := textproto.CanonicalMIMEHeaderKey(k)
		return hopByHop(ck) || named[ck] || strings.HasPrefix(k, http.TrailerPrefix) ||
			ck == ReplayedHeader || (ck == "Set-Cookie" && !allow[ck])
	}
	keys, values := 0, 0
	for k, vs := range h {
		if !drop(k) {
			keys++
			values += len(vs)
		}
	}
	out := make(http.Header, keys)
	all := make([]string, values)
	for k, vs := range h {
		if !drop(k) {
			n := copy(all, vs)
			out[k] = all[:n:n]
			all = all[n:]
		}
	}
	return out
}

// contentLength returns the stored Content-Length values, capped so that an
// append cannot write into the record; nil if there are none.
func (r *Response) contentLength() []string {
	if r == nil || r.Header == nil {
		return nil
	}
	v := r.Header["Content-Length"]
	return v[:len(v):len(v)]
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

// replay writes a stored response, marked with [ReplayedHeader].
func replay(w http.ResponseWriter, resp *Response) {
	h := w.Header()
	if resp.BodyOmitted {
		h.Set(ReplayedHeader, "true")
		writeProblem(w, ProblemResponseNotStored, resp.Status,
			"the request was processed with status "+strconv.Itoa(resp.Status)+
				", but its response was too large to keep for replay", "")
		return
	}
	for k, v := range resp.Header {
		h[k] = v[:len(v):len(v)] // an Add by another layer must not write into the record
	}
	h[ReplayedHeader] = []string{"true"}
	if bodyAllowed(resp.Status) && h["Content-Length"] == nil && h["Transfer-Encoding"] == nil {
		h["Content-Length"] = []string{strconv.Itoa(len(resp.Body))}
	}
	w.WriteHeader(resp.Status)
	if len(resp.Body) > 0 {
		_, _ = w.Write(resp.Body)
	}
}
