package idemhttp

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
)

// DefaultBodyBufferLimit is how much of a request body without GetBody the
// Transport buffers so that it can be sent again.
const DefaultBodyBufferLimit = 1 << 20

// maxDrain bounds how much of a discarded response body is read so that its
// connection can be reused; a longer body is closed instead, which costs the
// connection but not the time to read it.
const maxDrain = 64 << 10

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

	buf, err := io.ReadAll(io.LimitReader(req.Body, limit+1))
	if err != nil {
		req.Body.Close()
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
	if resp == nil || resp.Body == nil {
		return
	}
	_, _ = io.CopyN(io.Discard, resp.Body, maxDrain)
	_ = resp.Body.Close()
}

// cancelOnClose ends an attempt's context when the caller closes the
// response body, keeping the context alive while the body is read.
type cancelOnClose struct {
	io.ReadCloser
	cancel func()
}

func (b *cancelOnClose) Close() error {
	err := b.ReadCloser.Close()
	b.cancel()
	return err
}
