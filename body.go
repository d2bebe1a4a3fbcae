package idemhttp

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"time"
)

// DefaultBodyBufferLimit is how much of a request body without GetBody the
// Transport buffers so that it can be sent again.
const DefaultBodyBufferLimit = 1 << 20

// maxDrain and maxDrainTime bound how much of a response body that is not
// returned at once is read, and for how long, so that its connection can be
// reused. A longer or slower body is closed instead, which costs the
// connection but not the time to read it.
const (
	maxDrain     = 64 << 10
	maxDrainTime = time.Second
)

// requestBody hands each attempt a fresh copy of the caller's request body
// and sees that the caller's body is closed exactly once: by the base
// transport when the first attempt carries it, else by close.
type requestBody struct {
	// unsent is the caller's body while nobody has taken charge of closing
	// it; nil once an attempt carries it or it has been closed.
	unsent io.Closer

	// getBody returns a fresh copy for attempts after the first; nil when
	// the body cannot be replayed (or there is no body).
	getBody func() (io.ReadCloser, error)
	// first is what the first attempt sends.
	first io.ReadCloser
	// replayable reports whether attempts after the first can be sent.
	replayable bool
}

// newRequestBody prepares req's body for one or more attempts. A body with
// GetBody is rewound with it; a body without is buffered up to limit bytes,
// and one larger than that is streamed once and marked not replayable.
// On error the caller's body has been closed.
func newRequestBody(req *http.Request, limit int64) (requestBody, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return requestBody{first: req.Body, replayable: true}, nil
	}
	if req.GetBody != nil {
		return requestBody{unsent: req.Body, first: req.Body, getBody: req.GetBody, replayable: true}, nil
	}

	buf, err := readRequestBody(req.Context(), req.Body, limit)
	if err != nil {
		return requestBody{}, fmt.Errorf("idemhttp: reading request body: %w", err)
	}
	if int64(len(buf)) > limit {
		// Too large to keep: send what was read followed by the rest, once.
		stream := struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf), req.Body), req.Body}
		return requestBody{unsent: req.Body, first: stream}, nil
	}
	req.Body.Close()
	getBody := func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(buf)), nil
	}
	first, _ := getBody()
	return requestBody{getBody: getBody, first: first, replayable: true}, nil
}

// readRequestBody reads up to limit+1 bytes of body, giving up when ctx
// ends, as net/http does for a body it is sending. On error body is closed.
// A read still blocked when ctx ends is unblocked by closing the body; the
// goroutine running it ends when the read returns.
func readRequestBody(ctx context.Context, body io.ReadCloser, limit int64) ([]byte, error) {
	n := limit + 1
	if n <= 0 { // limit was math.MaxInt64
		n = limit
	}
	read := func() ([]byte, error) { return io.ReadAll(io.LimitReader(body, n)) }
	if ctx.Done() == nil {
		buf, err := read()
		if err != nil {
			body.Close()
		}
		return buf, err
	}
	type result struct {
		buf []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		buf, err := read()
		done <- result{buf, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			body.Close()
		}
		return r.buf, r.err
	case <-ctx.Done():
		body.Close()
		return nil, context.Cause(ctx)
	}
}

// forAttempt returns the body for attempt n (from 1) and the GetBody to put
// on its request, so the base transport can rewind it too.
func (b *requestBody) forAttempt(n int) (io.ReadCloser, func() (io.ReadCloser, error), error) {
	if n == 1 {
		b.unsent = nil // the base transport closes what it is given
		return b.first, b.getBody, nil
	}
	if b.getBody == nil {
		return b.first, nil, nil // no body
	}
	rc, err := b.getBody()
	if err != nil {
		return nil, nil, fmt.Errorf("idemhttp: GetBody: %w", err)
	}
	return rc, b.getBody, nil
}

// close closes the caller's body if no attempt carried it, for requests
// refused before their first attempt.
func (b *requestBody) close() {
	if b.unsent != nil {
		b.unsent.Close()
		b.unsent = nil
	}
}

// discard drains a bounded amount of a response body that will not be
// returned to the caller, then closes it, so its connection can be reused.
func discard(resp *http.Response) {
	if resp != nil && resp.Body != nil {
		readBounded(resp.Body)
	}
}

// hold readies a retried attempt's outcome to be kept during the wait
// before the next attempt: its response body is read into memory, so its
// connection is free for that attempt, and its context is released. If the
// next attempt is refused, the held response is what the caller gets. A
// body too long or too slow to hold is dropped, and the outcome becomes an
// error saying so.
func hold(o outcome) outcome {
	defer o.cancel()
	if o.resp == nil {
		return o
	}
	buf, ok := readBounded(o.resp.Body)
	if !ok {
		o.err = fmt.Errorf("idemhttp: %d response dropped: body longer than %d bytes or slower than %v",
			o.resp.StatusCode, maxDrain, maxDrainTime)
		o.resp = nil
		return o
	}
	o.resp.Body = io.NopCloser(bytes.NewReader(buf))
	return o
}

