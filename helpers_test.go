package idemhttp

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// backoffFunc adapts a function to Backoff.
type backoffFunc func(retry int) time.Duration

func (f backoffFunc) Delay(retry int) time.Duration { return f(retry) }

// noWait retries at once, for tests that are not about waiting.
var noWait = backoffFunc(func(int) time.Duration { return 0 })

// roundTripFunc adapts a function to http.RoundTripper.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// received is one request as the server saw it.
type received struct {
	Method string
	Key    string
	Header http.Header
	Body   []byte
}

// server is an httptest server that answers attempt i with reply[i] (the
// last reply repeats) and records what it received.
type server struct {
	*httptest.Server
	mu    sync.Mutex
	reqs  []received
	hits  atomic.Int32
	reply []func(w http.ResponseWriter, r *http.Request)
}

func newServer(t *testing.T, reply ...func(w http.ResponseWriter, r *http.Request)) *server {
	t.Helper()
	s := &server{reply: reply}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.reqs = append(s.reqs, received{Method: r.Method, Key: r.Header.Get("Idempotency-Key"), Header: r.Header.Clone(), Body: body})
		s.mu.Unlock()
		n := int(s.hits.Add(1)) - 1
		s.reply[min(n, len(s.reply)-1)](w, r)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *server) received() []received {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]received(nil), s.reqs...)
}

func (s *server) keys() []string {
	var keys []string
	for _, r := range s.received() {
		keys = append(keys, r.Key)
	}
	return keys
}

// status replies with code, optional header pairs, and a short body.
func status(code int, headerPairs ...string) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		for i := 0; i+1 < len(headerPairs); i += 2 {
			w.Header().Set(headerPairs[i], headerPairs[i+1])
		}
		w.WriteHeader(code)
		io.WriteString(w, http.StatusText(code))
	}
}

// hangUp closes the connection without a response, as a server that
// crashed mid-request would: the client sees EOF before a response.
func hangUp(w http.ResponseWriter, r *http.Request) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		conn.Close()
	}
}

// newBaseTransport returns a fresh http.Transport, closed at test end, so
// tests share no connections.
func newBaseTransport(t *testing.T) *http.Transport {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

// trackedBody is a request body that counts Close calls and remembers
// whether it was read.
type trackedBody struct {
	r      io.Reader
	closes atomic.Int32
}

func newTrackedBody(s string) *trackedBody { return &trackedBody{r: strings.NewReader(s)} }

func (b *trackedBody) Read(p []byte) (int, error) { return b.r.Read(p) }
func (b *trackedBody) Close() error               { b.closes.Add(1); return nil }

// okResponse builds a 200 response for fake transports.
func okResponse(r *http.Request, code int, header ...string) *http.Response {
	h := http.Header{}
	for i := 0; i+1 < len(header); i += 2 {
		h.Set(header[i], header[i+1])
	}
	return &http.Response{
		StatusCode: code, Status: http.StatusText(code), Header: h,
		Body: io.NopCloser(bytes.NewReader(nil)), Request: r, ProtoMajor: 1, ProtoMinor: 1,
	}
}

// recorder collects values added by concurrent goroutines.
type recorder[T any] struct {
	mu    sync.Mutex
	items []T
}

// add appends v and returns how many values there are with it.
func (r *recorder[T]) add(v T) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.items = append(r.items, v)
	return len(r.items)
}

// all returns a copy of the values added so far, in order.
func (r *recorder[T]) all() []T {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]T(nil), r.items...)
}
