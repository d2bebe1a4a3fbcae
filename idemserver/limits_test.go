package idemserver

import (
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// unknownLength hides a reader's length, as a chunked request body does.
type unknownLength struct{ io.Reader }

func TestRequestBodyLimit(t *testing.T) {
	const limit = 16
	for _, tt := range []struct {
		name    string
		body    string
		chunked bool
		refused bool
	}{
		{"empty", "", false, false},
		{"at limit", strings.Repeat("a", limit), false, false},
		{"over limit", strings.Repeat("a", limit+1), false, true},
		{"at limit, unknown length", strings.Repeat("a", limit), true, false},
		{"one over limit, unknown length", strings.Repeat("a", limit+1), true, true},
		{"far over limit, unknown length", strings.Repeat("a", 10*limit), true, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var got []byte
			mw := Middleware(nil, WithMaxBodyBytes(limit))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				got, _ = io.ReadAll(r.Body)
				w.WriteHeader(http.StatusCreated)
			}))
			r := newRequest(http.MethodPost, "/x", "k", tt.body)
			if tt.chunked {
				r.Body = io.NopCloser(unknownLength{strings.NewReader(tt.body)})
				r.ContentLength = -1
			}
			w := serve(mw, r)
			if tt.refused {
				decodeProblem(t, w, ProblemBodyTooLarge, http.StatusRequestEntityTooLarge)
				assert.Nil(t, got, "handler runs")
				return
			}
			assert.Equal(t, http.StatusCreated, w.Code)
			assert.Equal(t, tt.body, string(got), "handler reads the restored body")
		})
	}
}

func TestRequestBodyOuterLimit(t *testing.T) {
	// An http.MaxBytesReader in front of the middleware is a 413 too.
	mw := Middleware(nil)(&countingHandler{})
	r := newRequest(http.MethodPost, "/x", "k", strings.Repeat("a", 100))
	w := httptest.NewRecorder()
	r.Body = http.MaxBytesReader(w, r.Body, 10)
	r.ContentLength = -1
	mw.ServeHTTP(w, r)
	decodeProblem(t, w, ProblemBodyTooLarge, http.StatusRequestEntityTooLarge)
}

type failingReader struct{ err error }

func (r failingReader) Read([]byte) (int, error) { return 0, r.err }

// A body that cannot be read is refused before the claim. One whose read
// timed out (the server's ReadTimeout passed while a slow client sent it)
// is a 408, which clients send again, rather than a 400, which they take
// as final.
func TestRequestBodyUnreadable(t *testing.T) {
	for _, tt := range []struct {
		name   string
		err    error
		status int
	}{
		{"connection reset", errors.New("connection reset"), http.StatusBadRequest},
		{"read timed out", &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, http.StatusRequestTimeout},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := &countingHandler{}
			r := newRequest(http.MethodPost, "/x", "k", "")
			r.Body = io.NopCloser(failingReader{tt.err})
			r.ContentLength = -1
			w := serve(Middleware(nil)(h), r)
			p := decodeProblem(t, w, ProblemBodyUnreadable, tt.status)
			assert.Contains(t, p.Detail, tt.err.Error())
			assert.Zero(t, h.calls.Load())
		})
	}
}

func TestResponseLimit(t *testing.T) {
	const limit = 32
	for _, tt := range []struct {
		name   string
		writes []string
		stored bool
	}{
		{"at limit in one write", []string{strings.Repeat("r", limit)}, true},
		{"at limit in two writes", []string{strings.Repeat("r", limit/2), strings.Repeat("r", limit/2)}, true},
		{"over limit in one write", []string{strings.Repeat("r", limit+1)}, false},
		{"over limit in the third write", []string{strings.Repeat("a", 20), strings.Repeat("b", 10), strings.Repeat("c", 10)}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var calls int
			mw := Middleware(nil, WithMaxResponseBytes(limit))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls++
				w.Header().Set("X-Big", "yes")
				w.WriteHeader(http.StatusCreated)
				for _, s := range tt.writes {
					_, _ = io.WriteString(w, s)
				}
			}))
			first := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, http.StatusCreated, first.Code)
			assert.Equal(t, strings.Join(tt.writes, ""), first.Body.String(), "the client gets the whole response")
			assert.Equal(t, "yes", first.Header().Get("X-Big"))

			second := serve(mw, newRequest(http.MethodPost, "/x", "k", "b"))
			assert.Equal(t, 1, calls, "the key stays completed")
			assert.Equal(t, "true", second.Header().Get(ReplayedHeader))
			if tt.stored {
				assert.Equal(t, first.Body.String(), second.Body.String())
				return
			}
			p := decodeProblem(t, second, ProblemResponseNotStored, http.StatusCreated)
			assert.Contains(t, p.Detail, "201")
		})
	}
}