// readBounded reads body to its end, unless that takes more than maxDrain
// bytes or maxDrainTime, and closes it. ok reports whether it got to the end.
func readBounded(body io.ReadCloser) (buf []byte, ok bool) {
	// Closing the body unblocks a read stalled on a silent server.
	timer := time.AfterFunc(maxDrainTime, func() { body.Close() })
	buf, err := io.ReadAll(io.LimitReader(body, maxDrain+1))
	inTime := timer.Stop()
	body.Close()
	return buf, err == nil && inTime && len(buf) <= maxDrain
}

// cancelBody is the body of a response whose attempt has a context of its
// own (an attempt timeout), which must live while the body is read and
// ends when it is closed.
type cancelBody struct {
	io.ReadCloser
	cancel context.CancelFunc // ends the attempt's context
}

func (b *cancelBody) Close() error {
	err := b.ReadCloser.Close()
	b.cancel()
	return err
}

// responseBody is the body of the response RoundTrip returns when the
// operation's key may be released once the outcome has reached the
// caller. It also ends the attempt's context, which must live while the
// body is read.
//
// The key is released when a read reaches the end of the body, or when the
// body is closed with no read failed and none in progress. A read that
// fails (the connection cut, the attempt timeout ending the read) keeps it
// pending, and so does a Close that interrupts a Read: a watchdog closing a
// stalled body has not seen the outcome either. Whichever of these comes
// first decides, once.
type responseBody struct {
	io.ReadCloser
	cancel context.CancelFunc // ends the attempt's context

	// The operation's key, released once the body is delivered; operation
	// is "" when there is none to release.
	t              *Transport
	ctx            context.Context
	operation, key string
	reading        atomic.Int32 // Reads in progress
	decided        atomic.Bool  // the key was released or is kept
	// flight holds the operation's flight, which ends once the key's fate
	// is decided, after its release (see flights).
	flight *flights
	// held, for an operation made with HoldKey, is where the key's fate is
	// recorded for Settle, which releases it instead.
	held *heldKey
}

func (b *responseBody) Read(p []byte) (int, error) {
	if b.operation == "" {
		return b.ReadCloser.Read(p)
	}
	b.reading.Add(1)
	n, err := b.ReadCloser.Read(p)
	b.reading.Add(-1)
	if err != nil && b.decided.CompareAndSwap(false, true) {
		b.settle(err == io.EOF)
	}
	return n, err
}

// settle decides the key's fate (see decideKey), then ends the
// operation's flight, even if the KeyStore panics: a flight left open
// would refuse every later call of the operation.
func (b *responseBody) settle(release bool) {
	defer b.endFlight()
	b.decideKey(release)
}

// decideKey releases the key if release is set; for an operation made
// with HoldKey it records instead whether Settle may release it.
func (b *responseBody) decideKey(release bool) {
	switch {
	case b.held != nil:
		b.held.decide(release)
	case release:
		b.t.releaseKey(b.ctx, b.operation, b.key)
	}
}

func (b *responseBody) Close() error {
	// A Close while a Read is blocked decides before that Read fails
	// because of it: the key is kept.
	decide := b.operation != "" && b.decided.CompareAndSwap(false, true)
	release := decide && b.reading.Load() == 0
	if decide {
		// After the release, and even if the base body or the KeyStore
		// panics (see settle).
		defer b.endFlight()
	}
	err := b.ReadCloser.Close()
	b.cancel()
	if decide {
		b.decideKey(release)
	}
	return err
}

// endFlight ends the operation's flight, if the body holds it.
func (b *responseBody) endFlight() {
	if b.flight != nil {
		b.flight.end(b.operation)
	}
}

// bodyWatch notes whether a base transport read an attempt's request
// body. A base transport reads a request's body only once it has a
// connection to send it on, so a body that was read means the request's
// header may have reached the server, whatever error the attempt ends
// with: the body's own read error is what net/http returns then, and it
// can be any error, one that looks like a refused dial included. The copies
// the base transport takes from the attempt's GetBody are watched too: it
// may send one of them instead of the body it was given, as net/http does
// when it rewinds a request whose write failed on a reused connection.
type bodyWatch struct {
	read    atomic.Bool
	getBody func() (io.ReadCloser, error) // the attempt's own, or nil
	first   watchedBody                   // the body the attempt is given
}

// newBodyWatch returns a watch of body and of the copies getBody makes.
func newBodyWatch(body io.ReadCloser, getBody func() (io.ReadCloser, error)) *bodyWatch {
	w := &bodyWatch{getBody: getBody}
	w.first = watchedBody{ReadCloser: body, watch: w}
	return w
}

// rewind is the GetBody of a watched attempt: a copy that is watched too.
func (w *bodyWatch) rewind() (io.ReadCloser, error) {
	rc, err := w.getBody()
	if err != nil {
		return nil, err
	}
	return &watchedBody{ReadCloser: rc, watch: w}, nil
}

// watchedBody is a request body whose reads its watch notes.
type watchedBody struct {
	io.ReadCloser
	watch *bodyWatch
}

func (b *watchedBody) Read(p []byte) (int, error) {
	b.watch.read.Store(true)
	return b.ReadCloser.Read(p)
}
