package idemserver

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
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

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("connection reset") }

func TestRequestBodyUnreadable(t *testing.T) {
	h := &countingHandler{}
	r := newRequest(http.MethodPost, "/x", "k", "")
	r.Body = io.NopCloser(failingReader{})
	r.ContentLength = -1
	w := serve(Middleware(nil)(h), r)
	p := decodeProblem(t, w, ProblemBodyUnreadable, http.StatusBadRequest)
	assert.Contains(t, p.Detail, "connection reset")
	assert.Zero(t, h.calls.Load())
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