// stallingBody announces a long body, sends a few bytes and then stalls:
// its second Read fails, as the read deadline of a stalled connection
// makes it. It records the length of each buffer it is handed.
type stallingBody struct {
	sent  bool
	asked []int
}

func (s *stallingBody) Read(p []byte) (int, error) {
	s.asked = append(s.asked, len(p))
	if s.sent {
		return 0, errors.New("read timeout")
	}
	s.sent = true
	return copy(p, "{\"amount\":"), nil
}

func (s *stallingBody) Close() error { return nil }

// A request that announces a large body but sends little does not make
// the middleware hold memory for the announced length: the buffer grows
// with the bytes that arrive.
func TestRequestBodyBufferGrowsWithBytesRead(t *testing.T) {
	const announced = 1 << 20
	h := &countingHandler{}
	mw := Middleware(nil, WithMaxBodyBytes(announced))(h)
	r := newRequest(http.MethodPost, "/x", "k", "")
	var before, after runtime.MemStats
	for range 3 { // later rounds draw on pooled buffers
		body := &stallingBody{}
		r.Body, r.ContentLength = body, announced
		runtime.ReadMemStats(&before)
		w := serve(mw, r)
		runtime.ReadMemStats(&after)
		decodeProblem(t, w, ProblemBodyUnreadable, http.StatusBadRequest)
		for _, n := range body.asked {
			assert.LessOrEqual(t, n, maxPooledBuffer, "a buffer sized for the announced length")
		}
		assert.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(announced/4), "bytes allocated")
	}
	assert.Zero(t, h.calls.Load())
}

func TestReadBodySizes(t *testing.T) {
	const limit = 3*4096 + 17
	sizes := []int{0, 1, 4095, 4096, 4097, 8193, limit, limit + 1, 3 * limit}
	readers := []struct {
		name string
		wrap func(io.Reader) io.Reader
	}{
		{"whole", func(r io.Reader) io.Reader { return r }},
		{"one byte at a time", iotest.OneByteReader},
		{"half reads", iotest.HalfReader},
		{"data with EOF", iotest.DataErrReader},
	}
	pooled := []int{0, 100, 4096, maxPooledBuffer}
	for _, size := range sizes {
		want := strings.Repeat("0123456789abcdef", size/16+1)[:size]
		for _, known := range []bool{true, false} {
			for _, rd := range readers {
				for _, capacity := range pooled {
					name := fmt.Sprintf("size=%d/known=%v/%s/pooled=%d", size, known, rd.name, capacity)
					t.Run(name, func(t *testing.T) {
						length := int64(size)
						if !known {
							length = -1
						} else if size > limit {
							length = limit // a body longer than announced
						}
						body := io.NopCloser(rd.wrap(strings.NewReader(want)))
						got, err := readBody(body, length, limit, make([]byte, 0, capacity))
						if size > limit {
							assert.ErrorIs(t, err, errBodyTooLarge)
							return
						}
						require.NoError(t, err)
						assert.Equal(t, want, string(got))
						assert.LessOrEqual(t, cap(got), max(capacity, limit+1), "the buffer grew past the limit")
					})
				}
			}
		}
	}
}

// A body limit of any size works: one at the largest int64, "no limit",
// does not overflow when the buffer grows toward it.
func TestRequestBodyHugeLimit(t *testing.T) {
	body := strings.Repeat("a", 10<<10)
	for _, chunked := range []bool{false, true} {
		t.Run(fmt.Sprint("chunked=", chunked), func(t *testing.T) {
			var got []byte
			mw := Middleware(nil, WithMaxBodyBytes(math.MaxInt64))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				got, _ = io.ReadAll(r.Body)
				w.WriteHeader(http.StatusCreated)
			}))
			r := newRequest(http.MethodPost, "/x", "k", body)
			if chunked {
				r.Body = io.NopCloser(unknownLength{strings.NewReader(body)})
				r.ContentLength = -1
			}
			w := serve(mw, r)
			assert.Equal(t, http.StatusCreated, w.Code)
			assert.Equal(t, body, string(got))
		})
	}
}

