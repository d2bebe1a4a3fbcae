package idemtest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemhttp/idemhttp/idemserver"
)

// Stats counts what a fault injector did, over its whole life.
type Stats struct {
	// Requests is the number of requests the injector received.
	Requests int
	// Delayed counts the requests delayed by Faults.Latency.
	Delayed int
	// ResetBefore, LostResponses, Unavailable, TooManyRequests, Stalled
	// and CutBodies count the requests that met each fault. A request
	// whose client gave up during its delay, or that the server reset
	// then as it closed, met no fault and counts for none.
	ResetBefore, LostResponses, Unavailable, TooManyRequests, Stalled, CutBodies int
	// Replayed counts the responses marked Idempotent-Replayed: true that
	// came back through the injector, including those it then dropped.
	Replayed int
}

// injector is the fault injector: an http.Handler that harms requests as
// its Faults say before or instead of passing them to next.
type injector struct {
	next   http.Handler
	faults Faults
	seed   int64
	header string // the idempotency key's header field, for identities
	// done ends delays and stalls when the owner closes.
	done <-chan struct{}
	// check, if set, is given every replayed response that passes, with
	// the context of the request the middleware served and the idempotency
	// key the request carried.
	check func(ctx context.Context, key string, status int, header http.Header, body []byte)

	mu       sync.Mutex
	closed   bool
	inFlight sync.WaitGroup // ServeHTTP calls; a hijacked one outlives its server's bookkeeping
	attempts map[string]uint64
	stats    Stats
}

func newInjector(next http.Handler, f Faults, seed int64, header string, done <-chan struct{},
	check func(ctx context.Context, key string, status int, header http.Header, body []byte)) *injector {
	return &injector{next: next, faults: f, seed: seed, header: header, done: done, check: check,
		attempts: make(map[string]uint64)}
}

func (in *injector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	id := identity(r, in.header)
	in.mu.Lock()
	if in.closed {
		in.mu.Unlock()
		reset(w)
		return
	}
	in.inFlight.Add(1)
	defer in.inFlight.Done()
	in.attempts[id]++
	d := decide(&in.faults, in.seed, id, in.attempts[id])
	in.stats.Requests++
	if d.delay > 0 {
		in.stats.Delayed++
	}
	in.mu.Unlock()

	if d.delay > 0 && !in.wait(r.Context(), d.delay) {
		// The client gave up, or the server is closing: the request
		// meets no fault, and none is counted.
		reset(w)
		return
	}
	if d.fault != faultCutBody { // counted once the response is known
		in.count(d.fault)
	}
	switch d.fault {
	case faultResetBefore:
		reset(w)
	case faultLoseResponse:
		in.pass(&discardWriter{header: make(http.Header)}, r)
		reset(w)
	case faultUnavailable:
		http.Error(w, "idemtest: injected 503", http.StatusServiceUnavailable)
	case faultTooManyRequests:
		secs := (in.faults.RetryAfter + time.Second - 1) / time.Second
		w.Header().Set("Retry-After", strconv.FormatInt(int64(secs), 10))
		http.Error(w, "idemtest: injected 429", http.StatusTooManyRequests)
	case faultStall:
		// The server notices that the client has gone only once the
		// request body has been read.
		_, _ = io.Copy(io.Discard, r.Body)
		in.wait(r.Context(), -1)
		reset(w)
	case faultCutBody:
		rec := httptest.NewRecorder()
		in.pass(rec, r)
		resp := rec.Result()
		if cuttable(r, resp.StatusCode) {
			in.count(faultCutBody)
		} else {
			in.count(faultLoseResponse) // cut replaces it by a reset
		}
		cut(w, r, resp, rec.Body.Bytes())
	default:
		in.pass(w, r)
	}
}

// count counts a fault as injected: once the request's delay is over, so
// that a request whose client left during its delay does not count a fault
// it never met.
func (in *injector) count(f fault) {
	in.mu.Lock()
	defer in.mu.Unlock()
	switch f {
	case faultResetBefore:
		in.stats.ResetBefore++
	case faultLoseResponse:
		in.stats.LostResponses++
	case faultUnavailable:
		in.stats.Unavailable++
	case faultTooManyRequests:
		in.stats.TooManyRequests++
	case faultStall:
		in.stats.Stalled++
	case faultCutBody:
		in.stats.CutBodies++
	}
}

// pass lets r through to next, counts the response if it is a replay, and
// hands a replay to the check.
func (in *injector) pass(w http.ResponseWriter, r *http.Request) {
	if in.check == nil { // a Proxy's: no ledger behind it
		in.next.ServeHTTP(w, r)
		in.countReplayed(w.Header())
		return
	}
	rw := &replayWriter{ResponseWriter: w}
	r = withRequestRuns(r)
	in.next.ServeHTTP(rw, r)
	in.countReplayed(w.Header())
	if rw.replay && r.Method != http.MethodHead {
		if key, ok := requestKey(r, in.header); ok {
			in.check(r.Context(), key, rw.status, w.Header(), rw.body.Bytes())
		}
	}
	rw.release()
}

// wait waits for d, or without end if d is negative, and reports whether
// it did so before ctx ended or the injector's owner closed.
func (in *injector) wait(ctx context.Context, d time.Duration) bool {
	var timeout <-chan time.Time
	if d >= 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-timeout:
		return true
	case <-ctx.Done():
	case <-in.done:
	}
	return false
}

func (in *injector) countReplayed(h http.Header) {
	if h.Get(idemserver.ReplayedHeader) == "true" {
		in.mu.Lock()
		in.stats.Replayed++
		in.mu.Unlock()
	}
}

func (in *injector) snapshot() Stats {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.stats
}

// close refuses requests from now on, with a reset, and waits for those
// being served to finish. The owner must have closed done first, so that no
// delay or stall holds close up.
func (in *injector) close() {
	in.mu.Lock()
	in.closed = true
	in.mu.Unlock()
	in.inFlight.Wait()
}

// identity names the logical request r is an attempt of: its idempotency
// key, or its method and URL if it has none.
func identity(r *http.Request, header string) string {
	if key, ok := requestKey(r, header); ok {
		return "key " + key
	}
	return r.Method + " " + r.URL.RequestURI()
}

// requestKey returns the idempotency key r carries in header, unquoted
// when it is well formed and as sent otherwise.
func requestKey(r *http.Request, header string) (string, bool) {
	values := r.Header.Values(header)
	if len(values) == 0 {
		return "", false
	}
	key, err := idemserver.ParseKey(values[0])
	if err != nil {
		return values[0], true
	}
	return key, true
}

// resetPrefix is what the connection carries of a response before a reset:
// a status line, and no end of the header. net/http's Transport sends a
// request with an idempotency key again, by itself, when a reused connection
// fails before the first byte of the response, so a reset without one would
// never reach the code under test; once a response has begun, it does not,
// and the client sees the connection break mid-response (io.ErrUnexpectedEOF
// or a connection reset).
const resetPrefix = "HTTP/1.1 503 Service Unavailable\r\n"

// reset ends the connection under w at once, without an answer: a status
// line and a TCP reset where the connection can be hijacked, an aborted
// response otherwise.
func reset(w http.ResponseWriter) {
	abort(w, resetPrefix)
}

// abort writes prefix, unbuffered, on the connection under w, and ends the
// connection with a TCP reset where it can be hijacked; otherwise it
// aborts the response.
func abort(w http.ResponseWriter, prefix string) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler) // HTTP/2: the server resets the stream
	}
	_, _ = io.WriteString(conn, prefix)
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0) // close with RST, not FIN
	}
	_ = conn.Close()
}

// cut sends resp, whose body is body, cut short: its status and header
// fields, the first half of body in a chunk, and then a reset in place of
// the rest and of the last chunk, so that the client's read of the body
// fails however short it is. A response that cannot have a body is
// replaced by a reset.
func cut(w http.ResponseWriter, r *http.Request, resp *http.Response, body []byte) {
	if !cuttable(r, resp.StatusCode) {
		reset(w)
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "HTTP/1.1 %03d %s\r\n", resp.StatusCode, http.StatusText(resp.StatusCode))
	h := resp.Header.Clone()
	h.Del("Content-Length")
	h.Del("Transfer-Encoding")
	h.Del("Connection")
	h.Set("Transfer-Encoding", "chunked")
	_ = h.Write(&b)
	b.WriteString("\r\n")
	if half := body[:len(body)/2]; len(half) > 0 {
		fmt.Fprintf(&b, "%x\r\n%s\r\n", len(half), half)
	}
	abort(w, b.String())
}

// cuttable reports whether the response to r, of status, has a body that
// cut can cut short.
func cuttable(r *http.Request, status int) bool {
	return r.Method != http.MethodHead && bodyAllowed(status)
}

// replayWriter passes a response through, and keeps its status and, if it
// is marked replayed when its header is written, its body. It holds a
// replay back until release, so that the replay is checked before any of
// it reaches the client: a client that took a large replay's status and
// left, and a test that asserted at once, would otherwise miss it.
type replayWriter struct {
	http.ResponseWriter
	status int
	replay bool
	body   bytes.Buffer
}

func (w *replayWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
		w.replay = w.Header().Get(idemserver.ReplayedHeader) == "true"
	}
	if w.replay {
		return // held until release
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *replayWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if w.replay {
		return w.body.Write(p)
	}
	return w.ResponseWriter.Write(p)
}

// release sends the replay held back, if any.
func (w *replayWriter) release() {
	if w.replay {
		w.ResponseWriter.WriteHeader(w.status)
		_, _ = w.ResponseWriter.Write(w.body.Bytes())
	}
}

// FlushError lets a streaming handler flush through the writer, and tells
// it when the flush failed, as the writer underneath does. A replay held
// back is not flushed.
func (w *replayWriter) FlushError() error {
	if w.replay {
		return nil
	}
	return http.NewResponseController(w.ResponseWriter).Flush()
}

// Flush implements [http.Flusher]; see FlushError.
func (w *replayWriter) Flush() { _ = w.FlushError() }

// Unwrap gives http.ResponseController the writer underneath.
func (w *replayWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// discardWriter is the ResponseWriter of a request whose response will be
// lost: it keeps the header fields and throws the rest away.
type discardWriter struct {
	header http.Header
}

func (d *discardWriter) Header() http.Header         { return d.header }
func (d *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Flush()                      {}