// emptyReadFails is a body that fails a read into an empty buffer: a
// connection's body answers one with 0 and no error, so a reader that
// makes one would make it again, forever, spinning on the connection.
type emptyReadFails struct {
	io.Reader
	empty bool
}

func (r *emptyReadFails) Read(p []byte) (int, error) {
	if len(p) == 0 {
		r.empty = true
		return 0, errors.New("read into an empty buffer")
	}
	return r.Reader.Read(p)
}

// A request may announce a body of the largest length net/http accepts,
// math.MaxInt64. Under a limit of math.MaxInt64, "no limit", no body can
// be that long: it is refused as too large rather than read into a buffer
// sized by an overflowed length.
func TestRequestBodyAnnouncedAtLargestLength(t *testing.T) {
	h := &countingHandler{}
	mw := Middleware(nil, WithMaxBodyBytes(math.MaxInt64))(h)
	r := newRequest(http.MethodPost, "/x", "k", "")
	body := &emptyReadFails{Reader: strings.NewReader("abc")}
	r.Body, r.ContentLength = io.NopCloser(body), math.MaxInt64
	w := serve(mw, r)
	decodeProblem(t, w, ProblemBodyTooLarge, http.StatusRequestEntityTooLarge)
	assert.False(t, body.empty, "the body was read into an empty buffer")
	assert.Zero(t, h.calls.Load())
}

func TestDefaultLimits(t *testing.T) {
	// The limits the documentation gives for a middleware without options:
	// request and response bodies of 1 MiB, a Retry-After of one second.
	require.EqualValues(t, 1<<20, DefaultMaxBodyBytes)
	require.EqualValues(t, 1<<20, DefaultMaxResponseBytes)
	mw := Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if !assert.NoError(t, err) {
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(body) // echoes the request: the response is as large
	}))
	for _, tt := range []struct {
		name           string
		request        int
		status         int
		problem        string
		replayWithBody bool
	}{
		{"request and response at the limit", DefaultMaxBodyBytes, http.StatusCreated, "", true},
		{"request over the limit", DefaultMaxBodyBytes + 1, http.StatusRequestEntityTooLarge, ProblemBodyTooLarge, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			key := fmt.Sprint("k-", tt.request)
			body := strings.Repeat("a", tt.request)
			w := serve(mw, newRequest(http.MethodPost, "/x", key, body))
			if tt.problem != "" {
				decodeProblem(t, w, tt.problem, tt.status)
				return
			}
			require.Equal(t, tt.status, w.Code)
			replay := serve(mw, newRequest(http.MethodPost, "/x", key, body))
			require.Equal(t, tt.status, replay.Code)
			assert.Equal(t, "true", replay.Header().Get(ReplayedHeader))
			assert.Equal(t, body, replay.Body.String(), "replayed whole")
		})
	}
	t.Run("response over the limit", func(t *testing.T) {
		big := Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(strings.Repeat("b", DefaultMaxResponseBytes+1)))
		}))
		first := serve(big, newRequest(http.MethodPost, "/x", "k", ""))
		require.Equal(t, http.StatusCreated, first.Code)
		assert.Equal(t, DefaultMaxResponseBytes+1, first.Body.Len(), "the first client gets it all")
		decodeProblem(t, serve(big, newRequest(http.MethodPost, "/x", "k", "")), ProblemResponseNotStored, http.StatusCreated)
	})
	t.Run("Retry-After", func(t *testing.T) {
		release := make(chan struct{})
		started := make(chan struct{})
		slow := Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(started)
			<-release
			w.WriteHeader(http.StatusCreated)
		}))
		done := serveAsync(slow, newRequest(http.MethodPost, "/x", "k", ""))
		<-started
		w := serve(slow, newRequest(http.MethodPost, "/x", "k", ""))
		close(release)
		decodeProblem(t, w, ProblemInProgress, http.StatusConflict)
		assert.Equal(t, "1", w.Header().Get("Retry-After"))
		assert.Equal(t, http.StatusCreated, (<-done).Code)
	})
}
